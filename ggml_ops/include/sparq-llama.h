// sparq-llama: the public C API of our additions to llama.cpp, exported from libllama.
// Functions only: llama.cpp's public structs are never changed (llama-cpp-python binds them by value).
#pragma once

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#    define SPARQ_API __declspec(dllexport)
#else
#    define SPARQ_API __attribute__((visibility("default")))
#endif

// Version of the sparq-llama package this library was built from, e.g. "0.1.0".
SPARQ_API const char * sparq_llama_version(void);

// What this build holds, as one JSON object (static storage, never freed):
//   {"name": "sparq-llama", "version": ..., "llama_cpp_commit": ..., "llama_cpp_python": ...,
//    "ops": [names of our ggml ops compiled in], "backends": [ggml backends compiled in, e.g. "CPU", "CUDA"]}
SPARQ_API const char * sparq_llama_build_info(void);

struct ggml_sparq_params;

// One evaluation of ggml_sparq_attn over host arrays, for tests and research (sparq_llama.ops).
// Arrays are C-contiguous in ggml order (ne0 fastest): q [ns][n_head][n_q][d] f32,
// k [ns][n_head_kv][n_kv][d], kt [ns][n_head_kv][d][n_kv] (or NULL), v [ns][n_head_kv][n_kv][d_v] of kv_type
// (a ggml_type: f32, f16 or bf16), mask [mask_ns][n_q][n_kv] f16 0/-inf (or NULL),
// vsum [ns][n_q][n_head_kv][d_v + 1] f32 (or NULL); out [ns][n_q][n_head][d_v] f32.
struct sparq_eval_args {
    const char * device;   // ggml device name ("CPU", "CUDA0"); NULL or "": the CPU
    int          n_threads;
    int          kv_type;
    int64_t      d, d_v, n_q, n_head, n_head_kv, n_kv, ns, mask_ns;
    const float * q;
    const void  * k;
    const void  * kt;
    const void  * v;
    const void  * mask;
    const float * vsum;
    const struct ggml_sparq_params * params;
    float       * out;
    const int32_t * pos;   // [ns][n_kv] cell positions for the window and sinks (NULL: cell order)
};

// 0 on success; otherwise 1 with a message in err (never aborts on bad arguments).
SPARQ_API int sparq_llama_eval_sparq_attn(const struct sparq_eval_args * args, char * err, size_t err_size);

struct ggml_centroid_params;

// One evaluation of ggml_centroid_attn over host arrays (sparq_llama.ops.centroid_attn). Arrays are
// C-contiguous in ggml order: q, k, v and mask as for sparq_eval_args; cent [ns][n_head_kv][n_cent][d + 1] f32
// (components, then the cluster size); cell [ns][n_head_kv][n_kv] i32 (-1: not clustered); coarse
// [ns][n_head_kv][n_coarse][d + 1] f32 and parent [ns][n_head_kv][n_cent] i32, both or neither (two levels);
// out [ns][n_q][n_head][d_v] f32. 0 on success; otherwise 1 with a message in err.
struct centroid_eval_args {
    const char * device;   // ggml device name ("CPU", "CUDA0"); NULL or "": the CPU
    int          n_threads;
    int          kv_type;
    int64_t      d, d_v, n_q, n_head, n_head_kv, n_kv, ns, mask_ns, n_cent, n_coarse;
    const float   * q;
    const void    * k;
    const void    * v;
    const void    * mask;
    const float   * cent;
    const int32_t * cell;
    const float   * coarse;
    const int32_t * parent;
    const struct ggml_centroid_params * params;
    float         * out;
};
SPARQ_API int sparq_llama_eval_centroid_attn(const struct centroid_eval_args * args, char * err, size_t err_size);

// Spherical k-means of H problems of P rows as ggml graphs on a backend (sparq_llama.ops.kmeans_cosine; the
// clustering of a fixed prefix for centroid-sparse attention). x [H][P][d] f32; table [H][n][d + 1] f32 out
// (member means of the unnormalised rows, then the size); assignment [H][P] i32 out; *n_iter_run out.
// 0 on success; otherwise 1 with a message in err.
struct kmeans_eval_args {
    const char * device;   // NULL or "": the CPU
    int          n_threads;
    int64_t      d, P, H, n_clusters;
    int          n_iter;
    const float * x;
    float       * table;
    int32_t     * assignment;
    int         * n_iter_run;
};
SPARQ_API int sparq_llama_eval_kmeans(const struct kmeans_eval_args * args, char * err, size_t err_size);

// Microbenchmark: the clustering of a fixed prefix per layer with the keys already on the backend (as in a
// prepared KV cache): n_layers problems sets of H x P random rows of d components (a pool of normal values in
// tiles), each clustered by sparq_kmeans_run into n_clusters (n_iter iterations at most) after a warm-up
// layer. Out: layer_s [n_layers] wall seconds of each (normalising, iterations with their assignment
// read-backs, the table and its read-back), iters_out [n_layers] iterations run. 0 on success, else 1.
struct kmeans_bench_args {
    const char * device;   // NULL or "": the CPU
    int          n_threads;
    int64_t      d, P, H, n_clusters;
    int          n_iter, n_layers;
    double     * layer_s;
    int        * iters_out;
};
SPARQ_API int sparq_llama_bench_kmeans(const struct kmeans_bench_args * args, char * err, size_t err_size);

// Microbenchmark: ggml_centroid_attn vs ggml_flash_attn_ext (F32 precision) on the same random cache, one decode
// query (n_q = 1, one stream, all cells visible). The first n_prefix cells are clustered into n_clusters
// clusters of consecutive cells (random centroids); the threshold is set from the query's cluster scores so
// that about `keep` of the clustered cells are read (*kept_out: the fraction actually read). n_runs
// interleaved timed runs after a warm-up; times in microseconds. 0 on success, else 1 with a message in err.
struct centroid_bench_args {
    const char * device;   // NULL or "": the CPU
    int          n_threads;
    int          kv_type;
    int64_t      d, n_head, n_head_kv, n_kv, n_prefix, n_clusters;
    float        keep;
    int          n_runs;
    double     * centroid_us; // [n_runs]
    double     * flash_us;    // [n_runs]
    double     * kept_out;
};
SPARQ_API int sparq_llama_bench_centroid(const struct centroid_bench_args * args, char * err, size_t err_size);

// Microbenchmark: ggml_sparq_attn vs ggml_flash_attn_ext (F32 precision) on the same random tensors,
// one decode query per sequence (n_q = 1; n_seq streams of n_kv cells each, all visible), n_runs
// interleaved timed runs after a warm-up; times in microseconds. 0 on success, else 1 with a message in err.
struct sparq_bench_args {
    const char * device;   // NULL or "": the CPU
    int          n_threads;
    int          kv_type;
    int64_t      d, n_head, n_head_kv, n_kv;
    int          use_kt;   // pass the transposed key copy (the "kt" layout)
    int          n_runs;
    const struct ggml_sparq_params * params;
    double     * sparq_us; // [n_runs]
    double     * flash_us; // [n_runs]
    int64_t      n_seq;    // sequences (streams), each with its own n_kv cells; 0: 1
};
SPARQ_API int sparq_llama_bench_attn(const struct sparq_bench_args * args, char * err, size_t err_size);


// ---- SparQ in llama.cpp's decode path --------------------------------------------------------------
// Settings of a llama_context (new functions, no change to llama_context_params). Semantics of the
// selection: ggml-sparq.h and DESIGN.md. Zero/negative "auto" values are resolved per layer.
struct llama_context;

enum llama_sparq_mean {
    LLAMA_SPARQ_MEAN_AUTO = 0, // on for MHA layers (n_head == n_head_kv), off for GQA (the paper's finding)
    LLAMA_SPARQ_MEAN_ON   = 1,
    LLAMA_SPARQ_MEAN_OFF  = 2,
};

enum llama_sparq_policy {
    LLAMA_SPARQ_POLICY_SPARQ  = 0, // approximate scores from k1 query components (the paper)
    LLAMA_SPARQ_POLICY_EXACT  = 1, // top-k2 of the true scores (reads all of K: an oracle baseline)
    LLAMA_SPARQ_POLICY_WINDOW = 2, // sinks + most recent only (LM-Infinite / StreamingLLM baseline)
};

struct llama_sparq_params {
    bool    enabled;         // false: dense attention everywhere, no derived state kept
    int32_t k1;              // query components for the approximate scores; 0: head_dim/4
    int32_t k2;              // cells kept per KV head and query row (default 128)
    int32_t window;          // most recent cells always kept; -1: k2/4
    int32_t sinks;           // first cells always kept (default 0)
    int32_t mean;            // enum llama_sparq_mean
    int32_t policy;          // enum llama_sparq_policy
    float   sparse_v_thresh; // drop final weights below this (Sparse-V); 0: off
    bool    default_layout;  // keep no transposed K copy (step 2 gathers from row-major K; no extra memory)
    bool    prefill;         // multi-token batches select too (each row causally), not only decodes
    bool    swa;             // also sliding-window layers (dense by default: their read is bounded)
    int32_t min_n_kv;        // dense while the cache view holds fewer cells; -1: the measured default
};

// enabled = false, k1 = 0 (head_dim/4), k2 = 128, window = -1 (k2/4), sinks = 0, mean auto, policy sparq,
// sparse_v_thresh = 0, default_layout/prefill/swa = false, min_n_kv = -1.
SPARQ_API struct llama_sparq_params llama_sparq_default_params(void);

// Checks the values (and, when ctx is not NULL, that its model and context can honour them). Returns NULL
// when valid, otherwise a message saying what is wrong (thread-local storage, valid until the next call).
SPARQ_API const char * llama_sparq_check(const struct llama_context * ctx, const struct llama_sparq_params * params);

// Applies the settings; effective at the next decode. Enabling builds the derived KV state (the transposed K
// copy and the per-sequence V sums) from what the cache already holds; disabling frees it.
// Returns 0, or -1 with the reason logged and readable through llama_sparq_last_error().
SPARQ_API int32_t llama_set_sparq(struct llama_context * ctx, const struct llama_sparq_params * params);

// The settings the context holds (as given to llama_set_sparq).
SPARQ_API struct llama_sparq_params llama_get_sparq(const struct llama_context * ctx);

// The reason for the last failed llama_set_sparq on this thread ("" if none).
SPARQ_API const char * llama_sparq_last_error(void);

// Field-by-field equality (graph reuse compares settings with it).
static inline bool llama_sparq_params_equal(struct llama_sparq_params a, struct llama_sparq_params b) {
    return a.enabled == b.enabled && a.k1 == b.k1 && a.k2 == b.k2 && a.window == b.window &&
           a.sinks == b.sinks && a.mean == b.mean && a.policy == b.policy &&
           a.sparse_v_thresh == b.sparse_v_thresh && a.default_layout == b.default_layout &&
           a.prefill == b.prefill && a.swa == b.swa && a.min_n_kv == b.min_n_kv;
}


#ifdef __cplusplus
}
#endif
