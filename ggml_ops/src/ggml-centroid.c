// ggml_centroid_attn and ggml_cluster_update: parameter validation and graph node construction (compiled into
// ggml-base).
#include "ggml-centroid.h"

#include "ggml-impl.h"

#include <math.h>
#include <stdint.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#if defined(_MSC_VER)
#    define CENTROID_THREAD_LOCAL __declspec(thread)
#else
#    define CENTROID_THREAD_LOCAL _Thread_local
#endif

static CENTROID_THREAD_LOCAL char g_centroid_msg[512];

static const char * centroid_fail(const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    int n = snprintf(g_centroid_msg, sizeof(g_centroid_msg), "ggml_centroid_attn: ");
    vsnprintf(g_centroid_msg + n, sizeof(g_centroid_msg) - n, fmt, args);
    va_end(args);
    return g_centroid_msg;
}

struct ggml_centroid_params ggml_centroid_default_params(void) {
    struct ggml_centroid_params p = {
        /*.keep             =*/ 1.0f,
        /*.threshold_coarse =*/ 0.0f,
        /*.group            =*/ GGML_CENTROID_GROUP_MAX,
        /*.scale            =*/ 0.0f,
        /*.softcap          =*/ 0.0f,
        /*.var_weight       =*/ 0.0f,
    };
    return p;
}

static bool centroid_kv_type_ok(enum ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

// a table of per-(KV head, stream) rows: [width, n, n_head_kv, ns] f32 with contiguous rows
static const char * centroid_check_table(const char * name, const struct ggml_tensor * t, int64_t width,
                                         int64_t n_head_kv, int64_t ns) {
    if (t->type != GGML_TYPE_F32 || t->ne[0] != width || t->ne[1] < 1 || t->ne[2] != n_head_kv || t->ne[3] != ns ||
        t->nb[0] != sizeof(float)) {
        return centroid_fail("%s must be f32 [width=%lld, n >= 1, n_head_kv=%lld, ns=%lld] with contiguous rows, got "
                             "%s [%lld, %lld, %lld, %lld]", name, (long long) width, (long long) n_head_kv,
                             (long long) ns, ggml_type_name(t->type), (long long) t->ne[0], (long long) t->ne[1],
                             (long long) t->ne[2], (long long) t->ne[3]);
    }
    return NULL;
}

// an index map: [n, n_head_kv, ns, 1] i32 with contiguous rows
static const char * centroid_check_map(const char * name, const struct ggml_tensor * t, int64_t n,
                                       int64_t n_head_kv, int64_t ns) {
    if (t->type != GGML_TYPE_I32 || t->ne[0] != n || t->ne[1] != n_head_kv || t->ne[2] != ns || t->ne[3] != 1 ||
        t->nb[0] != sizeof(int32_t)) {
        return centroid_fail("%s must be i32 [%lld, n_head_kv=%lld, ns=%lld, 1] with contiguous rows, got %s "
                             "[%lld, %lld, %lld, %lld]", name, (long long) n, (long long) n_head_kv, (long long) ns,
                             ggml_type_name(t->type), (long long) t->ne[0], (long long) t->ne[1],
                             (long long) t->ne[2], (long long) t->ne[3]);
    }
    return NULL;
}

const char * ggml_centroid_attn_check(
        const struct ggml_tensor * q, const struct ggml_tensor * k, const struct ggml_tensor * v,
        const struct ggml_tensor * mask, const struct ggml_tensor * cent, const struct ggml_tensor * cell,
        const struct ggml_tensor * coarse, const struct ggml_tensor * parent,
        const struct ggml_centroid_params * p) {
    if (!q || !k || !v || !cent || !cell || !p) {
        return centroid_fail("q, k, v, cent, cell and params are required");
    }
    const int64_t d = q->ne[0], n_q = q->ne[1], n_head = q->ne[2], ns = q->ne[3];
    const int64_t n_kv = k->ne[1], n_head_kv = k->ne[2];
    if (q->type != GGML_TYPE_F32) {
        return centroid_fail("q must be f32, got %s", ggml_type_name(q->type));
    }
    if (!centroid_kv_type_ok(k->type) || v->type != k->type) {
        return centroid_fail("K/V type %s/%s not supported (f32, f16 or bf16, the same for both)",
                             ggml_type_name(k->type), ggml_type_name(v->type));
    }
    if (k->ne[0] != d) {
        return centroid_fail("head dim of q (%lld) and k (%lld) differ", (long long) d, (long long) k->ne[0]);
    }
    if (n_kv < 1 || n_head_kv < 1 || n_head % n_head_kv != 0) {
        return centroid_fail("n_head (%lld) must be a multiple of n_head_kv (%lld)", (long long) n_head,
                             (long long) n_head_kv);
    }
    if (k->ne[3] != ns || v->ne[1] != n_kv || v->ne[2] != n_head_kv || v->ne[3] != ns) {
        return centroid_fail("k [%lld,%lld,%lld,%lld] and v [%lld,%lld,%lld,%lld] do not match q's streams/heads",
                             (long long) k->ne[0], (long long) k->ne[1], (long long) k->ne[2], (long long) k->ne[3],
                             (long long) v->ne[0], (long long) v->ne[1], (long long) v->ne[2], (long long) v->ne[3]);
    }
    if (k->nb[0] != ggml_type_size(k->type) || v->nb[0] != ggml_type_size(v->type) || q->nb[0] != sizeof(float)) {
        return centroid_fail("rows of q, k and v must be contiguous");
    }
    if (mask) {
        if (mask->type != GGML_TYPE_F16) {
            return centroid_fail("mask must be f16 (0 / -inf), got %s", ggml_type_name(mask->type));
        }
        if (mask->ne[0] != n_kv || mask->ne[1] < n_q || mask->ne[2] != 1 || (mask->ne[3] != ns && mask->ne[3] != 1)) {
            return centroid_fail("mask must be [n_kv=%lld, >=n_q=%lld, 1, ns or 1]", (long long) n_kv, (long long) n_q);
        }
    }
    // the table's width says whether it holds variances: d + 1 (centroid, size) or 2d + 1 (then the variances)
    if (cent->ne[0] != d + 1 && cent->ne[0] != 2*d + 1) {
        return centroid_fail("cent rows must hold d + 1 = %lld (centroid, size) or 2d + 1 = %lld (and the variances) "
                             "floats, got %lld", (long long) (d + 1), (long long) (2*d + 1), (long long) cent->ne[0]);
    }
    const char * err = centroid_check_table("cent", cent, cent->ne[0], n_head_kv, ns);
    if (!err) {
        err = centroid_check_map("cell", cell, n_kv, n_head_kv, ns);
    }
    if (!err && (coarse == NULL) != (parent == NULL)) {
        err = centroid_fail("coarse and parent go together (two levels) or are both NULL");
    }
    if (!err && coarse) {
        err = centroid_check_table("coarse", coarse, cent->ne[0], n_head_kv, ns);
    }
    if (!err && parent) {
        err = centroid_check_map("parent", parent, cent->ne[1], n_head_kv, ns);
    }
    if (err) {
        return err;
    }
    if (!isfinite(p->keep) || !isfinite(p->threshold_coarse)) {
        return centroid_fail("keep and threshold_coarse must be finite (keep %g, threshold_coarse %g)",
                             (double) p->keep, (double) p->threshold_coarse);
    }
    if (p->group != GGML_CENTROID_GROUP_MAX && p->group != GGML_CENTROID_GROUP_MEAN) {
        return centroid_fail("group must be max or mean");
    }
    if (!(p->scale >= 0.0f) || !isfinite(p->scale)) {
        return centroid_fail("scale = %g must be finite and > 0 (0: 1/sqrt(head_dim))", (double) p->scale);
    }
    if (!(p->softcap >= 0.0f) || !isfinite(p->softcap)) {
        return centroid_fail("softcap = %g must be >= 0", (double) p->softcap);
    }
    if (!(p->var_weight >= 0.0f) || !isfinite(p->var_weight)) {
        return centroid_fail("var_weight = %g must be finite and >= 0", (double) p->var_weight);
    }
    if (p->var_weight > 0.0f && cent->ne[0] != 2*d + 1) {
        return centroid_fail("var_weight = %g needs tables with the variances (rows of 2d + 1 = %lld floats), got %lld",
                             (double) p->var_weight, (long long) (2*d + 1), (long long) cent->ne[0]);
    }
    return NULL;
}

struct ggml_tensor * ggml_centroid_attn(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * cent,
        struct ggml_tensor  * cell,
        struct ggml_tensor  * coarse,
        struct ggml_tensor  * parent,
        struct ggml_centroid_params params) {
    const char * err = ggml_centroid_attn_check(q, k, v, mask, cent, cell, coarse, parent, &params);
    if (err) {
        GGML_ABORT("%s", err);
    }
    struct ggml_centroid_op_params op = {
        /*.keep             =*/ params.keep,
        /*.threshold_coarse =*/ params.threshold_coarse,
        /*.group            =*/ (int32_t) params.group,
        /*.scale            =*/ params.scale > 0.0f ? params.scale : 1.0f / sqrtf((float) q->ne[0]),
        /*.softcap          =*/ params.softcap,
        /*.var_weight       =*/ params.var_weight,
    };
    const int64_t ne[4] = { v->ne[0], q->ne[2], q->ne[1], q->ne[3] };
    struct ggml_tensor * result = ggml_new_tensor(ctx, GGML_TYPE_F32, 4, ne);

    static_assert(sizeof(op) <= GGML_MAX_OP_PARAMS, "ggml_centroid_op_params too large");
    ggml_set_op_params(result, &op, sizeof(op));
    result->op     = GGML_OP_CENTROID_ATTN;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = v;
    result->src[3] = mask;
    result->src[4] = cent;
    result->src[5] = cell;
    result->src[6] = coarse;
    result->src[7] = parent;
    return result;
}

struct ggml_centroid_op_params ggml_centroid_get_op_params(const struct ggml_tensor * op) {
    GGML_ASSERT(op->op == GGML_OP_CENTROID_ATTN);
    struct ggml_centroid_op_params p;
    memcpy(&p, op->op_params, sizeof(p));
    return p;
}

const char * ggml_cluster_update_check(
        const struct ggml_tensor * x, const struct ggml_tensor * assign, const struct ggml_tensor * prev,
        int64_t n_clusters, enum ggml_cluster_mode mode) {
    if (!x || !assign) {
        return centroid_fail("ggml_cluster_update: x and assign are required");
    }
    const int64_t d = x->ne[0], P = x->ne[1], H = x->ne[2];
    if (x->type != GGML_TYPE_F32 || x->ne[3] != 1 || x->nb[0] != sizeof(float)) {
        return centroid_fail("ggml_cluster_update: x must be f32 [d, P, H] with contiguous rows");
    }
    if (assign->type != GGML_TYPE_I32 || assign->ne[0] != P || assign->ne[1] != H || assign->ne[2] != 1 ||
        assign->ne[3] != 1 || assign->nb[0] != sizeof(int32_t)) {
        return centroid_fail("ggml_cluster_update: assign must be i32 [P=%lld, H=%lld]", (long long) P, (long long) H);
    }
    if (n_clusters < 1 || n_clusters > INT32_MAX) {
        return centroid_fail("ggml_cluster_update: n_clusters = %lld must be >= 1", (long long) n_clusters);
    }
    if (mode == GGML_CLUSTER_SPHERICAL) {
        if (!prev || prev->type != GGML_TYPE_F32 || prev->ne[0] != d || prev->ne[1] != n_clusters || prev->ne[2] != H ||
            prev->ne[3] != 1 || prev->nb[0] != sizeof(float)) {
            return centroid_fail("ggml_cluster_update: the spherical update needs prev f32 [d=%lld, n=%lld, H=%lld]",
                                 (long long) d, (long long) n_clusters, (long long) H);
        }
    } else if (mode == GGML_CLUSTER_TABLE || mode == GGML_CLUSTER_TABLE_VAR) {
        if (prev) {
            return centroid_fail("ggml_cluster_update: the table modes take no prev");
        }
    } else {
        return centroid_fail("ggml_cluster_update: mode must be spherical, table or table_var (assignments: "
                             "ggml_cluster_assign)");
    }
    return NULL;
}

struct ggml_tensor * ggml_cluster_update(
        struct ggml_context * ctx,
        struct ggml_tensor  * x,
        struct ggml_tensor  * assign,
        struct ggml_tensor  * prev,
        int64_t               n_clusters,
        enum ggml_cluster_mode mode) {
    const char * err = ggml_cluster_update_check(x, assign, prev, n_clusters, mode);
    if (err) {
        GGML_ABORT("%s", err);
    }
    const int64_t width = mode == GGML_CLUSTER_TABLE ? x->ne[0] + 1 : mode == GGML_CLUSTER_TABLE_VAR ? 2*x->ne[0] + 1 : x->ne[0];
    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, width, n_clusters, x->ne[2]);
    const int32_t op_params[1] = { (int32_t) mode };
    ggml_set_op_params(result, op_params, sizeof(op_params));
    result->op     = GGML_OP_CLUSTER_UPDATE;
    result->src[0] = x;
    result->src[1] = assign;
    result->src[2] = prev;
    return result;
}

const char * ggml_cluster_assign_check(const struct ggml_tensor * sim) {
    if (!sim || sim->type != GGML_TYPE_F32 || sim->ne[3] != 1 || sim->nb[0] != sizeof(float) || sim->ne[0] < 1 ||
        sim->ne[0] > INT32_MAX) {
        return centroid_fail("ggml_cluster_assign: sim must be f32 [n_clusters, P, H] with contiguous rows");
    }
    return NULL;
}

struct ggml_tensor * ggml_cluster_assign(struct ggml_context * ctx, struct ggml_tensor * sim) {
    const char * err = ggml_cluster_assign_check(sim);
    if (err) {
        GGML_ABORT("%s", err);
    }
    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, sim->ne[1], sim->ne[2]);
    const int32_t op_params[1] = { (int32_t) GGML_CLUSTER_ASSIGN };
    ggml_set_op_params(result, op_params, sizeof(op_params));
    result->op     = GGML_OP_CLUSTER_UPDATE;
    result->src[0] = sim;
    return result;
}
