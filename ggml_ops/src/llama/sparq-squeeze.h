// Centroid-sparse attention over a prepared prefix inside libllama. llama_kv_cache and llama_context name
// sparq_squeeze_access a friend (vendor/patches/0003), so the code here reaches their private members
// without more hook points:
//   sparq-squeeze-state.cpp      the cache side: prefix cells, checks, device tables, the graph op
//   sparq-squeeze-prepare.cpp    the context side: the cache, layer selection, query capture, preparing in order
//   sparq-squeeze-cluster.cpp    k-means of the prefix keys per layer (and of the centroids: two levels)
//   sparq-squeeze-calibrate.cpp  two levels: the coarse threshold from the calibration queries (and a new keep)
//   sparq-squeeze-sidecar.cpp    saving and loading a prepared prefix (the sidecar file)
//   sparq-squeeze-api.cpp        the llama_squeeze_* C API
//   sparq-state-file.cpp         loading a saved prefix's KV state: checked, and into a context of other stream counts;
//                                its parts' checksums (recorded in the sidecar)
#pragma once

#include "sparq-llama-internal.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

class llama_kv_cache;
struct llama_context;

namespace sparq_squeeze_detail {

// A byte range of a saved KV state file and the checksum of its bytes (hash64), named for messages ("layer 3 V").
struct state_part {
    std::string name;
    uint64_t    offset = 0, length = 0, hash = 0;
};

// What a sidecar records of the KV state file saved with it: its size and its parts, which cover it in order (none:
// a sidecar saved alone, by llama_squeeze_save).
struct state_record {
    uint64_t                size = 0;
    std::vector<state_part> parts;
};

}  // namespace sparq_squeeze_detail

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
    // the sidecar; with rec, it records the KV state file saved with it
    static std::string save(llama_context & ctx, const char * path,
                            const sparq_squeeze_detail::state_record * rec = nullptr);
    // the KV state of the prefix's sequence to state_path, then its sidecar recording that file's parts
    static std::string save_files(llama_context & ctx, const char * state_path, const char * sidecar_path);
    // prepare's steps
    static int select_layers(llama_context & ctx, const llama_kv_cache & kv, squeeze_kv_state & st);
    static std::string capture_queries(llama_context & ctx, squeeze_kv_state & st, const int32_t * tokens,
                                       bool tail_in_cache, std::map<int32_t, std::vector<float>> & q_rows);
    // why the cache cannot decode seq_id's positions from n_clustered again as they were ("" when it can)
    static std::string redecode_check(llama_context & ctx, int32_t seq_id, int32_t n_clustered);
    static std::string cluster_layers(llama_context & ctx, llama_kv_cache & kv, squeeze_kv_state & st, int64_t n_cent,
                                      int64_t n_coarse, int n_active, const std::function<bool(float)> & progress);
    static std::string calibrate_layers(llama_context & ctx, const llama_kv_cache & kv, squeeze_kv_state & st);
    // a new keep for a prepared prefix (two levels: the coarse threshold again from its calibration queries)
    static std::string recalibrate(llama_context & ctx, float keep, float keep_coarse);
    static std::string load(llama_context & ctx, int32_t seq_id, const char * path, const int32_t * tokens,
                            int32_t n_tokens);
    // a sidecar's bytes parsed and checked against this context (model, cache layout, tokens), nothing applied
    static std::string parse_sidecar(llama_context & ctx, const llama_kv_cache & kv, const char * path,
                                     const std::vector<uint8_t> & file, const int32_t * tokens, int32_t n_tokens,
                                     squeeze_kv_state & st, sparq_squeeze_detail::state_record & rec,
                                     uint32_t & version);
    // a parsed sidecar's prefix installed over seq_id's cells, which must hold it (its KV state loaded)
    static std::string apply_sidecar(llama_context & ctx, llama_kv_cache & kv,
                                     const std::shared_ptr<squeeze_kv_state> & st, int32_t seq_id, const char * path);
    // both files verified (the sidecar's parts, the KV state against the sidecar's record) before either is applied
    static std::string load_files(llama_context & ctx, int32_t seq_id, const char * state_path,
                                  const char * sidecar_path, int32_t * tokens_out, size_t capacity, size_t * n_out);
    static void clear(llama_context & ctx);
    static llama_kv_cache * cache(llama_context & ctx, std::string & err);
    static void reset_graphs(llama_context & ctx);
    static ggml_backend_t backend_for(llama_context & ctx, const ggml_tensor * t);
};

// The result of a llama_squeeze_* C API call: 0 when err is empty, else -1 with err logged (as fn's) and kept for
// llama_squeeze_last_error() (sparq-squeeze-api.cpp)
int32_t sparq_squeeze_result(const char * fn, const std::string & err);

namespace sparq_squeeze_detail {

// A checksum of n bytes (64 bits; detects damage, not forgery). Its definition is the file format's: the tests
// carry a Python copy of it (sparq-state-file.cpp).
uint64_t hash64(const void * data, size_t n);
// The whole of a file, or why not ("" on success).
std::string read_file(const char * path, std::vector<uint8_t> & bytes);
// A saved KV state file's parts, in order, with their checksums: its header and tokens, then per cache and stream
// the cells and each layer's K and V (one part for a memory that is not KV caches).
std::vector<state_part> state_file_parts(const std::vector<uint8_t> & file);
// Whether file (read from path) is the KV state that sidecar recorded in rec, holding the sidecar's prefix tokens
// (exactly, or at its start when rec has no parts: nothing recorded): "" or the reason, naming the file and the part.
std::string verify_state(const char * path, const std::vector<uint8_t> & file, const char * sidecar,
                         const state_record & rec, const std::vector<int32_t> & prefix);
// llama_squeeze_load_state_file from a file's bytes already read (and verified); the bytes are reused as the state
// llama.cpp reads, so file's contents are undefined afterwards.
std::string load_state(llama_context * ctx, int32_t seq_id, const char * path, std::vector<uint8_t> & file,
                       int32_t * tokens_out, size_t capacity, size_t * n_out);

// Whether the device holding this layer's cache can run ggml_centroid_attn on it (sparq-squeeze-cluster.cpp).
bool device_runs_op(const ggml_tensor * k_cache, const ggml_tensor * v_cache, int64_t d, int64_t d_v, int64_t n_head,
                    int64_t n_head_kv, bool two_levels);

}  // namespace sparq_squeeze_detail
