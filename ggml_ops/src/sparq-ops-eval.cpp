// The entry points of sparq-llama-testing.h: sparq_llama_eval_* run one of our ops (or the k-means) once on a
// backend over host arrays, used by sparq_llama.ops (tests against the float64 reference, research), each as a
// one-node ggml graph; sparq_llama_bench_* time them against flash attention (the microbenchmarks of bench/).
#include "sparq-llama-testing.h"
#include "sparq-kmeans.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-centroid.h"
#include "ggml-sparq.h"
#include "ggml.h"

#include <cmath>
#include <cstdarg>
#include <cstring>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <memory>
#include <utility>

namespace {

int fail(char * err, size_t err_size, const char * fmt, ...) {
    if (err && err_size) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(err, err_size, fmt, args);
        va_end(args);
    }
    return 1;
}

struct ctx_deleter     { void operator()(ggml_context * c) const { ggml_free(c); } };
struct backend_deleter { void operator()(ggml_backend * b) const { ggml_backend_free(b); } };
struct buffer_deleter  { void operator()(ggml_backend_buffer * b) const { ggml_backend_buffer_free(b); } };

// The named device (NULL or "": the CPU) as a backend with n_threads threads where it takes a thread
// count; NULL if there is no such device or it cannot start.
ggml_backend * open_backend(const char * device, int n_threads, ggml_backend_dev_t * dev_out) {
    ggml_backend_dev_t dev = device && device[0] ? ggml_backend_dev_by_name(device)
                                                 : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend * backend = dev ? ggml_backend_dev_init(dev, nullptr) : nullptr;
    if (backend && n_threads > 0) {
        auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads");
        if (set_threads) {
            set_threads(backend, n_threads);
        }
    }
    *dev_out = dev;
    return backend;
}

// An entry point's device and graph context: the backend on the named device (NULL or "": the CPU) with n_threads
// threads where it takes a count, and a no_alloc context of ctx_bytes (the tensors get a buffer of that backend).
// open returns 0, or fail's 1 with the reason.
struct eval_env {
    std::unique_ptr<ggml_backend, backend_deleter> backend;
    ggml_backend_dev_t dev = nullptr;
    std::unique_ptr<ggml_context, ctx_deleter> ctx;
    std::unique_ptr<ggml_backend_buffer, buffer_deleter> buf;  // the context's tensors (alloc); freed before the rest

    int open(const char * device, int n_threads, size_t ctx_bytes, char * err, size_t err_size) {
        backend.reset(open_backend(device, n_threads, &dev));
        if (!backend) {
            return fail(err, err_size, "no usable ggml device named '%s'", device ? device : "CPU");
        }
        ggml_init_params ip = { ctx_bytes, nullptr, /*no_alloc =*/ true };
        ctx.reset(ggml_init(ip));
        return ctx ? 0 : fail(err, err_size, "could not create a ggml context");
    }

    // One buffer of the backend for every tensor of the context: 0, or fail's 1 naming `what`
    int alloc(const char * what, char * err, size_t err_size) {
        buf.reset(ggml_backend_alloc_ctx_tensors(ctx.get(), backend.get()));
        return buf ? 0 : fail(err, err_size, "could not allocate %s on '%s'", what, ggml_backend_dev_name(dev));
    }
};

// Runs the one op `out` of context c (no_alloc) on backend: checks that the device supports it, allocates c's
// tensors, sets the inputs (a NULL tensor is skipped), computes, and copies the result to dst. 0, or 1 with err.
int compute_op(eval_env & env, ggml_tensor * out, const char * op_name,
               std::initializer_list<std::pair<ggml_tensor *, const void *>> inputs, void * dst, char * err,
               size_t err_size, std::initializer_list<std::pair<const ggml_tensor *, void *>> written = {}) {
    if (!ggml_backend_supports_op(env.backend.get(), out)) {
        return fail(err, err_size, "device '%s' does not support %s with these types", ggml_backend_dev_name(env.dev),
                    op_name);
    }
    ggml_cgraph * gf = ggml_new_graph(env.ctx.get());
    ggml_build_forward_expand(gf, out);
    if (env.alloc("the tensors", err, err_size) != 0) {
        return 1;
    }
    for (const auto & [t, data] : inputs) {
        if (t) {
            ggml_backend_tensor_set(t, data, 0, ggml_nbytes(t));
        }
    }
    if (ggml_backend_graph_compute(env.backend.get(), gf) != GGML_STATUS_SUCCESS) {
        return fail(err, err_size, "graph compute failed on '%s'", ggml_backend_dev_name(env.dev));
    }
    ggml_backend_tensor_get(out, dst, 0, ggml_nbytes(out));
    for (const auto & [t, data] : written) {  // inputs the op writes in place, as they are after it
        if (data) {
            ggml_backend_tensor_get(t, data, 0, ggml_nbytes(t));
        }
    }
    return 0;
}

// The op's index tensor for kt_type: K^T [n_kt, d, n_head_kv, ns] (n_kt = n_kv, or whole q8_0 blocks), or the q4
// index (i8): per KV head and stream its blocks of 32 cells, 18*d bytes each.
ggml_tensor * new_index(ggml_context * c, ggml_type kt_type, int64_t d, int64_t n_kv, int64_t n_head_kv, int64_t ns) {
    if (kt_type == GGML_TYPE_I8) {
        const int64_t n_blk = (n_kv + GGML_SPARQ_Q4_CELLS - 1) / GGML_SPARQ_Q4_CELLS;
        return ggml_new_tensor_4d(c, kt_type, GGML_SPARQ_Q4_DIM_BYTES*d, n_blk, n_head_kv, ns);
    }
    const int64_t n_kt = kt_type == GGML_TYPE_Q8_0 ? GGML_PAD(n_kv, 32) : n_kv;
    return ggml_new_tensor_4d(c, kt_type, n_kt, d, n_head_kv, ns);
}

}  // namespace

int sparq_llama_eval_sparq_attn(const struct sparq_eval_args * a, char * err, size_t err_size) {
    if (!a || !a->q || !a->k || !a->v || !a->out || !a->params) {
        return fail(err, err_size, "q, k, v, out and params are required");
    }
    const auto k_type = (ggml_type) a->k_type, kt_type = (ggml_type) a->kt_type, v_type = (ggml_type) a->v_type;
    for (const int t : { a->k_type, a->kt_type, a->v_type }) {
        if (t < 0 || t >= GGML_TYPE_COUNT) {
            return fail(err, err_size, "k_type, kt_type and v_type must be ggml types, got %d", t);
        }
    }
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 16 + ggml_graph_overhead(), err, err_size) != 0) {
        return 1;
    }
    ggml_context * c = env.ctx.get();
    ggml_tensor * q  = ggml_new_tensor_4d(c, GGML_TYPE_F32, a->d, a->n_q, a->n_head, a->ns);
    ggml_tensor * k  = ggml_new_tensor_4d(c, k_type, a->d, a->n_kv, a->n_head_kv, a->ns);
    ggml_tensor * kt = a->kt ? new_index(c, kt_type, a->d, a->n_kv, a->n_head_kv, a->ns) : nullptr;
    ggml_tensor * v  = ggml_new_tensor_4d(c, v_type, a->d_v, a->n_kv, a->n_head_kv, a->ns);
    ggml_tensor * mask = a->mask ? ggml_new_tensor_4d(c, GGML_TYPE_F16, a->n_kv, a->n_q, 1, a->mask_ns) : nullptr;
    ggml_tensor * vsum = a->vsum ? ggml_new_tensor_4d(c, GGML_TYPE_F32, a->d_v + 1, a->n_head_kv, a->n_q, a->ns) : nullptr;
    ggml_tensor * kstat = a->kstat ? ggml_new_tensor_4d(c, GGML_TYPE_F32, 2*a->d + 1, a->n_head_kv, a->n_q, a->ns) : nullptr;

    if (const char * msg = ggml_sparq_attn_check(q, k, kt, v, mask, vsum, a->params)) {
        return fail(err, err_size, "%s", msg);
    }
    ggml_tensor * out = ggml_sparq_attn(c, q, k, kt, v, mask, vsum, *a->params);
    ggml_tensor * pos = a->pos ? ggml_new_tensor_4d(c, GGML_TYPE_I32, a->n_kv, 1, 1, a->ns) : nullptr;
    if (pos) {
        ggml_sparq_attn_set_pos(out, pos);
    }
    if (kstat) {
        ggml_sparq_attn_set_kstat(out, kstat);
    }
    return compute_op(env, out, "sparq_attn",
                      { { q, a->q }, { k, a->k }, { kt, a->kt }, { v, a->v }, { mask, a->mask }, { pos, a->pos },
                        { vsum, a->vsum }, { kstat, a->kstat } }, a->out, err, err_size);
}

// The table rows of a decode step's tokens: each a row of the table, no two alike (the kernels trust idx, as
// ggml_get_rows: check it here). Returns 0 or fail's 1.
static int check_table_rows(const int32_t * idx, int64_t n_tokens, int64_t n_seq, char * err, size_t err_size) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        if (idx[t] < 0 || idx[t] >= n_seq) {
            return fail(err, err_size, "idx[%lld] = %d is not a table row (n_seq = %lld)", (long long) t, idx[t],
                        (long long) n_seq);
        }
        for (int64_t u = 0; u < t; ++u) {
            if (idx[u] == idx[t]) {
                return fail(err, err_size, "idx[%lld] and idx[%lld] are both row %d: the op writes each row back, so "
                            "the rows must be distinct", (long long) u, (long long) t, idx[t]);
            }
        }
    }
    return 0;
}

int sparq_llama_eval_vsum_rows(const struct vsum_rows_eval_args * a, char * err, size_t err_size) {
    if (!a || !a->table || !a->v || !a->idx || !a->out) {
        return fail(err, err_size, "table, v, idx and out are required");
    }
    if (a->d_v < 1 || a->n_head_kv < 1 || a->n_tokens < 1 || a->n_seq < 1 || a->v_ld < a->d_v) {
        return fail(err, err_size, "need d_v, n_head_kv, n_tokens, n_seq >= 1 and v_ld >= d_v");
    }
    if (check_table_rows(a->idx, a->n_tokens, a->n_seq, err, err_size)) {
        return 1;
    }
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 8 + ggml_graph_overhead(), err, err_size) != 0) {
        return 1;
    }
    ggml_context * c = env.ctx.get();
    ggml_tensor * table  = ggml_new_tensor_2d(c, GGML_TYPE_F32, (a->d_v + 1)*a->n_head_kv, a->n_seq);
    ggml_tensor * v_full = ggml_new_tensor_3d(c, GGML_TYPE_F32, a->v_ld, a->n_head_kv, a->n_tokens);
    ggml_tensor * v      = ggml_view_3d(c, v_full, a->d_v, a->n_head_kv, a->n_tokens, v_full->nb[1], v_full->nb[2], 0);
    ggml_tensor * idx    = ggml_new_tensor_1d(c, GGML_TYPE_I32, a->n_tokens);
    const ggml_type v_type = (ggml_type) a->v_type;
    if (const char * msg = ggml_sparq_vsum_rows_check(table, v, idx, v_type)) {
        return fail(err, err_size, "%s", msg);
    }
    ggml_tensor * out = ggml_sparq_vsum_rows(c, table, v, idx, v_type);
    return compute_op(env, out, "sparq_vsum_rows",
                      { { table, a->table }, { v_full, a->v }, { idx, a->idx } }, a->out, err, err_size,
                      { { table, a->table_out } });
}

int sparq_llama_eval_kstat_rows(const struct kstat_rows_eval_args * a, char * err, size_t err_size) {
    if (!a || !a->table || !a->k || !a->cells || !a->idx || !a->out) {
        return fail(err, err_size, "table, k, cells, idx and out are required");
    }
    if (a->d < 1 || a->n_head_kv < 1 || a->n_tokens < 1 || a->n_seq < 1 || a->kv_size < 1 || a->n_stream < 1) {
        return fail(err, err_size, "need d, n_head_kv, n_tokens, n_seq, kv_size, n_stream >= 1");
    }
    if (a->k_type < 0 || a->k_type >= GGML_TYPE_COUNT || ggml_get_type_traits((ggml_type) a->k_type)->blck_size == 0) {
        return fail(err, err_size, "k_type must be a ggml type, got %d", a->k_type);
    }
    const auto k_type = (ggml_type) a->k_type;
    if ((a->d*a->n_head_kv) % ggml_blck_size(k_type) != 0) {  // ggml cannot hold such tensors
        return fail(err, err_size, "k's rows must be whole blocks of %s", ggml_type_name(k_type));
    }
    if (check_table_rows(a->idx, a->n_tokens, a->n_seq, err, err_size)) {
        return 1;
    }
    for (int64_t t = 0; t < a->n_tokens; ++t) {  // the kernels trust cells (as ggml_get_rows): check here
        if (a->cells[t] < 0 || a->cells[t] >= a->kv_size*a->n_stream) {
            return fail(err, err_size, "cells[%lld] = %d is not a row of k", (long long) t, a->cells[t]);
        }
    }
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 8 + ggml_graph_overhead(), err, err_size) != 0) {
        return 1;
    }
    ggml_context * c = env.ctx.get();
    ggml_tensor * table = ggml_new_tensor_2d(c, GGML_TYPE_F32, (2*a->d + 1)*a->n_head_kv, a->n_seq);
    ggml_tensor * k     = ggml_new_tensor_3d(c, k_type, a->d*a->n_head_kv, a->kv_size, a->n_stream);
    ggml_tensor * cells = ggml_new_tensor_1d(c, GGML_TYPE_I32, a->n_tokens);
    ggml_tensor * idx   = ggml_new_tensor_1d(c, GGML_TYPE_I32, a->n_tokens);
    if (const char * msg = ggml_sparq_kstat_rows_check(table, k, cells, idx)) {
        return fail(err, err_size, "%s", msg);
    }
    ggml_tensor * out = ggml_sparq_kstat_rows(c, table, k, cells, idx);
    return compute_op(env, out, "sparq_vsum_rows",
                      { { table, a->table }, { k, a->k }, { cells, a->cells }, { idx, a->idx } }, a->out, err, err_size,
                      { { table, a->table_out } });
}

int sparq_llama_eval_index_write(const struct index_write_eval_args * a, char * err, size_t err_size) {
    if (!a || !a->kt || !a->k || !a->cells || !a->blk || !a->kt_out) {
        return fail(err, err_size, "kt, k, cells, blk and kt_out are required");
    }
    for (const int t : { a->kt_type, a->k_type }) {
        if (t < 0 || t >= GGML_TYPE_COUNT || ggml_get_type_traits((ggml_type) t)->blck_size == 0) {
            return fail(err, err_size, "kt_type and k_type must be ggml types, got %d", t);
        }
    }
    const auto kt_type = (ggml_type) a->kt_type, k_type = (ggml_type) a->k_type;
    const bool q4 = kt_type == GGML_TYPE_I8;
    const int64_t B = q4 ? GGML_SPARQ_Q4_CELLS : ggml_blck_size(kt_type);
    if (q4 && (a->head_dim < 8 || a->head_dim % 8 != 0 || a->n_embd % a->head_dim != 0)) {
        return fail(err, err_size, "the q4 index needs head_dim a multiple of 8 that divides n_embd, got %lld",
                    (long long) a->head_dim);
    }
    if (a->n_embd < 1 || a->row_len < 1 || a->kv_size < 1 || a->n_stream < 1 || a->n_blk < 1 || a->ns < 1) {
        return fail(err, err_size, "need n_embd, row_len, kv_size, n_stream, n_blk, ns >= 1");
    }
    if (a->row_len % B != 0 || a->n_embd % ggml_blck_size(k_type) != 0) {  // ggml cannot hold such tensors
        return fail(err, err_size, "kt's rows must be whole blocks of %s and k's of %s", ggml_type_name(kt_type),
                    ggml_type_name(k_type));
    }
    for (int64_t i = 0; i < B*a->n_blk*a->ns; ++i) {  // the kernels trust cells and blk (as ggml_set_rows): check here
        if (a->cells[i] < 0 || a->cells[i] >= a->kv_size*a->n_stream) {
            return fail(err, err_size, "cells[%lld] = %d is not a row of k", (long long) i, a->cells[i]);
        }
    }
    for (int64_t i = 0; i < a->n_blk*a->ns; ++i) {
        if (a->blk[i] < 0 || (a->blk[i] + 1)*B > a->row_len) {
            return fail(err, err_size, "blk[%lld] = %lld is not a block of kt's rows", (long long) i,
                        (long long) a->blk[i]);
        }
    }
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 8 + ggml_graph_overhead(), err, err_size) != 0) {
        return 1;
    }
    ggml_context * c = env.ctx.get();
    ggml_tensor * kt    = q4 ? ggml_new_tensor_4d(c, kt_type, GGML_SPARQ_Q4_DIM_BYTES*a->head_dim,
                                                  a->n_embd/a->head_dim, a->row_len/B, a->n_stream)
                             : ggml_new_tensor_3d(c, kt_type, a->row_len, a->n_embd, a->n_stream);
    ggml_tensor * k     = ggml_new_tensor_3d(c, k_type, a->n_embd, a->kv_size, a->n_stream);
    ggml_tensor * cells = ggml_new_tensor_1d(c, GGML_TYPE_I32, B*a->n_blk*a->ns);
    ggml_tensor * mask  = a->mask ? ggml_new_tensor_1d(c, GGML_TYPE_F32, B*a->n_blk*a->ns) : nullptr;
    ggml_tensor * blk   = ggml_new_tensor_3d(c, GGML_TYPE_I64, a->n_blk, 1, a->ns);
    if (const char * msg = ggml_sparq_index_write_check(kt, k, cells, mask, blk, a->s0)) {
        return fail(err, err_size, "%s", msg);
    }
    ggml_tensor * out = ggml_sparq_index_write(c, kt, k, cells, mask, blk, a->s0);
    return compute_op(env, out, "sparq_index_write",
                      { { kt, a->kt }, { k, a->k }, { cells, a->cells }, { mask, a->mask }, { blk, a->blk } },
                      a->kt_out, err, err_size);
}

int sparq_llama_eval_centroid_attn(const struct centroid_eval_args * a, char * err, size_t err_size) {
    if (!a || !a->q || !a->k || !a->v || !a->cent || !a->cell || !a->out || !a->params) {
        return fail(err, err_size, "q, k, v, cent, cell, out and params are required");
    }
    if ((a->coarse == nullptr) != (a->parent == nullptr)) {
        return fail(err, err_size, "coarse and parent go together (two levels) or are both NULL");
    }
    const auto kv_type = (ggml_type) a->kv_type;
    if (kv_type != GGML_TYPE_F32 && kv_type != GGML_TYPE_F16 && kv_type != GGML_TYPE_BF16) {
        return fail(err, err_size, "kv_type must be f32, f16 or bf16");
    }
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 16 + ggml_graph_overhead(), err, err_size) != 0) {
        return 1;
    }
    ggml_context * c = env.ctx.get();
    ggml_tensor * q    = ggml_new_tensor_4d(c, GGML_TYPE_F32, a->d, a->n_q, a->n_head, a->ns);
    ggml_tensor * k    = ggml_new_tensor_4d(c, kv_type, a->d, a->n_kv, a->n_head_kv, a->ns);
    ggml_tensor * v    = ggml_new_tensor_4d(c, kv_type, a->d_v, a->n_kv, a->n_head_kv, a->ns);
    ggml_tensor * mask = a->mask ? ggml_new_tensor_4d(c, GGML_TYPE_F16, a->n_kv, a->n_q, 1, a->mask_ns) : nullptr;
    const int64_t width = a->table_width > 0 ? a->table_width : a->d + 1;
    ggml_tensor * cent = ggml_new_tensor_4d(c, GGML_TYPE_F32, width, a->n_cent, a->n_head_kv, a->ns);
    ggml_tensor * cell = ggml_new_tensor_3d(c, GGML_TYPE_I32, a->n_kv, a->n_head_kv, a->ns);
    ggml_tensor * coarse = a->coarse ? ggml_new_tensor_4d(c, GGML_TYPE_F32, width, a->n_coarse, a->n_head_kv, a->ns)
                                     : nullptr;
    ggml_tensor * parent = a->parent ? ggml_new_tensor_3d(c, GGML_TYPE_I32, a->n_cent, a->n_head_kv, a->ns) : nullptr;

    if (const char * msg = ggml_centroid_attn_check(q, k, v, mask, cent, cell, coarse, parent, a->params)) {
        return fail(err, err_size, "%s", msg);
    }
    ggml_tensor * out = ggml_centroid_attn(c, q, k, v, mask, cent, cell, coarse, parent, *a->params);
    return compute_op(env, out, "centroid_attn",
                      { { q, a->q }, { k, a->k }, { v, a->v }, { mask, a->mask }, { cent, a->cent }, { cell, a->cell },
                        { coarse, a->coarse }, { parent, a->parent } }, a->out, err, err_size);
}

int sparq_llama_eval_kmeans(const struct kmeans_eval_args * a, char * err, size_t err_size) {
    if (!a || !a->x || !a->table || !a->assignment || !a->n_iter_run) {
        return fail(err, err_size, "x, table, assignment and n_iter_run are required");
    }
    if (a->d < 1 || a->P < 1 || a->H < 1) {
        return fail(err, err_size, "d, P and H must be >= 1");
    }
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 2, err, err_size) != 0) {
        return 1;
    }
    ggml_context * ctx = env.ctx.get();
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->d, a->P, a->H);
    if (env.alloc("the rows", err, err_size) != 0) {
        return 1;
    }
    ggml_backend_tensor_set(x, a->x, 0, ggml_nbytes(x));
    sparq_kmeans_result res;
    const std::string msg = sparq_kmeans_run(env.backend.get(), x, a->n_clusters, a->n_iter, res,
                                             (sparq_kmeans_init) a->init, 0, a->center != 0, a->weights);
    if (!msg.empty()) {
        return fail(err, err_size, "%s", msg.c_str());
    }
    memcpy(a->table, res.table.data(), res.table.size() * sizeof(float));
    memcpy(a->assignment, res.assignment.data(), res.assignment.size() * sizeof(int32_t));
    *a->n_iter_run = res.n_iter;
    return 0;
}

// ---- microbenchmark: ggml_sparq_attn vs ggml_flash_attn_ext on the same tensors ----------------

#include <algorithm>
#include <functional>
#include <random>
#include <vector>

namespace {

// Random values for a tensor of any size without generating them all: a pool of 2^22 values drawn once,
// copied in tiles, each tile starting at a different pool offset. Timings do not depend on the values;
// the pool is longer than any K^T row, so cells of a row keep distinct scores.
struct random_pool {
    std::vector<float> f32;
    std::vector<ggml_fp16_t> f16;
    std::vector<ggml_bf16_t> bf16;

    explicit random_pool(std::mt19937 & rng) : f32(size_t(1) << 22), f16(f32.size()), bf16(f32.size()) {
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (auto & x : f32) {
            x = normal(rng);
        }
        ggml_fp32_to_fp16_row(f32.data(), f16.data(), (int64_t) f32.size());
        ggml_fp32_to_bf16_row(f32.data(), bf16.data(), (int64_t) f32.size());
    }
    mutable std::map<ggml_type, std::vector<uint8_t>> quant;  // the f32 pool in a quantized type, made on first use

    const void * data(ggml_type type) const {
        switch (type) {
            case GGML_TYPE_F32:  return f32.data();
            case GGML_TYPE_F16:  return f16.data();
            case GGML_TYPE_BF16: return bf16.data();
            default: break;
        }
        auto & q = quant[type];
        if (q.empty()) {
            const int64_t n_per_row = 1024;
            q.resize(ggml_row_size(type, (int64_t) f32.size()));
            ggml_quantize_chunk(type, f32.data(), q.data(), 0, (int64_t) f32.size() / n_per_row, n_per_row, nullptr);
        }
        return q.data();
    }
};

// t filled with tiles of the pool (in t's type) from random offsets
void fill_random(ggml_tensor * t, const random_pool & pool, std::mt19937 & rng) {
    const size_t blck = ggml_blck_size(t->type), ts = ggml_type_size(t->type);
    const size_t n = pool.f32.size() / blck, total = ggml_nbytes(t);  // n: the pool's blocks
    const char * src = (const char *) pool.data(t->type);
    const size_t tile = (n / 2) * ts;
    for (size_t off = 0; off < total; off += tile) {
        const size_t start = (rng() % (n / 2)) * ts;
        ggml_backend_tensor_set(t, src + start, off, std::min(tile, total - off));
    }
}

// A q4 index of random blocks: random nibbles, the pool's normal values as the scales, tiled from random offsets
void fill_q4_index(ggml_tensor * kt, const random_pool & pool, std::mt19937 & rng) {
    const int64_t block_bytes = kt->ne[0], d = block_bytes / GGML_SPARQ_Q4_DIM_BYTES, n_pool = 4096;
    std::vector<uint8_t> blocks(n_pool * block_bytes);
    for (int64_t b = 0; b < n_pool; ++b) {
        uint8_t * blk = blocks.data() + b * block_bytes;
        for (int64_t i = 0; i < 16 * d; ++i) {
            blk[i] = (uint8_t) rng();
        }
        memcpy(blk + 16 * d, pool.f16.data() + (rng() % (pool.f16.size() - d)), d * sizeof(ggml_fp16_t));
    }
    const size_t total = ggml_nbytes(kt), tile = (size_t) (n_pool / 2) * block_bytes;
    for (size_t off = 0; off < total; off += tile) {
        const size_t start = (rng() % (n_pool / 2)) * block_bytes;
        ggml_backend_tensor_set(kt, blocks.data() + start, off, std::min(tile, total - off));
    }
}

// Heavy-tailed queries (a few large components, as real models have): z * (1 + 0.3 z^2).
void fill_queries(ggml_tensor * q, std::mt19937 & rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(ggml_nelements(q));
    for (auto & v : x) {
        const float z = normal(rng);
        v = z * (1.0f + 0.3f * z * z);
    }
    ggml_backend_tensor_set(q, x.data(), 0, ggml_nbytes(q));
}

}  // namespace

int sparq_llama_bench_attn(const struct sparq_bench_args * a, char * err, size_t err_size) {
    if (!a || !a->params || !a->sparq_us || !a->flash_us || a->n_runs < 1) {
        return fail(err, err_size, "params, sparq_us, flash_us and n_runs >= 1 are required");
    }
    const auto kv_type = (ggml_type) a->kv_type;
    const auto kt_type = a->kt_type < 0 ? kv_type : (ggml_type) a->kt_type;
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 16 + 2 * ggml_graph_overhead(), err, err_size) != 0) {
        return 1;
    }
    ggml_context * c = env.ctx.get();
    const int64_t d = a->d, n_kv = a->n_kv, ns = std::max<int64_t>(1, a->n_seq);
    ggml_tensor * q    = ggml_new_tensor_4d(c, GGML_TYPE_F32, d, 1, a->n_head, ns);
    ggml_tensor * k    = ggml_new_tensor_4d(c, kv_type, d, n_kv, a->n_head_kv, ns);
    ggml_tensor * kt   = a->use_kt ? new_index(c, kt_type, d, n_kv, a->n_head_kv, ns) : nullptr;
    ggml_tensor * v    = ggml_new_tensor_4d(c, kv_type, d, n_kv, a->n_head_kv, ns);
    ggml_tensor * mask = ggml_new_tensor_4d(c, GGML_TYPE_F16, n_kv, 1, 1, 1);
    ggml_tensor * vsum = ggml_new_tensor_4d(c, GGML_TYPE_F32, d + 1, a->n_head_kv, 1, ns);
    if (const char * msg = ggml_sparq_attn_check(q, k, kt, v, mask, vsum, a->params)) {
        return fail(err, err_size, "%s", msg);
    }
    ggml_tensor * sparq = ggml_sparq_attn(c, q, k, kt, v, mask, vsum, *a->params);
    // select qsigma reads the running key sums, as in a model (without them it would read all of K)
    ggml_tensor * kstat = nullptr;
    if (a->params->select == GGML_SPARQ_SELECT_QSIGMA) {
        kstat = ggml_new_tensor_4d(c, GGML_TYPE_F32, 2*d + 1, a->n_head_kv, 1, ns);
        ggml_sparq_attn_set_kstat(sparq, kstat);
    }
    const float scale = a->params->scale > 0.0f ? a->params->scale : 1.0f / sqrtf((float) d);
    ggml_tensor * flash = ggml_flash_attn_ext(c, q, k, v, mask, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(flash, GGML_PREC_F32);  // as llama.cpp does for its attention
    ggml_cgraph * g_sparq = ggml_new_graph(c);
    ggml_build_forward_expand(g_sparq, sparq);
    ggml_cgraph * g_flash = ggml_new_graph(c);
    ggml_build_forward_expand(g_flash, flash);
    ggml_backend * backend = env.backend.get();
    if (!ggml_backend_supports_op(backend, sparq) || !ggml_backend_supports_op(backend, flash)) {
        return fail(err, err_size, "device '%s' does not support both ops", ggml_backend_dev_name(env.dev));
    }
    if (env.alloc("the tensors", err, err_size) != 0) {
        return 1;
    }
    // K^T holds its own random values rather than the transpose of K: the op reads the same amount either
    // way, and at 128k x 16 sequences a host-side transpose would take minutes
    std::mt19937 rng(1234);
    const random_pool pool(rng);
    fill_queries(q, rng);
    for (ggml_tensor * t : { k, kt, v }) {
        if (t && t->type == GGML_TYPE_I8) {
            fill_q4_index(t, pool, rng);
        } else if (t) {
            fill_random(t, pool, rng);
        }
    }
    std::vector<ggml_fp16_t> zeros(n_kv, ggml_fp32_to_fp16(0.0f));
    ggml_backend_tensor_set(mask, zeros.data(), 0, n_kv * sizeof(ggml_fp16_t));
    std::vector<float> vs((d + 1) * a->n_head_kv * ns, 0.0f);
    for (int64_t i = 0; i < a->n_head_kv * ns; ++i) {
        vs[i * (d + 1) + d] = (float) n_kv;
    }
    ggml_backend_tensor_set(vsum, vs.data(), 0, vs.size() * sizeof(float));
    if (kstat) {
        // spreads 0.5..1.5 over the components: sum 0, sum of squares n*s^2, count n
        std::vector<float> ks((2*d + 1) * a->n_head_kv * ns, 0.0f);
        std::uniform_real_distribution<float> spread(0.5f, 1.5f);
        for (int64_t i = 0; i < a->n_head_kv * ns; ++i) {
            for (int64_t c_i = 0; c_i < d; ++c_i) {
                const float s_i = spread(rng);
                ks[i * (2*d + 1) + d + c_i] = (float) n_kv * s_i * s_i;
            }
            ks[i * (2*d + 1) + 2*d] = (float) n_kv;
        }
        ggml_backend_tensor_set(kstat, ks.data(), 0, ks.size() * sizeof(float));
    }

    // warm-up, then interleaved timed runs so drift hits both ops alike
    ggml_backend_graph_compute(backend, g_sparq);
    ggml_backend_graph_compute(backend, g_flash);
    for (int run = 0; run < a->n_runs; ++run) {
        int64_t t0 = ggml_time_us();
        ggml_backend_graph_compute(backend, g_sparq);
        ggml_backend_synchronize(backend);
        int64_t t1 = ggml_time_us();
        ggml_backend_graph_compute(backend, g_flash);
        ggml_backend_synchronize(backend);
        int64_t t2 = ggml_time_us();
        a->sparq_us[run] = (double) (t1 - t0);
        a->flash_us[run] = (double) (t2 - t1);
    }
    return 0;
}

int sparq_llama_bench_centroid(const struct centroid_bench_args * a, char * err, size_t err_size) {
    if (!a || !a->centroid_us || !a->flash_us || !a->kept_out || a->n_runs < 1) {
        return fail(err, err_size, "centroid_us, flash_us, kept_out and n_runs >= 1 are required");
    }
    if (a->n_prefix < 1 || a->n_prefix > a->n_kv || a->n_clusters < 1 || a->n_clusters > a->n_prefix ||
        !(a->keep > 0.0f && a->keep <= 1.0f)) {
        return fail(err, err_size, "need 1 <= n_prefix <= n_kv, 1 <= n_clusters <= n_prefix and keep in (0, 1]");
    }
    const auto kv_type = (ggml_type) a->kv_type;
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 16 + 2 * ggml_graph_overhead(), err, err_size) != 0) {
        return 1;
    }
    ggml_context * c = env.ctx.get();
    const int64_t d = a->d, n_kv = a->n_kv, H = a->n_head_kv, G = a->n_head / std::max<int64_t>(1, H), n = a->n_clusters;
    ggml_tensor * q    = ggml_new_tensor_4d(c, GGML_TYPE_F32, d, 1, a->n_head, 1);
    ggml_tensor * k    = ggml_new_tensor_4d(c, kv_type, d, n_kv, H, 1);
    ggml_tensor * v    = ggml_new_tensor_4d(c, kv_type, d, n_kv, H, 1);
    ggml_tensor * mask = ggml_new_tensor_4d(c, GGML_TYPE_F16, n_kv, 1, 1, 1);
    ggml_tensor * cent = ggml_new_tensor_4d(c, GGML_TYPE_F32, d + 1, n, H, 1);
    ggml_tensor * cell = ggml_new_tensor_3d(c, GGML_TYPE_I32, n_kv, H, 1);
    ggml_centroid_params params = ggml_centroid_default_params();
    if (const char * msg = ggml_centroid_attn_check(q, k, v, mask, cent, cell, nullptr, nullptr, &params)) {
        return fail(err, err_size, "%s", msg);
    }
    if (env.alloc("the tensors", err, err_size) != 0) {
        return 1;
    }
    std::mt19937 rng(1234);
    const random_pool pool(rng);
    fill_queries(q, rng);
    fill_random(k, pool, rng);
    fill_random(v, pool, rng);
    std::vector<ggml_fp16_t> zeros(n_kv, ggml_fp32_to_fp16(0.0f));
    ggml_backend_tensor_set(mask, zeros.data(), 0, n_kv * sizeof(ggml_fp16_t));
    // clusters of consecutive prefix cells, random centroid directions
    std::vector<int32_t> cells(n_kv * H);
    std::vector<int64_t> sizes(n, 0);
    for (int64_t j = 0; j < n_kv; ++j) {
        const int32_t cl = j < a->n_prefix ? (int32_t) ((j * n) / a->n_prefix) : -1;
        for (int64_t h = 0; h < H; ++h) {
            cells[h * n_kv + j] = cl;
        }
        if (cl >= 0) {
            ++sizes[cl];
        }
    }
    ggml_backend_tensor_set(cell, cells.data(), 0, ggml_nbytes(cell));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> tab((d + 1) * n * H);
    for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < n; ++i) {
            float * row = tab.data() + (h * n + i) * (d + 1);
            for (int64_t e = 0; e < d; ++e) {
                row[e] = normal(rng);
            }
            row[d] = (float) sizes[i];
        }
    }
    ggml_backend_tensor_set(cent, tab.data(), 0, ggml_nbytes(cent));
    // what the op reads of the prefix (its budget rule, ggml-centroid.h): per head, the clusters by group score (max
    // over the group), each kept while the sizes before it are under the budget
    params.keep = a->keep;
    std::vector<float> qh(ggml_nelements(q));
    ggml_backend_tensor_get(q, qh.data(), 0, ggml_nbytes(q));
    const double scale = 1.0 / std::sqrt((double) d);
    const double budget = std::max(1.0, (double) std::ceil(a->keep * (float) a->n_prefix));
    int64_t kept_cells = 0;
    for (int64_t h = 0; h < H; ++h) {
        std::vector<double> s(n, 0.0);
        for (int64_t g = 0; g < G; ++g) {
            const float * qg = qh.data() + (h * G + g) * d;
            std::vector<double> z(n);
            double mx = -INFINITY;
            for (int64_t i = 0; i < n; ++i) {
                double dot = 0.0;
                for (int64_t e = 0; e < d; ++e) {
                    dot += (double) qg[e] * tab[(h * n + i) * (d + 1) + e];
                }
                z[i] = scale * dot;
                mx = std::max(mx, z[i]);
            }
            double norm = 0.0;
            for (int64_t i = 0; i < n; ++i) {
                norm += (double) sizes[i] * std::exp(z[i] - mx);
            }
            for (int64_t i = 0; i < n; ++i) {
                s[i] = std::max(s[i], std::exp(z[i] - mx) / norm);
            }
        }
        std::vector<int64_t> order;
        for (int64_t i = 0; i < n; ++i) {
            if (sizes[i] > 0) {
                order.push_back(i);
            }
        }
        std::sort(order.begin(), order.end(), [&s](int64_t x, int64_t y) { return s[x] > s[y] || (s[x] == s[y] && x < y); });
        int64_t before = 0;
        for (size_t r = 0; r < order.size() && (double) before < budget; ++r) {
            before += sizes[order[r]];
        }
        kept_cells += before;
    }
    *a->kept_out = (double) kept_cells / (double) (a->n_prefix * H);

    ggml_tensor * centroid = ggml_centroid_attn(c, q, k, v, mask, cent, cell, nullptr, nullptr, params);
    ggml_tensor * flash = ggml_flash_attn_ext(c, q, k, v, mask, (float) scale, 0.0f, 0.0f);
    ggml_prec_set_acc(flash, GGML_PREC_F32);
    ggml_backend * backend = env.backend.get();
    if (!ggml_backend_supports_op(backend, centroid) || !ggml_backend_supports_op(backend, flash)) {
        return fail(err, err_size, "device '%s' does not support both ops", ggml_backend_dev_name(env.dev));
    }
    ggml_cgraph * g_centroid = ggml_new_graph(c);
    ggml_build_forward_expand(g_centroid, centroid);
    ggml_cgraph * g_flash = ggml_new_graph(c);
    ggml_build_forward_expand(g_flash, flash);
    std::unique_ptr<ggml_gallocr, void (*)(ggml_gallocr *)> galloc(
        ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend)), ggml_gallocr_free);
    if (!ggml_gallocr_reserve(galloc.get(), g_centroid) || !ggml_gallocr_alloc_graph(galloc.get(), g_centroid)) {
        return fail(err, err_size, "could not allocate the op's output");
    }
    std::unique_ptr<ggml_gallocr, void (*)(ggml_gallocr *)> galloc_f(
        ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend)), ggml_gallocr_free);
    if (!ggml_gallocr_alloc_graph(galloc_f.get(), g_flash)) {
        return fail(err, err_size, "could not allocate flash attention's output");
    }
    ggml_backend_graph_compute(backend, g_centroid);
    ggml_backend_graph_compute(backend, g_flash);
    for (int run = 0; run < a->n_runs; ++run) {
        int64_t t0 = ggml_time_us();
        ggml_backend_graph_compute(backend, g_centroid);
        ggml_backend_synchronize(backend);
        int64_t t1 = ggml_time_us();
        ggml_backend_graph_compute(backend, g_flash);
        ggml_backend_synchronize(backend);
        int64_t t2 = ggml_time_us();
        a->centroid_us[run] = (double) (t1 - t0);
        a->flash_us[run] = (double) (t2 - t1);
    }
    return 0;
}

// ---- microbenchmark: the clustering of a fixed prefix with its keys already on the backend ---------------

int sparq_llama_bench_kmeans(const struct kmeans_bench_args * a, char * err, size_t err_size) {
    if (!a || !a->layer_s || !a->iters_out || a->n_layers < 1) {
        return fail(err, err_size, "layer_s, iters_out and n_layers >= 1 are required");
    }
    if (a->d < 1 || a->P < 1 || a->H < 1 || a->n_clusters < 1 || a->n_clusters > a->P || a->n_iter < 1) {
        return fail(err, err_size, "need d, P, H >= 1, 1 <= n_clusters <= P and n_iter >= 1");
    }
    eval_env env;
    if (env.open(a->device, a->n_threads, ggml_tensor_overhead() * 2, err, err_size) != 0) {
        return 1;
    }
    ggml_context * ctx = env.ctx.get();
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, a->d, a->P, a->H);
    if (env.alloc("the keys", err, err_size) != 0) {
        return 1;
    }
    std::mt19937 rng(4321);
    const random_pool pool(rng);
    // the tables' host copy, as a prepared prefix keeps it: allocated (and its pages touched) once, not per layer
    std::vector<float> table((size_t) a->H * a->n_clusters * (2 * a->d + 1), 0.0f);
    for (int layer = -1; layer < a->n_layers; ++layer) {  // layer -1: a warm-up, not reported
        fill_random(x, pool, rng);  // each layer its own keys, on the backend before the clock starts
        ggml_backend_synchronize(env.backend.get());
        const int64_t t0 = ggml_time_us();
        sparq_kmeans_result res;
        res.table_dst = table.data();
        const std::string msg = sparq_kmeans_run(env.backend.get(), x, a->n_clusters, a->n_iter, res,
                                                 (sparq_kmeans_init) a->init);
        const int64_t t1 = ggml_time_us();
        if (!msg.empty()) {
            return fail(err, err_size, "%s", msg.c_str());
        }
        if (layer >= 0) {
            a->layer_s[layer] = 1e-6 * (double) (t1 - t0);
            a->iters_out[layer] = res.n_iter;
            if (a->phase_s) {
                std::copy(res.phase_s, res.phase_s + 3, a->phase_s + 3 * layer);
            }
        }
    }
    return 0;
}
