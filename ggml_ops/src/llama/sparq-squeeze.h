// Centroid-sparse attention over a prepared prefix inside libllama. llama_kv_cache and llama_context name
// sparq_squeeze_access a friend (vendor/patches/0003), so the code here reaches their private members
// without more hook points:
//   sparq-squeeze-state.cpp      the cache side: prefix cells, checks, device tables, the graph op
//   sparq-squeeze-prepare.cpp    the context side: the cache, layer selection, query capture, preparing in order
//   sparq-squeeze-cluster.cpp    k-means of the prefix keys per layer (and of the centroids: two levels)
//   sparq-squeeze-calibrate.cpp  the thresholds from the calibration queries (and recalibrating at a new keep)
//   sparq-squeeze-sidecar.cpp    saving and loading a prepared prefix (the sidecar file)
//   sparq-squeeze-api.cpp        the llama_squeeze_* C API
//   sparq-state-file.cpp         loading a saved prefix's KV state: checked, and into a context of other stream counts
#pragma once

#include "sparq-llama-internal.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

class llama_kv_cache;
struct llama_context;

struct sparq_squeeze_access {
    static uint64_t next_generation();

    // The cells holding positions [0, n_need) of seq_id (the cache must hold at least n_prefix positions, and
    // with only_prefix no more). "" on success, else why not.
    static std::string prefix_cells(const llama_kv_cache & kv, int32_t seq_id, int32_t n_prefix, int32_t n_need,
                                    bool only_prefix, uint32_t & stream, std::vector<uint32_t> & cells);

    // Allocates and fills the device tables of the active layers from the host copies; marks st ready.
    static std::string install(llama_kv_cache & kv, squeeze_kv_state & st);

    // After a cache change: drops the prepared prefix when a clustered cell no longer holds its position.
    static void verify(llama_kv_cache & kv);
    // whether seq_id alone holds some of the prefix's cells (removing it would free them for reuse)
    static bool sole_holder(const llama_kv_cache & kv, int32_t seq_id);
    static void drop(llama_kv_cache & kv, const char * why);

    // Mirror streams (one stream per sequence): a cross-stream seq_cp whose source stream holds the prefix makes the
    // destination a mirror (its table slices filled), any other copy into a mirror ends it (slices cleared: dense).
    static void stream_copied(llama_kv_cache & kv, uint32_t s_src, uint32_t s_dst);
    static void end_mirror(llama_kv_cache & kv, uint32_t stream, const char * why);
    // whether stream holds every clustered position of the prefix in the prefix's cells
    static bool holds_prefix(const llama_kv_cache & kv, const squeeze_kv_state & st, uint32_t stream);
    // whether seq_id reads the prefix sparsely: it holds every clustered cell, in the prefix's stream or a mirror
    static bool seq_sparse(const llama_kv_cache & kv, int32_t seq_id);
    // seq_id's stream when that is the prefix's or a mirror (a prefix is prepared), else UINT32_MAX
    static uint32_t prefix_stream_of(const llama_kv_cache & kv, int32_t seq_id);

    static const squeeze_kv_layer * layer(const llama_kv_cache & kv, int32_t il);

    // context side (sparq-squeeze-prepare.cpp, -cluster.cpp, -calibrate.cpp, -sidecar.cpp)
    static std::string prepare(llama_context & ctx, int32_t seq_id, const int32_t * tokens, int32_t n_prefix,
                               const llama_squeeze_params & params);
    static std::string save(llama_context & ctx, const char * path);
    // prepare's steps
    static int select_layers(llama_context & ctx, const llama_kv_cache & kv, squeeze_kv_state & st);
    static std::string capture_queries(llama_context & ctx, squeeze_kv_state & st, const int32_t * tokens,
                                       bool tail_in_cache, std::map<int32_t, std::vector<float>> & q_rows);
    // why the cache cannot decode seq_id's positions from n_clustered again as they were ("" when it can)
    static std::string redecode_check(llama_context & ctx, int32_t seq_id, int32_t n_clustered);
    static std::string cluster_layers(llama_context & ctx, llama_kv_cache & kv, squeeze_kv_state & st, int64_t n_cent,
                                      int64_t n_coarse, int n_active, const std::function<bool(float)> & progress);
    static std::string calibrate_layers(llama_context & ctx, const llama_kv_cache & kv, squeeze_kv_state & st);
    // a new keep for a prepared prefix: the thresholds again from its kept calibration queries (no clustering)
    static std::string recalibrate(llama_context & ctx, float keep, float keep_coarse);
    static std::string load(llama_context & ctx, int32_t seq_id, const char * path, const int32_t * tokens,
                            int32_t n_tokens);
    static void clear(llama_context & ctx);
    static llama_kv_cache * cache(llama_context & ctx, std::string & err);
    static void reset_graphs(llama_context & ctx);
    static ggml_backend_t backend_for(llama_context & ctx, const ggml_tensor * t);
};

// The result of a llama_squeeze_* C API call: 0 when err is empty, else -1 with err logged (as fn's) and kept for
// llama_squeeze_last_error() (sparq-squeeze-api.cpp)
int32_t sparq_squeeze_result(const char * fn, const std::string & err);

namespace sparq_squeeze_detail {

// Whether the device holding this layer's cache can run ggml_centroid_attn on it (sparq-squeeze-cluster.cpp).
bool device_runs_op(const ggml_tensor * k_cache, const ggml_tensor * v_cache, int64_t d, int64_t d_v, int64_t n_head,
                    int64_t n_head_kv, bool two_levels);

}  // namespace sparq_squeeze_detail
