// sparq-llama: the public C API of our additions to llama.cpp, exported from libllama. (The entry points for
// tests and microbenchmarks are in sparq-llama-testing.h.)
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

// ---- SparQ in llama.cpp's decode path --------------------------------------------------------------
// Settings of a llama_context (new functions, no change to llama_context_params). Semantics of the
// selection: ggml-sparq.h and docs/design.md, "SparQ: op semantics". Zero/negative "auto" values are
// resolved per layer.
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

// The index the approximate scores read: the transposed key copy (K^T), one row of cells per key component.
enum llama_sparq_index {
    LLAMA_SPARQ_INDEX_F16 = 0, // K^T in f16: 2 bytes a component
    LLAMA_SPARQ_INDEX_Q8  = 1, // K^T in int8, one f16 scale per component and 32 cells: 1.0625 bytes a component,
                               // so twice the components for the bytes of the f16 index
    LLAMA_SPARQ_INDEX_Q4  = 2, // every key component in 4 bits, one f16 scale per component and 32 cells (0.5625
                               // bytes a component), scored as integer dot products: k1 = head_dim, no component
                               // choice (select is unused), 6% more bytes than the q8 index at head_dim/2
};

// How the k1 components are chosen (ggml_sparq_select).
enum llama_sparq_select {
    LLAMA_SPARQ_SELECT_Q      = 0, // largest |q| summed over the GQA group (the paper)
    LLAMA_SPARQ_SELECT_QSIGMA = 1, // largest |q|·σ, σ the spread of the keys' component (kept per sequence and
                                   // KV head as running sums, like the V sums)
};

struct llama_sparq_params {
    bool    enabled;         // false: dense attention everywhere, no derived state kept
    int32_t k1;              // query components for the approximate scores; 0: about 1/8 of dense attention's
                             // bytes: head_dim/4 with the f16 index, head_dim/2 with the q8 index; the q4 index
                             // reads every component (k1 must be 0 with it)
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
    int32_t index;           // enum llama_sparq_index (default_layout keeps no index: it needs F16)
    int32_t select;          // enum llama_sparq_select
};

// What min_n_kv = -1 resolves to per layer: the measured cell counts from which SparQ beats dense attention, with the
// layer's KV in host memory, or on a GPU for MHA layers and for GQA layers (several query heads per KV head). The GPU
// values are the first depths at which llama-bench measured SparQ (q8 index, qsigma) at least as fast as dense flash
// attention end to end (H100, docs/performance.md): 12k with 32 KV heads (8k: 0.91x), 48k with 8 (32k: 0.90x).
#define LLAMA_SPARQ_MIN_N_KV_HOST    512
#define LLAMA_SPARQ_MIN_N_KV_GPU_MHA 12288
#define LLAMA_SPARQ_MIN_N_KV_GPU_GQA 49152

// enabled = false, k1 = 0 (by the index), k2 = 128, window = -1 (k2/4), sinks = 0, mean auto, policy sparq,
// sparse_v_thresh = 0, default_layout/prefill/swa = false, min_n_kv = -1, index q8, select qsigma
// (docs/quality.md: the selection agreement and task results behind them).
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

// One line saying what the context runs: SparQ on or off; when on, k1/k2/index/select, how many layers SparQ
// decodes and, per reason, how many stay dense, and the cached-cell count below which layers stay dense (per kind
// of layer where the measured defaults differ). Written like snprintf (NUL-terminated, truncated to size); returns
// the length of the whole line, or -1 when ctx is NULL.
SPARQ_API int32_t llama_sparq_summary(const struct llama_context * ctx, char * buf, size_t size);

// Logs that line at INFO through llama_log_set's callback (the bindings that show llama.cpp's log show it).
SPARQ_API void llama_sparq_log_summary(const struct llama_context * ctx);

// What the attention of one computed ubatch ran, per layer over the KV cache.
struct llama_sparq_run {
    int32_t n_tokens;          // tokens in the ubatch; 0: no ubatch recorded
    int32_t n_layers_sparq;    // attention layers that ran SparQ (ggml_sparq_attn)
    int32_t n_layers_centroid; // layers that ran centroid-sparse attention over a prepared prefix (ggml_centroid_attn)
    int32_t n_layers_dense;    // layers that ran dense attention
};

// What the last ubatch computed (llama_decode, llama_encode) that held a token of seq_id ran; seq_id = -1: the last
// ubatch computed, whatever its sequences. SparQ runs in decode ubatches (one token per sequence) once the cache view
// holds min_n_kv cells, so a token sampled from this sequence's newest logits was predicted with SparQ when
// n_layers_sparq > 0. All zero when no ubatch has held the sequence yet, or seq_id is out of [-1, n_seq_max).
SPARQ_API struct llama_sparq_run llama_sparq_last_run(const struct llama_context * ctx, int32_t seq_id);

// The names the flags and tools use for enum llama_sparq_index and enum llama_sparq_select ("f16", "q8", "q4";
// "q", "qsigma").
static inline const char * llama_sparq_index_name(int32_t index) {
    return index == LLAMA_SPARQ_INDEX_Q4 ? "q4" : index == LLAMA_SPARQ_INDEX_Q8 ? "q8" : "f16";
}

static inline const char * llama_sparq_select_name(int32_t select) {
    return select == LLAMA_SPARQ_SELECT_QSIGMA ? "qsigma" : "q";
}

// Field-by-field equality (graph reuse compares settings with it).
static inline bool llama_sparq_params_equal(struct llama_sparq_params a, struct llama_sparq_params b) {
    return a.enabled == b.enabled && a.k1 == b.k1 && a.k2 == b.k2 && a.window == b.window &&
           a.sinks == b.sinks && a.mean == b.mean && a.policy == b.policy &&
           a.sparse_v_thresh == b.sparse_v_thresh && a.default_layout == b.default_layout &&
           a.prefill == b.prefill && a.swa == b.swa && a.min_n_kv == b.min_n_kv && a.index == b.index &&
           a.select == b.select;
}



// ---- Centroid-sparse ("Squeezed") attention over a prepared fixed prefix ---------------------------------
// A context holds at most one prepared prefix: positions [0, n_prefix) of one sequence. Preparing clusters the
// prefix's keys per layer and KV head (spherical k-means, on the backend that holds the layer's KV), except the
// prefix's last n_calib tokens, which stay unclustered (always read exactly), like every cell after the prefix; their
// queries calibrate the two-level rule's coarse threshold. Decodes and prompt batches then read a prefix key only
// when its cluster is kept: each query row its best clusters up to keep of the clustered keys (ggml_centroid_attn;
// semantics in ggml-centroid.h). Other sequences that share the
// prefix's cells (llama_memory_seq_cp within one stream, e.g. a unified cache) read it the same way. Anything that
// changes the clustered cells (their removal by every sequence that holds them, K-shift, clear, a state load of the
// whole cache or of a sequence that alone holds some of them) drops the prepared prefix with one log line; seq_rm
// after the prefix (a new question) keeps it. Token ids are int32_t (llama_token), sequences int32_t.

// k-means' initial centroids (sparq_llama.reference_squeeze.kmeans_cosine): the keys at evenly spaced positions, or
// k-means++ seeding (each next seed drawn with probability proportional to its squared distance from the seeds so
// far, in rounds of max(64, (n - 1) / 16) draws, by a counter-based generator: deterministic), which gives rare
// keys clusters of their own.
enum llama_squeeze_init {
    LLAMA_SQUEEZE_INIT_EVEN = 0,
    LLAMA_SQUEEZE_INIT_KPP  = 1,
};

struct llama_squeeze_params {
    float   centroids;         // fine clusters as a fraction of the clustered prefix (default 0.1: on SmolLM2
                               // at keep 0.1 the smallest fraction measured whose retrieval reaches 95% of
                               // dense's; docs/quality.md)
    float   keep;              // fraction of the clustered prefix read per query row (its best clusters up to
                               // that budget), in (0, 1] (0.1)
    int32_t levels;            // 1, or 2: coarse clusters (centroids_coarse) prune before the fine ones
    float   centroids_coarse;  // levels = 2: coarse clusters as a fraction of the clustered prefix (0.01)
    float   keep_coarse;       // levels = 2: kept fraction at the coarse level; 0: min(1, 2*keep)
    int32_t n_calib;           // calibration tokens at the prefix's end (default 100; at most n_prefix/2)
    int32_t n_iter;            // k-means iterations at most (default 8; stops early when nothing moves)
    int32_t group;             // enum ggml_centroid_group: a GQA group keeps a cluster by the max (0) or mean (1)
    float   var_weight;        // the kept rule's variance term (ggml-centroid.h), >= 0; 0: the paper's mean rule
                               // (default 1, the Gaussian value, chosen on a held-out example set:
                               // docs/quality.md)
    int32_t init;              // enum llama_squeeze_init: k-means' initial centroids
    bool  (*progress_callback)(float progress, void * user_data); // NULL: none; returning false cancels
    void *  progress_callback_user_data;
};

// centroids 0.1, keep 0.1, levels 1, centroids_coarse 0.01, keep_coarse 0, n_calib 100, n_iter 8, group max,
// var_weight 1.
SPARQ_API struct llama_squeeze_params llama_squeeze_default_params(void);

// NULL when the values are valid, otherwise what is wrong (thread-local storage, valid until the next call).
SPARQ_API const char * llama_squeeze_check(const struct llama_squeeze_params * params);

// Prepares the prefix tokens[0, n_prefix) of seq_id. The cache must hold exactly those positions of the sequence
// (evaluate the prefix first, nothing after it), or exactly its first n_prefix - llama_squeeze_n_calib(params,
// n_prefix) ones: the last n_calib tokens are (decoded again, or) decoded while their queries are captured. The
// second way is needed where the cache cannot decode them again as they were: a sliding-window layers' cache that
// keeps only its window (swa_full off) and has already dropped positions those tokens attend to, which fails with that
// reason. Afterwards the cache holds the prefix and the last token's logits. Returns 0, or -1 with the reason logged
// and in llama_squeeze_last_error() (without a prepared prefix; after a failed decode the cache may lack the tail).
SPARQ_API int32_t llama_squeeze_prepare(struct llama_context * ctx, int32_t seq_id, const int32_t * tokens,
                                        int32_t n_prefix, const struct llama_squeeze_params * params);

// The prefix's calibration tokens (its last ones, never clustered) that llama_squeeze_prepare takes for n_prefix
// tokens: min(params->n_calib, n_prefix / 2).
SPARQ_API int32_t llama_squeeze_n_calib(const struct llama_squeeze_params * params, int32_t n_prefix);

// Writes the prepared prefix (clusters, assignments by position, settings, coarse threshold, prefix tokens, calibration queries) to a sidecar file
// with a format version, the model's fingerprint and each part's checksum. Save the KV state itself with
// llama_state_seq_save_file; llama_squeeze_save_files saves both, the sidecar then recording the state's checksums.
SPARQ_API int32_t llama_squeeze_save(struct llama_context * ctx, const char * path);

// Reads a sidecar written by llama_squeeze_save for the same model into seq_id, whose cells must already hold
// the prefix (llama_state_seq_load_file first). tokens (may be NULL) are compared with the saved prefix tokens
// (n_tokens >= the prefix length; only the prefix is compared). A version, model, token or checksum mismatch fails
// clearly, with the prepared prefix unchanged.
SPARQ_API int32_t llama_squeeze_load(struct llama_context * ctx, int32_t seq_id, const char * path,
                                     const int32_t * tokens, int32_t n_tokens);

// Loads a sequence state file written by llama_state_seq_save_file (the prefix's KV state, next to its sidecar) into
// seq_id, as llama_state_seq_load_file does, but reads the file's layout first: a file that does not read as a state
// of this context's KV cache to its end fails here (llama.cpp's loader aborts on one cut short), and a state saved from
// a cache of one stream loads into a context of one stream per sequence (-np N without a unified cache). Memories
// other than KV caches are passed to llama_state_seq_load_file unchecked. Returns 0 with the tokens in tokens_out
// (*n_token_out of them), or -1 with the reason in llama_squeeze_last_error(); seq_id is emptied first.
SPARQ_API int32_t llama_squeeze_load_state_file(struct llama_context * ctx, int32_t seq_id, const char * path,
                                                int32_t * tokens_out, size_t n_token_capacity, size_t * n_token_out);

// Saves a prepared prefix as a pair of files: the KV state of its sequence (llama_state_seq_save_file with the prefix's
// tokens; remove what follows the prefix first) to state_path, then its sidecar to sidecar_path, which records the
// state file's size and the checksums of its parts besides its own parts' checksums. Returns 0, or -1 with the
// reason in llama_squeeze_last_error().
SPARQ_API int32_t llama_squeeze_save_files(struct llama_context * ctx, const char * state_path, const char * sidecar_path);

// Loads a pair saved by llama_squeeze_save_files into seq_id: both files are read and verified first (the sidecar's
// parts against their checksums, the model's fingerprint and cache layout, the KV state against what the sidecar
// records: its tokens, size and parts' checksums); any mismatch fails with the file and the part named and leaves the
// context as it was. Then the KV state is loaded as llama_squeeze_load_state_file does (seq_id emptied first) and the
// prefix installed. A sidecar of an older format (no checksums) loads with a warning. Returns 0 with the tokens in
// tokens_out (*n_token_out of them), or -1 with the reason in llama_squeeze_last_error().
SPARQ_API int32_t llama_squeeze_load_files(struct llama_context * ctx, int32_t seq_id, const char * state_path,
                                           const char * sidecar_path, int32_t * tokens_out, size_t n_token_capacity,
                                           size_t * n_token_out);

// A new keep (and keep_coarse, two levels; 0: min(1, 2*keep)) for the prepared prefix, with the same clusters, so the
// result equals preparing at that keep: the op's per-row budget takes the new keep; two levels calibrate the coarse
// threshold again on the calibration queries kept since preparing (or loaded from a sidecar of version 2 or later).
// No decode, no clustering. Returns 0, or -1 with the reason (no prepared prefix, a value out of range, a two-level
// prefix loaded from a version-1 sidecar) in llama_squeeze_last_error(); on failure the prefix is unchanged.
SPARQ_API int32_t llama_squeeze_recalibrate(struct llama_context * ctx, float keep, float keep_coarse);

// Drops the prepared prefix (dense attention over it again).
SPARQ_API void llama_squeeze_clear(struct llama_context * ctx);

// How a ubatch in which a sequence has several tokens (a question's prefill) attends to the prepared prefix. Decodes
// (one token per sequence) always read the kept clusters.
enum llama_squeeze_prefill {
    LLAMA_SQUEEZE_PREFILL_AUTO   = 0,  // sparse where the layer's KV is in host memory, dense where it is on a GPU: there
                                       // each row reads its own clusters, slower than flash attention's single pass
                                       // over the KV for all rows (docs/squeeze.md)
    LLAMA_SQUEEZE_PREFILL_SPARSE = 1,  // every row reads its kept clusters (and the rest of the cache exactly)
    LLAMA_SQUEEZE_PREFILL_DENSE  = 2,  // dense attention over the whole cache, the prefix included (exact)
};

// Sets the prepared prefix's prefill mode (preparing or loading a prefix starts at AUTO). Returns 0, or -1 with the
// reason (no prepared prefix, an unknown mode) in llama_squeeze_last_error().
SPARQ_API int32_t llama_squeeze_set_prefill(struct llama_context * ctx, enum llama_squeeze_prefill mode);

struct llama_squeeze_info {
    bool    prepared;          // a prefix is prepared and valid
    int32_t seq_id;
    int32_t n_prefix;          // tokens in the prefix
    int32_t n_clustered;       // of them clustered (the rest are the calibration tail, read exactly)
    int32_t n_layers;          // layers decoded with centroid attention (others stay dense, see the log)
    int32_t levels;
    float   keep;              // the fine level's budget: each row reads its best clusters up to keep of the clustered cells
    float   threshold_coarse;  // levels = 2: the calibrated coarse threshold
    float   kept_calib;        // levels = 2: mean share of the clustered cells under kept coarse clusters on the
                               // calibration queries (1 with one level)
    int32_t prefill;           // enum llama_squeeze_prefill
    float   var_weight;        // the kept rule's variance term (0: the mean rule, as sidecars before version 3)
};
SPARQ_API struct llama_squeeze_info llama_squeeze_get_info(const struct llama_context * ctx);

// Whether seq_id reads the prepared prefix sparsely: it holds every clustered cell of the prefix, in the prefix's
// cache stream (the preparing sequence, or one that shares its cells through llama_memory_seq_cp in that stream) or in
// a stream that a cross-stream llama_memory_seq_cp filled from one that held it (one stream per sequence: the copy
// holds the prefix's keys in the same cells). false when nothing is prepared.
SPARQ_API bool llama_squeeze_seq_sparse(const struct llama_context * ctx, int32_t seq_id);

// The reason for the last failed llama_squeeze_* call on this thread ("" if none).
SPARQ_API const char * llama_squeeze_last_error(void);

#ifdef __cplusplus
}
#endif
