// ggml_sparq_attn: parameter validation and graph node construction (compiled into ggml-base).
#include "ggml-sparq.h"

#include "ggml-impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#if defined(_MSC_VER)
#    define SPARQ_THREAD_LOCAL __declspec(thread)
#else
#    define SPARQ_THREAD_LOCAL _Thread_local
#endif

static SPARQ_THREAD_LOCAL char g_sparq_msg[512];

// The message of a failed check, "<op>: <what>", in a thread-local buffer (valid until the thread's next check).
static const char * op_fail(const char * op, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    int n = snprintf(g_sparq_msg, sizeof(g_sparq_msg), "%s: ", op);
    vsnprintf(g_sparq_msg + n, sizeof(g_sparq_msg) - n, fmt, args);
    va_end(args);
    return g_sparq_msg;
}
#define sparq_fail(...)  op_fail("ggml_sparq_attn", __VA_ARGS__)
#define vsum_fail(...)   op_fail("ggml_sparq_vsum_rows", __VA_ARGS__)
#define kstat_fail(...)  op_fail("ggml_sparq_kstat_rows", __VA_ARGS__)
#define upkeep_fail(...) op_fail("ggml_sparq_decode_upkeep", __VA_ARGS__)
#define index_fail(...)  op_fail("ggml_sparq_index_write", __VA_ARGS__)

struct ggml_sparq_params ggml_sparq_default_params(void) {
    struct ggml_sparq_params p = {
        /*.k1              =*/ 32,
        /*.k2              =*/ 128,
        /*.window          =*/ -1,
        /*.sinks           =*/ 0,
        /*.mean            =*/ GGML_SPARQ_MEAN_AUTO,
        /*.policy          =*/ GGML_SPARQ_POLICY_SPARQ,
        /*.scale           =*/ 0.0f,
        /*.softcap         =*/ 0.0f,
        /*.sparse_v_thresh =*/ 0.0f,
        /*.select          =*/ GGML_SPARQ_SELECT_Q,
    };
    return p;
}

static bool sparq_float_type(enum ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

// The KV cache types llama.cpp offers for K and V (-ctk/-ctv) that the op reads
static bool sparq_kv_type_ok(enum ggml_type t) {
    return sparq_float_type(t) || t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 ||
           t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
}

const char * ggml_sparq_attn_check(
        const struct ggml_tensor * q, const struct ggml_tensor * k, const struct ggml_tensor * kt,
        const struct ggml_tensor * v, const struct ggml_tensor * mask, const struct ggml_tensor * vsum,
        const struct ggml_sparq_params * p) {
    if (!q || !k || !v || !p) {
        return sparq_fail("q, k, v and params are required");
    }
    const int64_t d = q->ne[0], n_q = q->ne[1], n_head = q->ne[2], ns = q->ne[3];
    const int64_t n_kv = k->ne[1], n_head_kv = k->ne[2], d_v = v->ne[0];
    if (q->type != GGML_TYPE_F32) {
        return sparq_fail("q must be f32, got %s", ggml_type_name(q->type));
    }
    if (!sparq_kv_type_ok(k->type) || !sparq_kv_type_ok(v->type)) {
        return sparq_fail("K/V type %s/%s not supported (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1)",
                          ggml_type_name(k->type), ggml_type_name(v->type));
    }
    if (q->ne[0] % ggml_blck_size(k->type) != 0 || v->ne[0] % ggml_blck_size(v->type) != 0) {
        return sparq_fail("head dims %lld/%lld are not multiples of the K/V types' blocks (%s/%s)",
                          (long long) q->ne[0], (long long) v->ne[0], ggml_type_name(k->type), ggml_type_name(v->type));
    }
    if (k->ne[0] != d) {
        return sparq_fail("head dim of q (%lld) and k (%lld) differ", (long long) d, (long long) k->ne[0]);
    }
    if (n_kv < 1 || n_head_kv < 1 || n_head % n_head_kv != 0) {
        return sparq_fail("n_head (%lld) must be a multiple of n_head_kv (%lld)", (long long) n_head, (long long) n_head_kv);
    }
    if (k->ne[3] != ns || v->ne[1] != n_kv || v->ne[2] != n_head_kv || v->ne[3] != ns) {
        return sparq_fail("k [%lld,%lld,%lld,%lld] and v [%lld,%lld,%lld,%lld] do not match q's streams/heads",
                          (long long) k->ne[0], (long long) k->ne[1], (long long) k->ne[2], (long long) k->ne[3],
                          (long long) v->ne[0], (long long) v->ne[1], (long long) v->ne[2], (long long) v->ne[3]);
    }
    if (k->nb[0] != ggml_type_size(k->type) || v->nb[0] != ggml_type_size(v->type) || q->nb[0] != sizeof(float)) {
        return sparq_fail("rows of q, k and v must be contiguous");
    }
    if (kt && kt->type == GGML_TYPE_I8) {
        const int64_t n_blk = (n_kv + GGML_SPARQ_Q4_CELLS - 1) / GGML_SPARQ_Q4_CELLS;
        if (d % 8 != 0 || kt->ne[0] != GGML_SPARQ_Q4_DIM_BYTES*d || kt->ne[1] != n_blk || kt->ne[2] != n_head_kv ||
            kt->ne[3] != ns || kt->nb[0] != 1) {
            return sparq_fail("the q4 index (kt i8) must be [18*d=%lld, n_kv/32 rounded up=%lld, n_head_kv=%lld, "
                              "ns=%lld] with contiguous blocks, d a multiple of 8", (long long) (18*d), (long long) n_blk,
                              (long long) n_head_kv, (long long) ns);
        }
        if (p->k1 != d) {
            return sparq_fail("the q4 index scores every key component: k1 must be head_dim (%lld), got %d",
                              (long long) d, p->k1);
        }
    } else if (kt) {
        if (!sparq_float_type(kt->type) && kt->type != GGML_TYPE_Q8_0) {
            return sparq_fail("kt (the index) must be f32, f16, bf16, q8_0 or i8 (the q4 index), got %s",
                              ggml_type_name(kt->type));
        }
        const int64_t n_kt = kt->type == GGML_TYPE_Q8_0 ? (n_kv + 31) / 32 * 32 : n_kv;
        if (kt->ne[0] != n_kt || kt->ne[1] != d || kt->ne[2] != n_head_kv || kt->ne[3] != ns ||
            kt->nb[0] != ggml_type_size(kt->type)) {
            return sparq_fail("kt (%s) must be [%lld, d=%lld, n_head_kv=%lld, ns=%lld] with contiguous rows",
                              ggml_type_name(kt->type), (long long) n_kt, (long long) d, (long long) n_head_kv,
                              (long long) ns);
        }
    }
    if (mask) {
        if (mask->type != GGML_TYPE_F16) {
            return sparq_fail("mask must be f16 (0 / -inf), got %s", ggml_type_name(mask->type));
        }
        if (mask->ne[0] != n_kv || mask->ne[1] < n_q || mask->ne[2] != 1 || (mask->ne[3] != ns && mask->ne[3] != 1)) {
            return sparq_fail("mask must be [n_kv=%lld, >=n_q=%lld, 1, ns or 1]", (long long) n_kv, (long long) n_q);
        }
    }
    if (vsum) {
        if (vsum->type != GGML_TYPE_F32 || vsum->ne[0] != d_v + 1 || vsum->ne[1] != n_head_kv ||
            vsum->ne[2] != n_q || vsum->ne[3] != ns || vsum->nb[0] != sizeof(float)) {
            return sparq_fail("vsum must be f32 [d_v+1=%lld, n_head_kv=%lld, n_q=%lld, ns=%lld]",
                              (long long) (d_v + 1), (long long) n_head_kv, (long long) n_q, (long long) ns);
        }
    }
    if (p->k1 < 1 || p->k1 > d) {
        return sparq_fail("k1 = %d must be in 1..head_dim (%lld)", p->k1, (long long) d);
    }
    if (p->k2 < 1) {
        return sparq_fail("k2 = %d must be >= 1", p->k2);
    }
    const int32_t window = p->window < 0 ? p->k2 / 4 : p->window;
    if (p->sinks < 0 || window + p->sinks > p->k2) {
        return sparq_fail("window (%d) + sinks (%d) must be <= k2 (%d), both >= 0", window, p->sinks, p->k2);
    }
    if (p->mean != GGML_SPARQ_MEAN_AUTO && p->mean != GGML_SPARQ_MEAN_ON && p->mean != GGML_SPARQ_MEAN_OFF) {
        return sparq_fail("mean must be auto, on or off");
    }
    if (p->policy != GGML_SPARQ_POLICY_SPARQ && p->policy != GGML_SPARQ_POLICY_EXACT &&
        p->policy != GGML_SPARQ_POLICY_WINDOW) {
        return sparq_fail("policy must be sparq, exact or window");
    }
    if (!(p->scale >= 0.0f) || !isfinite(p->scale)) {
        return sparq_fail("scale = %g must be finite and > 0 (0: 1/sqrt(head_dim))", (double) p->scale);
    }
    if (!(p->softcap >= 0.0f) || !isfinite(p->softcap)) {
        return sparq_fail("softcap = %g must be >= 0", (double) p->softcap);
    }
    if (!(p->sparse_v_thresh >= 0.0f && p->sparse_v_thresh < 1.0f)) {
        return sparq_fail("sparse_v_thresh = %g must be in [0, 1)", (double) p->sparse_v_thresh);
    }
    if (p->select != GGML_SPARQ_SELECT_Q && p->select != GGML_SPARQ_SELECT_QSIGMA) {
        return sparq_fail("select must be q or qsigma");
    }
    return NULL;
}

struct ggml_tensor * ggml_sparq_attn(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * kt,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * vsum,
        struct ggml_sparq_params params) {
    const char * err = ggml_sparq_attn_check(q, k, kt, v, mask, vsum, &params);
    if (err) {
        GGML_ABORT("%s", err);
    }
    struct ggml_sparq_op_params op = {
        /*.k1              =*/ params.k1,
        /*.k2              =*/ params.k2,
        /*.window          =*/ params.window < 0 ? params.k2 / 4 : params.window,
        /*.sinks           =*/ params.sinks,
        /*.mean_on         =*/ params.mean == GGML_SPARQ_MEAN_ON ||
                               (params.mean == GGML_SPARQ_MEAN_AUTO && q->ne[2] == k->ne[2]),
        /*.policy          =*/ (int32_t) params.policy,
        /*.scale           =*/ params.scale > 0.0f ? params.scale : 1.0f / sqrtf((float) q->ne[0]),
        /*.softcap         =*/ params.softcap,
        /*.sparse_v_thresh =*/ params.sparse_v_thresh,
        /*.select          =*/ (int32_t) params.select,
    };
    const int64_t ne[4] = { v->ne[0], q->ne[2], q->ne[1], q->ne[3] };
    struct ggml_tensor * result = ggml_new_tensor(ctx, GGML_TYPE_F32, 4, ne);

    static_assert(sizeof(op) <= GGML_MAX_OP_PARAMS, "ggml_sparq_op_params too large");
    ggml_set_op_params(result, &op, sizeof(op));
    result->op     = GGML_OP_SPARQ_ATTN;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = kt;
    result->src[3] = v;
    result->src[4] = mask;
    result->src[5] = vsum;
    return result;
}

struct ggml_sparq_op_params ggml_sparq_get_op_params(const struct ggml_tensor * op) {
    GGML_ASSERT(op->op == GGML_OP_SPARQ_ATTN);
    struct ggml_sparq_op_params p;
    memcpy(&p, op->op_params, sizeof(p));
    return p;
}

void ggml_sparq_attn_set_kstat(struct ggml_tensor * op, struct ggml_tensor * kstat) {
    GGML_ASSERT(op->op == GGML_OP_SPARQ_ATTN);
    const struct ggml_tensor * q = op->src[0];
    const struct ggml_tensor * k = op->src[1];
    GGML_ASSERT(kstat->type == GGML_TYPE_F32 && kstat->nb[0] == sizeof(float));
    GGML_ASSERT(kstat->ne[0] == 2*q->ne[0] + 1 && kstat->ne[1] == k->ne[2]);
    GGML_ASSERT(kstat->ne[2] == q->ne[1] && kstat->ne[3] == q->ne[3]);
    op->src[7] = kstat;
}

void ggml_sparq_attn_set_pos(struct ggml_tensor * op, struct ggml_tensor * pos) {
    GGML_ASSERT(op->op == GGML_OP_SPARQ_ATTN);
    GGML_ASSERT(pos->type == GGML_TYPE_I32 && pos->nb[0] == sizeof(int32_t));
    GGML_ASSERT(pos->ne[0] == op->src[1]->ne[1] && pos->ne[1] == 1 && pos->ne[2] == 1);
    GGML_ASSERT(pos->ne[3] == op->src[1]->ne[3] || pos->ne[3] == 1);
    op->src[6] = pos;
}

// The checks of ggml_sparq_vsum_rows.
static const char * vsum_check(
        const struct ggml_tensor * table, const struct ggml_tensor * v, const struct ggml_tensor * idx,
        enum ggml_type v_type) {
    if (!table || !v || !idx) {
        return vsum_fail("table, v and idx are required");
    }
    const int64_t d_v = v->ne[0], n_head_kv = v->ne[1], n_tokens = v->ne[2];
    if (v->type != GGML_TYPE_F32 || v->ne[3] != 1 || v->nb[0] != sizeof(float)) {
        return vsum_fail("v must be f32 [d_v, n_head_kv, n_tokens] with contiguous components");
    }
    const int64_t width = (d_v + 1)*n_head_kv;
    if (table->type != GGML_TYPE_F32 || table->ne[0] != width || table->ne[1] < 1 ||
        table->ne[2] != 1 || table->ne[3] != 1 || table->nb[0] != sizeof(float)) {
        return vsum_fail("table must be f32 [(d_v+1)*n_head_kv=%lld, n_seq >= 1] with contiguous rows, got %s "
                         "[%lld, %lld, %lld, %lld]", (long long) width, ggml_type_name(table->type),
                         (long long) table->ne[0], (long long) table->ne[1], (long long) table->ne[2],
                         (long long) table->ne[3]);
    }
    if (idx->type != GGML_TYPE_I32 || idx->ne[0] != n_tokens || idx->ne[1] != 1 || idx->ne[2] != 1 ||
        idx->ne[3] != 1 || idx->nb[0] != sizeof(int32_t)) {
        return vsum_fail("idx must be i32 [n_tokens=%lld]", (long long) n_tokens);
    }
    if (v_type != GGML_TYPE_F32 && v_type != GGML_TYPE_F16 && v_type != GGML_TYPE_BF16) {
        return vsum_fail("v_type must be f32, f16 or bf16, got %s", ggml_type_name(v_type));
    }
    return NULL;
}

// The KV heads of a key-statistics table over k's rows: table->ne[0] = (2*d + 1)*n_head_kv with d*n_head_kv = n_embd.
static int64_t kstat_heads(const struct ggml_tensor * table, const struct ggml_tensor * k) {
    return table->ne[0] - 2*k->ne[0];
}

const char * ggml_sparq_kstat_rows_check(
        const struct ggml_tensor * table, const struct ggml_tensor * k, const struct ggml_tensor * cells,
        const struct ggml_tensor * idx) {
    if (!table || !k || !cells || !idx) {
        return kstat_fail("table, k, cells and idx are required");
    }
    if (!sparq_kv_type_ok(k->type) || !ggml_is_contiguous(k) || k->ne[3] != 1) {
        return kstat_fail("k must be a contiguous [n_embd, kv_size, n_stream] tensor in a KV cache type");
    }
    if (table->type != GGML_TYPE_F32 || table->ne[1] < 1 || table->ne[2] != 1 || table->ne[3] != 1 ||
        table->nb[0] != sizeof(float)) {
        return kstat_fail("table must be f32 [(2*d+1)*n_head_kv, n_seq >= 1] with contiguous rows");
    }
    const int64_t n_embd = k->ne[0], n_head_kv = kstat_heads(table, k);
    if (n_head_kv < 1 || n_embd % n_head_kv != 0 || (n_embd / n_head_kv) % ggml_blck_size(k->type) != 0) {
        return kstat_fail("table [%lld, ...] is not a key-statistics table of k's %lld components ((2*d+1)*n_head_kv "
                          "with d*n_head_kv = n_embd, d whole blocks of %s)", (long long) table->ne[0],
                          (long long) n_embd, ggml_type_name(k->type));
    }
    const int64_t n_tokens = idx->ne[0];
    if (idx->type != GGML_TYPE_I32 || idx->ne[1] != 1 || idx->ne[2] != 1 || idx->ne[3] != 1 ||
        idx->nb[0] != sizeof(int32_t)) {
        return kstat_fail("idx must be i32 [n_tokens]");
    }
    if (cells->type != GGML_TYPE_I32 || !ggml_is_contiguous(cells) || ggml_nelements(cells) != n_tokens) {
        return kstat_fail("cells must be contiguous i32 [n_tokens = %lld]", (long long) n_tokens);
    }
    return NULL;
}

const char * ggml_sparq_decode_upkeep_check(const struct ggml_sparq_upkeep * u) {
    if (!u || !u->idx || (!u->vsum && !u->kstat)) {
        return upkeep_fail("idx and at least one table of sums (vsum, kstat) are required");
    }
    const char * err = NULL;
    if (u->vsum && (err = vsum_check(u->vsum, u->v, u->idx, u->v_type))) {
        return err;
    }
    if (u->kstat && (err = ggml_sparq_kstat_rows_check(u->kstat, u->k, u->k_cells, u->idx))) {
        return err;
    }
    if (u->vsum && u->kstat && u->v->ne[1] != kstat_heads(u->kstat, u->k)) {
        return upkeep_fail("v and the key statistics must have the same KV heads");
    }
    if (u->kt && (err = ggml_sparq_index_write_check(u->kt, u->k, u->cells, u->mask, u->blk, u->s0))) {
        return err;
    }
    return NULL;
}

struct ggml_tensor * ggml_sparq_decode_upkeep(struct ggml_context * ctx, const struct ggml_sparq_upkeep * u) {
    const char * err = ggml_sparq_decode_upkeep_check(u);
    if (err) {
        GGML_ABORT("%s", err);
    }
    const int64_t n_v = u->vsum ? u->vsum->ne[0] : 0, n_k = u->kstat ? u->kstat->ne[0] : 0;
    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_v + n_k, u->idx->ne[0]);
    const int32_t op_params[2] = { (int32_t) u->v_type, u->s0 };
    ggml_set_op_params(result, op_params, sizeof(op_params));
    result->op     = GGML_OP_SPARQ_VSUM_ROWS;  // the op of all three builders
    result->src[0] = u->idx;
    result->src[1] = u->vsum;
    result->src[2] = u->vsum ? u->v : NULL;
    result->src[3] = u->kstat;
    result->src[4] = u->kstat ? u->k_cells : NULL;
    result->src[5] = u->kt;
    result->src[6] = u->kstat || u->kt ? u->k : NULL;
    result->src[7] = u->kt ? u->cells : NULL;
    result->src[8] = u->kt ? u->blk : NULL;
    result->src[9] = u->kt ? u->mask : NULL;
    return result;
}

const char * ggml_sparq_vsum_rows_check(
        const struct ggml_tensor * table, const struct ggml_tensor * v, const struct ggml_tensor * idx,
        enum ggml_type v_type) {
    return vsum_check(table, v, idx, v_type);
}

struct ggml_tensor * ggml_sparq_vsum_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * table,
        struct ggml_tensor  * v,
        struct ggml_tensor  * idx,
        enum ggml_type        v_type) {
    const struct ggml_sparq_upkeep u = { idx, table, v, v_type, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0 };
    return ggml_sparq_decode_upkeep(ctx, &u);
}

struct ggml_tensor * ggml_sparq_kstat_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * table,
        struct ggml_tensor  * k,
        struct ggml_tensor  * cells,
        struct ggml_tensor  * idx) {
    const struct ggml_sparq_upkeep u = { idx, NULL, NULL, GGML_TYPE_F32, table, cells, k, NULL, NULL, NULL, NULL, 0 };
    return ggml_sparq_decode_upkeep(ctx, &u);
}

const char * ggml_sparq_index_write_check(
        const struct ggml_tensor * kt, const struct ggml_tensor * k, const struct ggml_tensor * cells,
        const struct ggml_tensor * mask, const struct ggml_tensor * blk, int32_t s0) {
    if (!kt || !k || !cells || !blk) {
        return index_fail("kt, k, cells and blk are required");
    }
    const bool q4 = kt->type == GGML_TYPE_I8;
    if (!sparq_float_type(kt->type) && kt->type != GGML_TYPE_Q8_0 && !q4) {
        return index_fail("kt must be f32, f16, bf16, q8_0 or i8 (the q4 index), got %s", ggml_type_name(kt->type));
    }
    if (!ggml_is_contiguous(kt) || (!q4 && kt->ne[3] != 1)) {
        return index_fail(q4 ? "the q4 index must be a contiguous [18*d, n_head_kv, row_len/32, n_stream] tensor"
                             : "kt must be a contiguous [row_len, n_embd, n_stream] tensor");
    }
    if (!sparq_kv_type_ok(k->type) || !ggml_is_contiguous(k) || k->ne[3] != 1) {
        return index_fail("k must be a contiguous [n_embd, kv_size, n_stream] tensor in a KV cache type");
    }
    int64_t B, row_len, n_embd, n_stream, head_dim;
    if (q4) {
        head_dim = kt->ne[0] / GGML_SPARQ_Q4_DIM_BYTES;
        B        = GGML_SPARQ_Q4_CELLS;
        row_len  = kt->ne[2] * B;
        n_embd   = head_dim * kt->ne[1];
        n_stream = kt->ne[3];
        if (kt->ne[0] % GGML_SPARQ_Q4_DIM_BYTES != 0 || head_dim % 8 != 0) {
            return index_fail("the q4 index's blocks must be 18*d bytes with d a multiple of 8, got %lld",
                              (long long) kt->ne[0]);
        }
    } else {
        B        = ggml_blck_size(kt->type);
        row_len  = kt->ne[0];
        n_embd   = kt->ne[1];
        n_stream = kt->ne[2];
        head_dim = n_embd;  // any split into heads: each component's row is written on its own
    }
    const int64_t kv_size = k->ne[1], n_blk = blk->ne[0], ns = blk->ne[2];
    if (k->ne[0] != n_embd || k->ne[2] != n_stream || row_len % B != 0 || row_len < kv_size) {
        return index_fail("kt [%lld, %lld, %lld, %lld] is not an index of k [%lld, %lld, %lld] (blocks of %lld cells)",
                          (long long) kt->ne[0], (long long) kt->ne[1], (long long) kt->ne[2], (long long) kt->ne[3],
                          (long long) k->ne[0], (long long) kv_size, (long long) k->ne[2], (long long) B);
    }
    if (k->ne[0] % ggml_blck_size(k->type) != 0 || (q4 && head_dim % ggml_blck_size(k->type) != 0)) {
        return index_fail("k's rows (and the q4 index's heads) must be whole blocks of k's type");
    }
    if (blk->type != GGML_TYPE_I64 || blk->ne[1] != 1 || blk->ne[3] != 1 || !ggml_is_contiguous(blk) ||
        s0 < 0 || s0 + ns > n_stream) {
        return index_fail("blk must be contiguous i64 [n_blk, 1, ns] with s0 + ns <= n_stream");
    }
    if (cells->type != GGML_TYPE_I32 || !ggml_is_contiguous(cells) || ggml_nelements(cells) != B*n_blk*ns) {
        return index_fail("cells must be contiguous i32 [B*n_blk*ns = %lld]", (long long) (B*n_blk*ns));
    }
    if (mask && (mask->type != GGML_TYPE_F32 || !ggml_is_contiguous(mask) || ggml_nelements(mask) != B*n_blk*ns)) {
        return index_fail("mask must be NULL or contiguous f32 [B*n_blk*ns = %lld]", (long long) (B*n_blk*ns));
    }
    return NULL;
}

struct ggml_tensor * ggml_sparq_index_write(
        struct ggml_context * ctx,
        struct ggml_tensor  * kt,
        struct ggml_tensor  * k,
        struct ggml_tensor  * cells,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * blk,
        int32_t               s0) {
    const char * err = ggml_sparq_index_write_check(kt, k, cells, mask, blk, s0);
    if (err) {
        GGML_ABORT("%s", err);
    }
    struct ggml_tensor * result = ggml_view_tensor(ctx, kt);
    const int32_t op_params[1] = { s0 };
    ggml_set_op_params(result, op_params, sizeof(op_params));
    result->op     = GGML_OP_SPARQ_INDEX_WRITE;
    result->src[0] = kt;
    result->src[1] = k;
    result->src[2] = cells;
    result->src[3] = blk;
    result->src[4] = mask;
    return result;
}
