// sparq-llama inside libllama: the derived KV state SparQ keeps next to llama.cpp's cache, and the
// per-graph inputs that maintain it. The code lives in member functions of llama.cpp's classes that
// are declared by our patch (vendor/patches/0003) and defined in this directory:
//   sparq-llama-context.cpp  C API, llama_context::set_sparq
//   sparq-llama-kv.cpp       llama_kv_cache: allocation, invalidation, rebuild, K^T views and writes
//   sparq-llama-graph.cpp    llm_graph_context::build_attn_sparq: writes + the decode op
#pragma once

#include "sparq-llama.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-sparq.h"
#include "ggml-cpp.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

// Derived state of one cache layer. Absent pieces are nullptr.
struct sparq_kv_layer {
    bool          active = false;  // SparQ decodes this layer (otherwise dense, see reason)
    std::string   reason;          // why not active
    bool          mean_on = false; // mean-value reallocation resolved for this layer
    ggml_tensor * k    = nullptr;  // the cache's K [n_embd_k_gqa, kv_size, n_stream] (not owned): the index and
                                   // the key statistics are computed from it
    ggml_tensor * v    = nullptr;  // the cache's V [n_embd_v_gqa, kv_size, n_stream] (not owned)
    ggml_tensor * kt   = nullptr;  // the index: K^T [row_len, n_embd_k_gqa, n_stream], row_len = kv_size (float
                                   // index) or kv_size rounded up to 32 (q8_0: one block = 32 cells of a component),
                                   // or the q4 index [18*head_dim, n_head_kv, kv_size/32 rounded up, n_stream] i8
    ggml_tensor * vsum = nullptr;  // [(n_embd_head_v + 1) * n_head_kv, n_seq_max] f32: per sequence,
                                   // per KV head, the sum of V over the sequence's cells and their count
    ggml_tensor * kstat = nullptr; // [(2*n_embd_head_k + 1) * n_head_kv, n_seq_max] f32: per sequence and KV head,
                                   // the sum of the keys, the sum of their squares, the count (select qsigma)
    mutable bool  logged = false;  // a graph-time fallback reason was logged
};

// Cells per index block: the index is recomputed from K a block at a time, so that a q8_0 block's scale is a
// function of the cache's keys (and of which cells are occupied) only, not of the order they were written in.
inline int64_t sparq_index_block(const ggml_tensor * kt) {
    return kt->type == GGML_TYPE_Q8_0 ? ggml_blck_size(GGML_TYPE_Q8_0) : kt->type == GGML_TYPE_I8 ? GGML_SPARQ_Q4_CELLS : 1;
}

// k1 = 0 resolved for the index: about 1/8 of dense attention's bytes with the f16 and q8 indexes; the
// q4 index scores every component
inline int64_t sparq_k1_auto(int32_t index, int64_t head_dim) {
    return index == LLAMA_SPARQ_INDEX_Q4 ? head_dim : index == LLAMA_SPARQ_INDEX_Q8 ? head_dim/2 : head_dim/4;
}
inline const char * sparq_k1_auto_name(int32_t index) {
    return index == LLAMA_SPARQ_INDEX_Q4 ? "head_dim" : index == LLAMA_SPARQ_INDEX_Q8 ? "head_dim/2" : "head_dim/4";
}

struct sparq_kv_state {
    llama_sparq_params params = {};

    std::vector<sparq_kv_layer> layers; // indexed like llama_kv_cache::layers (ikv)

    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> ctxs_bufs;

    bool kt_dirty    = true; // K^T must be rebuilt from K (K-shift, state load, stream copy; q8: cells freed)
    bool vsum_dirty  = true; // V sums must be recomputed (cells removed, copied, cleared, state load)
    bool kstat_dirty = true; // key statistics must be recomputed (whenever K^T or the V sums would be)

    // Whether the state is kept at all: update() rebuilds stale parts only once a step may read them, and graphs
    // add the decode upkeep only to a state that is not stale. Below --sparq-min-kv every layer reads its cache
    // densely, and the upkeep there cost ~13 us a layer on a GPU (its kernel and K's RoPE no longer fused with the
    // cache write) for nothing. Set by update() when the next step's cache view reaches a layer's min_n_kv, or by a
    // graph that would have selected over a stale state (that step reads densely); cleared by each rebuild, so
    // after an invalidation (a new conversation) the state waits again. Always set where min_n_kv = 0.
    bool wanted = false;

    bool stale() const { return kt_dirty || vsum_dirty || kstat_dirty; }

    bool has_kt() const {
        for (const auto & l : layers) { if (l.kt) { return true; } }
        return false;
    }
    // a q8_0 index block depends on which of its cells are occupied (the empty ones count as 0)
    bool has_block_index() const {
        for (const auto & l : layers) { if (l.kt && sparq_index_block(l.kt) > 1) { return true; } }
        return false;
    }
    bool has_vsum() const {
        for (const auto & l : layers) { if (l.vsum) { return true; } }
        return false;
    }
    bool has_kstat() const {
        for (const auto & l : layers) { if (l.kstat) { return true; } }
        return false;
    }
};

// What the attention layers of a built graph run (build_attn_sparq counts them while it builds; a reused graph runs
// what it was built for): out.n_layers_sparq/centroid/dense. All zero for a graph without attention over a KV cache.
struct llm_graph_result;
void sparq_graph_run(const llm_graph_result * res, llama_sparq_run & out);

// The tensors build_attn_sparq adds to a graph at most, for llama_context::graph_max_nodes (patch 0003).
struct llama_cparams;
struct llama_model;
uint32_t sparq_graph_nodes(const llama_cparams & cparams, const llama_model & model);

// Dense below this many cells in the graph's KV view unless the user sets min_n_kv, by where the layer's KV
// lives and, on a GPU, on the layer's GQA group: the first depths measured with SparQ (default index and selection)
// at least as fast as dense. CPU: SmolLM2 on 2 x86 cores (bench/results/decode_cpu_min_kv.json: 0.94x of dense at
// 256 cells, 1.10x at 512). GPU: llama-bench end to end, Llama-2-7B and Llama-3-8B shapes, H100 (bench/results/
// cuda_e2e_min_kv.json: 1.04x at 12k with 32 KV heads, 1.04x at 48k with 8; cuda_e2e.json: 0.91x at 8k and 0.90x at
// 32k).
constexpr int32_t SPARQ_DEFAULT_MIN_N_KV         = LLAMA_SPARQ_MIN_N_KV_HOST;
constexpr int32_t SPARQ_DEFAULT_MIN_N_KV_GPU_MHA = LLAMA_SPARQ_MIN_N_KV_GPU_MHA;
constexpr int32_t SPARQ_DEFAULT_MIN_N_KV_GPU_GQA = LLAMA_SPARQ_MIN_N_KV_GPU_GQA;

// Whether a (view of a) cache tensor lives in host memory: the CPU's measured default applies there, the GPU's
// elsewhere (sparq_min_n_kv).
inline bool sparq_on_host(const ggml_tensor * t) {
    const ggml_tensor * src = t->view_src ? t->view_src : t;
    return src->buffer == nullptr || ggml_backend_buffer_is_host(src->buffer);
}

// The settings' automatic values, resolved (one definition for the graph, the check and the log).
inline int32_t sparq_min_n_kv(const llama_sparq_params & p, bool kv_on_host = true, bool mha = true) {
    if (p.min_n_kv >= 0) {
        return p.min_n_kv;
    }
    return kv_on_host ? SPARQ_DEFAULT_MIN_N_KV : mha ? SPARQ_DEFAULT_MIN_N_KV_GPU_MHA : SPARQ_DEFAULT_MIN_N_KV_GPU_GQA;
}
inline int32_t sparq_window(const llama_sparq_params & p) {
    return p.window >= 0 ? p.window : p.k2 / 4;
}

//
// centroid-sparse ("Squeezed") attention over a prepared prefix (sparq-squeeze.h lists its files)
//

// One cache layer's clusters. Host copies are what the sidecar holds; the tensors what graphs read.
struct squeeze_kv_layer {
    bool        active = false;  // decoded with ggml_centroid_attn (otherwise dense, see reason)
    std::string reason;
    int64_t     d = 0, n_head_kv = 0, n_cent = 0, n_coarse = 0;
    int64_t     width = 0;             // floats per table row: 2d + 1 (means, size, variances); d + 1 from old sidecars
    std::vector<float>   table;        // [n_head_kv][n_cent][width]: member means, the size, the members' variances
    std::vector<int32_t> assign;       // [n_head_kv][n_clustered]: the cluster of each clustered position
    std::vector<float>   coarse_table; // [n_head_kv][n_coarse][width] (two levels)
    std::vector<int32_t> parent;       // [n_head_kv][n_cent] (two levels)
    ggml_tensor * cent   = nullptr;    // [width, n_cent, n_head_kv, n_stream] f32
    ggml_tensor * cell   = nullptr;    // [kv_size, n_head_kv, n_stream] i32, -1 outside the clustered prefix
    ggml_tensor * coarse = nullptr;    // [width, n_coarse, n_head_kv, n_stream] f32
    ggml_tensor * par    = nullptr;    // [n_cent, n_head_kv, n_stream] i32
    mutable bool logged  = false;      // a graph-time fallback reason was logged
};

// A prefix being prepared (capturing the calibration queries) or prepared.
struct squeeze_kv_state {
    llama_squeeze_params params = {};
    uint64_t generation = 0;           // unique per state: graphs built with it are reused only while it lives
    int32_t  seq_id = 0;
    uint32_t stream = 0;
    int32_t  n_prefix = 0, n_clustered = 0;
    // two levels: the calibrated coarse threshold and the mean share of the clustered cells under the coarse clusters
    // it keeps on the calibration queries (one level: 0 and 1; the fine level's budget is params.keep)
    float    threshold_coarse = 0.0f, kept_calib = 1.0f;
    std::vector<int32_t>  tokens;      // the prefix
    std::vector<uint32_t> cells;       // [n_clustered]: the cell holding each clustered position
    // other streams that a cross-stream seq_cp filled from the prefix's stream (or from a mirror): they hold the
    // prefix's keys in the same cells, so their slices of the tables are the prefix's (one stream per sequence)
    std::vector<uint32_t> mirrors;
    std::vector<squeeze_kv_layer> layers; // indexed like llama_kv_cache::layers
    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> ctxs_bufs;

    bool ready = false;                // tables installed: graphs use the op
    int32_t prefill = LLAMA_SQUEEZE_PREFILL_AUTO;  // enum llama_squeeze_prefill (not saved: a load starts at AUTO)
    bool check = false;                // cells may have changed since the last graph: verify first

    // while capturing: the graph copies each layer's query rows out (il -> [d, n_head, n_tokens] f32)
    bool capturing = false;
    std::map<int32_t, ggml_tensor *> captured_q;
    std::map<int32_t, float>         captured_scale;

    // the calibration queries of the active layers (il -> [n_calib][n_head][d]) and their logit scales, kept for
    // llama_squeeze_recalibrate and the sidecar (a version-1 sidecar has none)
    std::map<int32_t, std::vector<float>> calib_q;
    std::map<int32_t, float>              calib_scale;
};

// The centroid-sparse attention of a layer for the current ubatch, or nullptr (dense / SparQ decides).
struct llama_kv_cache_context;
struct llm_graph_result;
ggml_tensor * squeeze_build_attn(ggml_context * ctx0, llm_graph_result * res, const llama_kv_cache_context * mctx,
                                 ggml_tensor * q, ggml_tensor * kq_mask, float kq_scale, float softcap, int il,
                                 bool unsupported_inputs, bool decode);
