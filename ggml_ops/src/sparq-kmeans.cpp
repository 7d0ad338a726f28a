// Spherical k-means as ggml graphs, on any ggml backend: the clustering of a fixed prefix's keys for
// centroid-sparse attention. Semantics (and the float64 reference): sparq_llama.reference_squeeze.kmeans_cosine.
//
// H independent problems of P rows of d components (x [d, P, H]: per layer, the prefix keys of each KV head).
//   init:      xn = l2_norm(x); centroids = xn at rows (i * P) / n (no random generator: every backend and run
//              starts alike)
//   iteration: sim = centroids^T xn (ggml_mul_mat), assignment = argmax over the clusters (ggml_cluster_assign:
//              ties to the highest index), centroids = ggml_cluster_update(xn, assignment, centroids); stop after
//              n_iter iterations or when no assignment changed (read back: P * H int32 per iteration)
//   result:    ggml_cluster_update(x, assignment, TABLE_VAR): each cluster's mean of unnormalised rows, its size and
//              its members' per-component variances about the mean
#include "sparq-kmeans.h"

#include "ggml-alloc.h"
#include "ggml-centroid.h"

#include <cstring>
#include <memory>

// a named namespace: llama's sources may be compiled as one unit (unity builds), where anonymous ones meet
namespace sparq_kmeans_detail {

struct ctx_deleter    { void operator()(ggml_context * c) const { ggml_free(c); } };
struct buffer_deleter { void operator()(ggml_backend_buffer * b) const { ggml_backend_buffer_free(b); } };
struct gallocr_deleter { void operator()(ggml_gallocr * g) const { ggml_gallocr_free(g); } };
using ctx_ptr = std::unique_ptr<ggml_context, ctx_deleter>;

static ctx_ptr graph_context() {
    ggml_init_params ip = { ggml_tensor_overhead() * 32 + ggml_graph_overhead(), nullptr, /*no_alloc =*/ true };
    return ctx_ptr(ggml_init(ip));
}

// Allocates the graph's intermediate tensors and runs it; false on failure.
static bool run_graph(ggml_backend_t backend, ggml_gallocr * galloc, ggml_cgraph * gf) {
    return ggml_gallocr_alloc_graph(galloc, gf) && ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS;
}

}  // namespace sparq_kmeans_detail

namespace km = sparq_kmeans_detail;

std::string sparq_kmeans_run(ggml_backend_t backend, ggml_tensor * x, int64_t n_clusters, int n_iter,
                             sparq_kmeans_result & res) {
    const int64_t d = x->ne[0], P = x->ne[1], H = x->ne[2];
    if (x->type != GGML_TYPE_F32 || x->ne[3] != 1 || !ggml_is_contiguous(x)) {
        return "k-means: x must be a contiguous f32 [d, P, H] tensor";
    }
    if (n_clusters < 1 || n_clusters > P) {
        return "k-means: n_clusters must be in [1, P]";
    }
    if (n_iter < 1) {
        return "k-means: n_iter must be >= 1";
    }
    const int64_t t_start = ggml_time_us();
    // persistent state on the backend: normalised rows, centroids, the assignment, the initial rows
    ggml_init_params ip = { ggml_tensor_overhead() * 8, nullptr, /*no_alloc =*/ true };
    km::ctx_ptr state(ggml_init(ip));
    ggml_tensor * xn     = ggml_new_tensor_3d(state.get(), GGML_TYPE_F32, d, P, H);
    ggml_tensor * cent   = ggml_new_tensor_3d(state.get(), GGML_TYPE_F32, d, n_clusters, H);
    ggml_tensor * assign = ggml_new_tensor_2d(state.get(), GGML_TYPE_I32, P, H);
    ggml_tensor * init   = ggml_new_tensor_2d(state.get(), GGML_TYPE_I32, n_clusters, H);
    std::unique_ptr<ggml_backend_buffer, km::buffer_deleter> buf(ggml_backend_alloc_ctx_tensors(state.get(), backend));
    if (!buf) {
        return "k-means: could not allocate its state on the backend";
    }
    std::vector<int32_t> init_rows(n_clusters * H);
    for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < n_clusters; ++i) {
            init_rows[h * n_clusters + i] = (int32_t) ((i * P) / n_clusters);
        }
    }
    ggml_backend_tensor_set(init, init_rows.data(), 0, ggml_nbytes(init));
    std::unique_ptr<ggml_gallocr, km::gallocr_deleter> galloc(ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend)));

    {  // init
        km::ctx_ptr ctx = km::graph_context();
        ggml_cgraph * gf = ggml_new_graph(ctx.get());
        ggml_tensor * norm = ggml_l2_norm(ctx.get(), x, 1e-30f);
        ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), norm, xn));
        ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), ggml_get_rows(ctx.get(), norm, init), cent));
        if (!km::run_graph(backend, galloc.get(), gf)) {
            return "k-means: the initial graph failed";
        }
    }
    const int64_t t_iter = ggml_time_us();
    std::vector<int32_t> prev(P * H, -1);
    res.assignment.assign(P * H, 0);
    res.n_iter = 0;
    km::ctx_ptr ctx = km::graph_context();
    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    ggml_tensor * sim = ggml_mul_mat(ctx.get(), cent, xn);                                  // [n, P, H]
    ggml_tensor * best = ggml_cluster_assign(ctx.get(), sim);                               // [P, H]
    ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), best, assign));
    ggml_tensor * moved = ggml_cluster_update(ctx.get(), xn, best, cent, n_clusters, GGML_CLUSTER_SPHERICAL);
    ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), moved, cent));
    for (int it = 1; it <= n_iter; ++it) {
        if (!km::run_graph(backend, galloc.get(), gf)) {
            return "k-means: an iteration's graph failed";
        }
        res.n_iter = it;
        ggml_backend_tensor_get(assign, res.assignment.data(), 0, ggml_nbytes(assign));
        if (res.assignment == prev) {
            break;
        }
        prev = res.assignment;
    }
    const int64_t t_table = ggml_time_us();
    {  // the centroid table of the unnormalised rows
        km::ctx_ptr fin = km::graph_context();
        ggml_cgraph * gt = ggml_new_graph(fin.get());
        ggml_tensor * table = ggml_cluster_update(fin.get(), x, assign, nullptr, n_clusters, GGML_CLUSTER_TABLE_VAR);
        ggml_build_forward_expand(gt, table);
        if (!km::run_graph(backend, galloc.get(), gt)) {
            return "k-means: the table graph failed";
        }
        float * dst = res.table_dst;
        if (dst == nullptr) {
            res.table.resize(ggml_nelements(table));
            dst = res.table.data();
        }
        ggml_backend_tensor_get(table, dst, 0, ggml_nbytes(table));
    }
    const int64_t t_end = ggml_time_us();
    res.phase_s[0] = 1e-6 * (double) (t_iter - t_start);
    res.phase_s[1] = 1e-6 * (double) (t_table - t_iter);
    res.phase_s[2] = 1e-6 * (double) (t_end - t_table);
    return "";
}
