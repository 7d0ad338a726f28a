// Spherical k-means as ggml graphs, on any ggml backend: the clustering of a fixed prefix's keys for
// centroid-sparse attention. Semantics (and the float64 reference): sparq_llama.reference_squeeze.kmeans_cosine.
//
// H independent problems of P rows of d components (x [d, P, H]: per layer, the prefix keys of each KV head).
//   init:      xn = l2_norm(x); centroids = xn at the seed rows: SPARQ_KMEANS_EVEN rows (i * P) / n, or
//              SPARQ_KMEANS_KPP k-means++ seeding in rounds (kpp_seed_rows below). Either way every backend and run
//              starts from the same rows (the generator is a pure function of counters), up to the rounding of
//              the similarities the k-means++ draws weigh by
//   iteration: sim = centroids^T xn (ggml_mul_mat), assignment = argmax over the clusters (ggml_cluster_assign:
//              ties to the highest index), centroids = ggml_cluster_update(xn, assignment, centroids); stop after
//              n_iter iterations or when no assignment changed (read back: P * H int32 per iteration)
//   result:    ggml_cluster_update(x, assignment, TABLE_VAR): each cluster's mean of unnormalised rows, its size and
//              its members' per-component variances about the mean
#include "sparq-kmeans.h"

#include "ggml-alloc.h"
#include "ggml-centroid.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <thread>

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

// k-means++ seeding (sparq_llama.reference_squeeze.kpp_seed_rows, which the tests hold this to)
constexpr uint64_t KPP_SEED = 0x5EED5EED5EED5EEDull;  // the generator's fixed seed

// Seeds drawn per round (one pass over the rows each): 64, or more for many clusters so that there are at most ~16
// rounds (each round costs a read-back and the host's draws: 26 rounds made a 32k 7B layer's seeding 130 ms)
static int64_t kpp_round_size(int64_t n_clusters) {
    return std::max<int64_t>(64, (n_clusters - 1 + 15) / 16);
}

// splitmix64's step: a 64-bit bijection of the advanced state
static uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// draw j of round rnd for problem h: a uniform double in (0, 1), a pure function of the counters
static double kpp_uniform(uint64_t h, uint64_t rnd, uint64_t j) {
    const uint64_t z = mix64(mix64(mix64(KPP_SEED ^ h) ^ rnd) ^ j);
    return ((double) (z >> 11) + 0.5) * 0x1.0p-53;
}

// One problem's state while seeding: its seeds in order and which rows they are.
struct kpp_problem {
    std::vector<int32_t> seeds;
    std::vector<uint8_t> is_seed;
};

// Round rnd's draws for one problem from best[P] (each row's largest similarity to a seed so far): each draw takes
// the first row whose running sum of max(0, 2 - 2 best) exceeds u times the total, unless it is a seed already.
// A round that adds none fills the rest with the lowest rows that are not seeds. Returns the rows added.
static std::vector<int32_t> kpp_draw(kpp_problem & pr, const float * best, int64_t P, int64_t n_clusters,
                                     int64_t round_size, uint64_t h, uint64_t rnd, std::vector<double> & cum) {
    const int64_t b = std::min<int64_t>(round_size, n_clusters - (int64_t) pr.seeds.size());
    double run = 0.0;
    for (int64_t p = 0; p < P; ++p) {
        run += std::max(0.0, 2.0 - 2.0 * (double) best[p]);
        cum[p] = run;
    }
    std::vector<int32_t> added;
    if (run > 0.0) {
        for (int64_t j = 0; j < b; ++j) {
            const double t = kpp_uniform(h, rnd, (uint64_t) j) * run;
            const int64_t p = std::min<int64_t>(std::upper_bound(cum.begin(), cum.begin() + P, t) - cum.begin(), P - 1);
            if (!pr.is_seed[p]) {
                pr.is_seed[p] = 1;
                added.push_back((int32_t) p);
            }
        }
    }
    if (added.empty()) {
        for (int64_t p = 0; p < P && (int64_t) pr.seeds.size() < n_clusters; ++p) {
            if (!pr.is_seed[p]) {
                pr.is_seed[p] = 1;
                pr.seeds.push_back((int32_t) p);
            }
        }
        return {};
    }
    pr.seeds.insert(pr.seeds.end(), added.begin(), added.end());
    return added;
}

// One seeding graph: the similarities of b seeds per problem (rows idx [b, H]) to every row, their maximum into best
// [1, P, H], with the running maximum unless first.
static ggml_cgraph * kpp_graph(ggml_context * ctx, ggml_tensor * xn, ggml_tensor * idx, ggml_tensor * best, int64_t b,
                               bool first) {
    const int64_t H = xn->ne[2];
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_tensor * rows_b = ggml_view_2d(ctx, idx, b, H, b * sizeof(int32_t), 0);
    ggml_tensor * sim = ggml_mul_mat(ctx, ggml_get_rows(ctx, xn, rows_b), xn);                      // [b, P, H]
    ggml_tensor * top = ggml_pool_2d(ctx, sim, GGML_OP_POOL_MAX, (int) b, 1, (int) b, 1, 0, 0);     // [1, P, H]
    if (!first) {
        top = ggml_pool_2d(ctx, ggml_concat(ctx, top, best, 0), GGML_OP_POOL_MAX, 2, 1, 2, 1, 0, 0);
    }
    ggml_build_forward_expand(gf, ggml_cpy(ctx, top, best));
    return gf;
}

// k-means++ seed rows of every problem of xn [d, P, H] (unit rows on the backend) into rows [H][n_clusters]. Round 0
// takes row 0; each later round draws on the host from the similarities read back, then one graph (the same one every
// round: rows padded with row 0, a seed already, which leaves the maximum as it is) adds the new seeds' similarities.
static std::string kpp_seed_rows(ggml_backend_t backend, ggml_gallocr * galloc, ggml_tensor * xn, int64_t n_clusters,
                                 int64_t head0, std::vector<int32_t> & rows) {
    const int64_t P = xn->ne[1], H = xn->ne[2], B = kpp_round_size(n_clusters);
    ggml_init_params ip = { ggml_tensor_overhead() * 2, nullptr, /*no_alloc =*/ true };
    ctx_ptr state(ggml_init(ip));
    ggml_tensor * best = ggml_new_tensor_3d(state.get(), GGML_TYPE_F32, 1, P, H);  // largest similarity to a seed
    ggml_tensor * idx  = ggml_new_tensor_1d(state.get(), GGML_TYPE_I32, B * H);
    std::unique_ptr<ggml_backend_buffer, buffer_deleter> buf(ggml_backend_alloc_ctx_tensors(state.get(), backend));
    if (!buf) {
        return "k-means: could not allocate the seeding's state on the backend";
    }
    std::vector<kpp_problem> pr(H);
    for (auto & p : pr) {
        p.is_seed.assign(P, 0);
        p.is_seed[0] = 1;
        p.seeds.push_back(0);
    }
    std::vector<int32_t> host_idx(B * H, 0);  // round 0: row 0 of each problem
    ggml_backend_tensor_set(idx, host_idx.data(), 0, H * sizeof(int32_t));
    {
        ctx_ptr ctx = graph_context();
        if (!run_graph(backend, galloc, kpp_graph(ctx.get(), xn, idx, best, 1, true))) {
            return "k-means: a seeding graph failed";
        }
    }
    ctx_ptr ctx = graph_context();
    ggml_cgraph * gf = kpp_graph(ctx.get(), xn, idx, best, B, false);
    // the draws of each problem are independent: spread over host threads (each with its own running sums)
    const int n_threads = (int) std::max<int64_t>(1, std::min<int64_t>({ H, 16, (int64_t) std::thread::hardware_concurrency() }));
    std::vector<std::vector<double>> cum(n_threads, std::vector<double>(P));
    std::vector<float> host_best(P * H);
    for (uint64_t rnd = 1;; ++rnd) {
        ggml_backend_tensor_get(best, host_best.data(), 0, ggml_nbytes(best));
        std::vector<std::vector<int32_t>> added(H);
        auto draw = [&](int t) {
            for (int64_t h = t; h < H; h += n_threads) {
                if ((int64_t) pr[h].seeds.size() < n_clusters) {
                    added[h] = kpp_draw(pr[h], host_best.data() + h * P, P, n_clusters, B, (uint64_t) (head0 + h), rnd,
                                        cum[t]);
                }
            }
        };
        std::vector<std::thread> workers;
        for (int t = 1; t < n_threads; ++t) {
            workers.emplace_back(draw, t);
        }
        draw(0);
        for (auto & w : workers) {
            w.join();
        }
        bool any = false, done = true;
        for (int64_t h = 0; h < H; ++h) {
            any = any || !added[h].empty();
            done = done && (int64_t) pr[h].seeds.size() == n_clusters;
        }
        if (done || !any) {
            break;
        }
        std::fill(host_idx.begin(), host_idx.end(), 0);
        for (int64_t h = 0; h < H; ++h) {
            std::copy(added[h].begin(), added[h].end(), host_idx.begin() + h * B);
        }
        ggml_backend_tensor_set(idx, host_idx.data(), 0, host_idx.size() * sizeof(int32_t));
        if (!run_graph(backend, galloc, gf)) {
            return "k-means: a seeding graph failed";
        }
    }
    rows.resize(n_clusters * H);
    for (int64_t h = 0; h < H; ++h) {
        GGML_ASSERT((int64_t) pr[h].seeds.size() == n_clusters);
        std::copy(pr[h].seeds.begin(), pr[h].seeds.end(), rows.begin() + h * n_clusters);
    }
    return "";
}

}  // namespace sparq_kmeans_detail

namespace km = sparq_kmeans_detail;

std::string sparq_kmeans_run(ggml_backend_t backend, ggml_tensor * x, int64_t n_clusters, int n_iter,
                             sparq_kmeans_result & res, sparq_kmeans_init init, int64_t head0, bool center,
                             const float * weights) {
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
    if (init != SPARQ_KMEANS_EVEN && init != SPARQ_KMEANS_KPP) {
        return "k-means: unknown initialisation " + std::to_string((int) init);
    }
    const int64_t t_start = ggml_time_us();
    // persistent state on the backend: normalised rows, centroids, the assignment, the initial rows
    ggml_init_params ip = { ggml_tensor_overhead() * 8, nullptr, /*no_alloc =*/ true };
    km::ctx_ptr state(ggml_init(ip));
    ggml_tensor * w      = weights ? ggml_new_tensor_3d(state.get(), GGML_TYPE_F32, d, 1, H) : nullptr;
    ggml_tensor * xn     = ggml_new_tensor_3d(state.get(), GGML_TYPE_F32, d, P, H);
    ggml_tensor * cent   = ggml_new_tensor_3d(state.get(), GGML_TYPE_F32, d, n_clusters, H);
    ggml_tensor * assign = ggml_new_tensor_2d(state.get(), GGML_TYPE_I32, P, H);
    ggml_tensor * seeds  = ggml_new_tensor_2d(state.get(), GGML_TYPE_I32, n_clusters, H);
    std::unique_ptr<ggml_backend_buffer, km::buffer_deleter> buf(ggml_backend_alloc_ctx_tensors(state.get(), backend));
    if (!buf) {
        return "k-means: could not allocate its state on the backend";
    }
    if (w) {
        ggml_backend_tensor_set(w, weights, 0, ggml_nbytes(w));
    }
    std::unique_ptr<ggml_gallocr, km::gallocr_deleter> galloc(ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend)));
    {  // the unit rows (of the rows minus each problem's mean row where centred, times the weights where given)
        km::ctx_ptr ctx = km::graph_context();
        ggml_cgraph * gf = ggml_new_graph(ctx.get());
        ggml_tensor * rows = x;
        if (center) {
            ggml_tensor * by_component = ggml_cont(ctx.get(), ggml_permute(ctx.get(), x, 1, 0, 2, 3));  // [P, d, H]
            rows = ggml_sub(ctx.get(), x, ggml_reshape_3d(ctx.get(), ggml_mean(ctx.get(), by_component), d, 1, H));
        }
        if (w) {
            rows = ggml_mul(ctx.get(), rows, w);
        }
        ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), ggml_l2_norm(ctx.get(), rows, 1e-30f), xn));
        if (!km::run_graph(backend, galloc.get(), gf)) {
            return "k-means: the normalising graph failed";
        }
    }
    std::vector<int32_t> init_rows(n_clusters * H);
    if (init == SPARQ_KMEANS_KPP) {
        const std::string err = km::kpp_seed_rows(backend, galloc.get(), xn, n_clusters, head0, init_rows);
        if (!err.empty()) {
            return err;
        }
    } else {
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t i = 0; i < n_clusters; ++i) {
                init_rows[h * n_clusters + i] = (int32_t) ((i * P) / n_clusters);
            }
        }
    }
    ggml_backend_tensor_set(seeds, init_rows.data(), 0, ggml_nbytes(seeds));
    {  // the initial centroids
        km::ctx_ptr ctx = km::graph_context();
        ggml_cgraph * gf = ggml_new_graph(ctx.get());
        ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), ggml_get_rows(ctx.get(), xn, seeds), cent));
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
