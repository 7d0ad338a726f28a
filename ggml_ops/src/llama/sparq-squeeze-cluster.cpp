// The clustering of a prepared prefix (docs/design.md, "Prepared prefixes"): per layer, the clustered prefix keys
// of every KV head, gathered from the cache on the backend that holds it, run through the graph k-means
// (sparq-kmeans.cpp); two levels cluster the centroids again. Also whether a layer's device runs the op.
#include "sparq-squeeze.h"

#include "../sparq-kmeans.h"

#include "ggml-alloc.h"
#include "ggml-centroid.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

namespace sparq_squeeze_detail {

struct ctx_free { void operator()(ggml_context * c) const { ggml_free(c); } };
struct buf_free { void operator()(ggml_backend_buffer * b) const { ggml_backend_buffer_free(b); } };
struct galloc_free { void operator()(ggml_gallocr * g) const { ggml_gallocr_free(g); } };

// k-means of one layer's clustered prefix keys, heads [h0, h0 + n_h) of the stream, into res (table and
// assignment for those heads). The keys are gathered from the cache on `backend` (cells given by position).
// Bytes the k-means similarity matrix of one chunk of heads may take: 1 GiB on the CPU; on a GPU a quarter of
// its free memory, within [1, 8] GiB (a 7B-shaped 32k prefix then clusters a layer's 32 KV heads at once
// instead of 7 chunks of 5, each chunk being a gather, a graph and an allocation).
static int64_t similarity_budget(ggml_backend_t backend) {
    const int64_t gib = int64_t(1) << 30;
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    if (dev == nullptr || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU) {
        return gib;
    }
    size_t free_bytes = 0, total_bytes = 0;
    ggml_backend_dev_memory(dev, &free_bytes, &total_bytes);
    return std::clamp<int64_t>((int64_t) (free_bytes/4), gib, 8*gib);
}

// The weights with which layer il's queries weigh its keys' components, [n_head_kv][d], from the model's query norm
// (QK-norm models: Gemma-3, Qwen-3, OLMo-2): per KV head, each component's norm weight as the rms over the head's
// query heads, and over each rotary pair (RoPE mixes a pair's two components, so a query's energy in it is shared).
// Empty where the layer has no f32 query norm of head_dim or n_head*head_dim weights: keys compared unweighted.
// Clustering the keys so weighted keeps together keys whose scores agree: on Gemma-3 it raised the recall of the
// exact top-128 at keep 10% (docs/quality.md, "Cluster recall").
static std::vector<float> query_weights(const llama_model & model, uint32_t il, int64_t d, int64_t n_head_kv) {
    const ggml_tensor * g = il < model.layers.size() ? model.layers[il].attn_q_norm : nullptr;
    const int64_t n_head = model.hparams.n_head(il);
    if (g == nullptr || g->type != GGML_TYPE_F32 || (g->ne[0] != d && g->ne[0] != d*n_head) ||
        ggml_nelements(g) != g->ne[0] || n_head_kv < 1 || n_head % n_head_kv != 0) {
        return {};
    }
    std::vector<float> gamma(g->ne[0]);
    ggml_backend_tensor_get(g, gamma.data(), 0, ggml_nbytes(g));
    const int64_t group = n_head/n_head_kv;
    const int64_t n_rot = std::min<int64_t>(model.hparams.n_rot(il), d);
    const llama_rope_type rope = model.hparams.rope_type;
    // the component paired with c by the rotation (c itself where not rotated)
    auto partner = [&](int64_t c) -> int64_t {
        if (c >= n_rot || (rope != LLAMA_ROPE_TYPE_NORM && rope != LLAMA_ROPE_TYPE_NEOX)) {
            return c;
        }
        return rope == LLAMA_ROPE_TYPE_NORM ? c ^ 1 : (c < n_rot/2 ? c + n_rot/2 : c - n_rot/2);
    };
    std::vector<float> w((size_t) (n_head_kv*d));
    for (int64_t h = 0; h < n_head_kv; ++h) {
        for (int64_t c = 0; c < d; ++c) {
            double sum = 0.0;
            for (int64_t j = 0; j < group; ++j) {
                const float * gh = gamma.data() + (g->ne[0] == d ? 0 : (h*group + j)*d);
                sum += 0.5*((double) gh[c]*gh[c] + (double) gh[partner(c)]*gh[partner(c)]);
            }
            w[h*d + c] = (float) std::sqrt(sum/group);
        }
    }
    return w;
}

static std::string cluster_heads(ggml_backend_t backend, ggml_tensor * k_cache, uint32_t kv_size, uint32_t stream,
                          int64_t d, int64_t h0, int64_t n_h, const std::vector<uint32_t> & cells, int64_t n_cent,
                          int n_iter, sparq_kmeans_init init, const float * weights, sparq_kmeans_result & res) {
    const int64_t P = (int64_t) cells.size();
    const int64_t n_embd = k_cache->ne[0];
    ggml_init_params ip = { 8*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc =*/ true };
    std::unique_ptr<ggml_context, ctx_free> ctx(ggml_init(ip));
    ggml_tensor * idx = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, P);
    ggml_tensor * x   = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, d, P, n_h);
    std::unique_ptr<ggml_backend_buffer, buf_free> buf(ggml_backend_alloc_ctx_tensors(ctx.get(), backend));
    if (!buf) {
        return "could not allocate the keys to cluster on " + std::string(ggml_backend_name(backend));
    }
    std::vector<int32_t> rows(cells.begin(), cells.end());
    ggml_backend_tensor_set(idx, rows.data(), 0, ggml_nbytes(idx));

    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    GGML_ASSERT((h0 + n_h)*d <= n_embd);
    // only the chunk's heads of each cell ([d*n_h] of the row's n_embd components) where the type's blocks
    // allow a view from head h0, else whole rows
    const int64_t blck = ggml_blck_size(k_cache->type);
    const bool narrow = (d*h0) % blck == 0 && (d*n_h) % blck == 0;
    const int64_t c0 = narrow ? d*h0 : 0;
    ggml_tensor * ks = ggml_view_2d(ctx.get(), k_cache, narrow ? d*n_h : n_embd, kv_size, k_cache->nb[1],
                                    k_cache->nb[1]*kv_size*stream + ggml_row_size(k_cache->type, c0));
    ggml_tensor * kr = ggml_get_rows(ctx.get(), ks, idx);                                   // [d*n_h or n_embd, P] f32
    ggml_tensor * kh = ggml_view_3d(ctx.get(), kr, d, n_h, P, ggml_row_size(kr->type, d), kr->nb[1],
                                    ggml_row_size(kr->type, d*h0 - c0));                     // [d, n_h, P]
    ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), ggml_permute(ctx.get(), kh, 0, 2, 1, 3), x));
    std::unique_ptr<ggml_gallocr, galloc_free> galloc(ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend)));
    if (!ggml_gallocr_alloc_graph(galloc.get(), gf) || ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
        return "gathering the prefix keys failed on " + std::string(ggml_backend_name(backend));
    }
    // problem h is the layer's head h0 + h. The keys are compared minus their mean key: a shared part shifts every
    // score of a query alike but dominates the keys' directions (on Gemma-3 about half of a key's energy), so
    // clusters of the raw directions group keys whose scores differ (docs/quality.md, "Cluster recall"); and
    // weighted as the queries weigh them where the model says how (query_weights)
    return sparq_kmeans_run(backend, x, n_cent, n_iter, res, init, h0, /*center =*/ true, weights);
}

// Coarse level: k-means of the fine centroids (their components) per head on `backend`; the coarse table is the
// size-weighted mean of the member centroids (= the mean of the member keys), the summed size and (tables with
// variances) the member keys' variances about the coarse centroid, sum_f N_f (D_f + (C_f - C)^2) / N: the law of
// total variance, exact from the fine table.
static std::string cluster_coarse(ggml_backend_t backend, squeeze_kv_layer & L, int64_t n_coarse, int n_iter,
                                  sparq_kmeans_init init) {
    const int64_t d = L.d, H = L.n_head_kv, n = L.n_cent, W = L.width;
    GGML_ASSERT(W == d + 1 || W == 2*d + 1);
    ggml_init_params ip = { 2*ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    std::unique_ptr<ggml_context, ctx_free> ctx(ggml_init(ip));
    ggml_tensor * x = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, d, n, H);
    std::unique_ptr<ggml_backend_buffer, buf_free> buf(ggml_backend_alloc_ctx_tensors(ctx.get(), backend));
    if (!buf) {
        return "could not allocate the centroids to cluster";
    }
    std::vector<float> comp((size_t) d*n*H);
    for (int64_t r = 0; r < n*H; ++r) {
        std::memcpy(comp.data() + r*d, L.table.data() + r*W, d*sizeof(float));
    }
    ggml_backend_tensor_set(x, comp.data(), 0, ggml_nbytes(x));
    sparq_kmeans_result res;
    std::string err = sparq_kmeans_run(backend, x, n_coarse, n_iter, res, init);
    if (!err.empty()) {
        return err;
    }
    L.n_coarse = n_coarse;
    L.parent = res.assignment;
    L.coarse_table.assign((size_t) H*n_coarse*W, 0.0f);
    std::vector<double> acc((size_t) H*n_coarse*W, 0.0);  // sums of N C (then N (D + (C_f - C)^2)) and N
    for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < n; ++i) {
            const float * c = L.table.data() + (h*n + i)*W;
            double * a = acc.data() + (h*n_coarse + L.parent[h*n + i])*W;
            for (int64_t e = 0; e < d; ++e) {
                a[e] += (double) c[d]*c[e];
            }
            a[d] += c[d];
        }
    }
    for (int64_t r = 0; r < H*n_coarse; ++r) {  // the means
        const double size = acc[r*W + d];
        for (int64_t e = 0; e < d; ++e) {
            acc[r*W + e] = size > 0.0 ? acc[r*W + e]/size : 0.0;
        }
    }
    if (W == 2*d + 1) {
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t i = 0; i < n; ++i) {
                const float * c = L.table.data() + (h*n + i)*W;
                double * a = acc.data() + (h*n_coarse + L.parent[h*n + i])*W;
                for (int64_t e = 0; e < d; ++e) {
                    const double dev = (double) c[e] - a[e];
                    a[d + 1 + e] += (double) c[d]*((double) c[d + 1 + e] + dev*dev);
                }
            }
        }
    }
    for (int64_t r = 0; r < H*n_coarse; ++r) {
        const double size = acc[r*W + d];
        for (int64_t e = 0; e < W; ++e) {
            L.coarse_table[r*W + e] = (float) (e <= d ? acc[r*W + e] : size > 0.0 ? acc[r*W + e]/size : 0.0);
        }
    }
    return "";
}

static bool host_buffer(const ggml_tensor * t) {
    return t->buffer == nullptr || ggml_backend_buffer_is_host(t->buffer);
}

// Whether the device holding this layer's cache can run ggml_centroid_attn on it.
bool device_runs_op(const ggml_tensor * k_cache, const ggml_tensor * v_cache, int64_t d, int64_t d_v, int64_t n_head,
                    int64_t n_head_kv, bool two_levels) {
    if (host_buffer(k_cache)) {
        return true; // the CPU kernel takes every case the op's check accepts
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(k_cache->buffer));
    if (dev == nullptr) {
        return false;
    }
    ggml_init_params ip = { 12*ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    std::unique_ptr<ggml_context, ctx_free> ctx(ggml_init(ip));
    const int64_t n = 256;
    ggml_tensor * q    = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, d, 1, n_head, 1);
    ggml_tensor * k    = ggml_new_tensor_4d(ctx.get(), k_cache->type, d, n, n_head_kv, 1);
    ggml_tensor * v    = ggml_new_tensor_4d(ctx.get(), v_cache->type, d_v, n, n_head_kv, 1);
    ggml_tensor * mask = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F16, n, 1, 1, 1);
    ggml_tensor * cent = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, 2*d + 1, 8, n_head_kv, 1);
    ggml_tensor * cell = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_I32, n, n_head_kv, 1);
    ggml_tensor * coarse = two_levels ? ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, 2*d + 1, 2, n_head_kv, 1) : nullptr;
    ggml_tensor * parent = two_levels ? ggml_new_tensor_3d(ctx.get(), GGML_TYPE_I32, 8, n_head_kv, 1) : nullptr;
    ggml_centroid_params p = ggml_centroid_default_params();
    p.keep = 0.5f;
    p.var_weight = 0.5f;
    if (ggml_centroid_attn_check(q, k, v, mask, cent, cell, coarse, parent, &p) != nullptr) {
        return false;
    }
    ggml_tensor * op = ggml_centroid_attn(ctx.get(), q, k, v, mask, cent, cell, coarse, parent, p);
    return ggml_backend_dev_supports_op(dev, op);
}

}  // namespace sparq_squeeze_detail

namespace sqp = sparq_squeeze_detail;

// Step 2: k-means of each active layer's clustered keys (positions [0, n_clustered)) on the backend that holds
// its cache, then the coarse level; progress(f) reports f in [0.05, 0.9] and cancels by returning false.
std::string sparq_squeeze_access::cluster_layers(llama_context & ctx, llama_kv_cache & kv, squeeze_kv_state & st,
                                                 int64_t n_cent, int64_t n_coarse, int n_active,
                                                 const std::function<bool(float)> & progress) {
    std::string err = prefix_cells(kv, st.seq_id, st.n_prefix, st.n_clustered, true, st.stream, st.cells);
    if (!err.empty()) {
        return err;
    }
    const int64_t n_clustered = st.n_clustered;
    const uint32_t kv_size = kv.get_size();
    int n_weighted = 0;
    for (size_t ikv = 0, done = 0; ikv < kv.layers.size(); ++ikv) {
        auto & L = st.layers[ikv];
        if (!L.active) {
            continue;
        }
        const auto & layer = kv.layers[ikv];
        ggml_backend_t backend = backend_for(ctx, layer.k);
        if (backend == nullptr) {
            return "no backend of this context holds layer " + std::to_string(layer.il) + "'s cache";
        }
        L.n_cent = n_cent;
        L.width = 2*L.d + 1;  // the k-means table holds the variances
        L.table.assign((size_t) L.n_head_kv*n_cent*L.width, 0.0f);
        L.assign.assign((size_t) L.n_head_kv*n_clustered, 0);
        // a chunk of heads at a time keeps the similarity matrix [n_cent, P, heads] f32 within the budget
        const int64_t per_head = n_cent*n_clustered*(int64_t) sizeof(float);
        const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(L.n_head_kv, sqp::similarity_budget(backend)/std::max<int64_t>(1, per_head)));
        const std::vector<float> weights = sqp::query_weights(ctx.get_model(), layer.il, L.d, L.n_head_kv);
        n_weighted += !weights.empty();
        for (int64_t h0 = 0; h0 < L.n_head_kv; h0 += chunk) {
            const int64_t n_h = std::min(chunk, L.n_head_kv - h0);
            sparq_kmeans_result res;
            res.table_dst = L.table.data() + h0*n_cent*L.width;  // read back in place: [n_h][n_cent][width]
            err = sqp::cluster_heads(backend, layer.k, kv_size, st.stream, L.d, h0, n_h, st.cells, n_cent,
                                     st.params.n_iter, (sparq_kmeans_init) st.params.init,
                                     weights.empty() ? nullptr : weights.data() + h0*L.d, res);
            if (!err.empty()) {
                return "layer " + std::to_string(layer.il) + ": " + err;
            }
            std::copy(res.assignment.begin(), res.assignment.end(), L.assign.begin() + h0*n_clustered);
        }
        if (n_coarse > 0) {
            err = sqp::cluster_coarse(backend, L, n_coarse, st.params.n_iter, (sparq_kmeans_init) st.params.init);
            if (!err.empty()) {
                return "layer " + std::to_string(layer.il) + " (coarse level): " + err;
            }
        }
        if (!progress(0.05f + 0.85f*(float) ++done/(float) n_active)) {
            return "cancelled";
        }
    }
    if (n_weighted > 0) {
        LLAMA_LOG_INFO("%s: centroid-sparse: keys clustered weighted by the query norm (QK-norm) in %d of %d layers\n",
                       __func__, n_weighted, n_active);
    }
    return "";
}

ggml_backend_t sparq_squeeze_access::backend_for(llama_context & ctx, const ggml_tensor * t) {
    if (sqp::host_buffer(t)) {
        return ctx.backend_cpu;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    for (auto & b : ctx.backends) {
        if (ggml_backend_get_device(b.get()) == dev) {
            return b.get();
        }
    }
    return nullptr;
}
