// sparq-llama's testing and benchmarking entry points, exported from libllama next to the user API of
// sparq-llama.h: each runs one of our ops, the k-means or the threshold calibration once over host arrays (for
// the tests against the float64 references in sparq_llama.ops), or times one of them against flash attention
// (the microbenchmarks of bench/). Users of the C API do not need them; this header is not installed.
#pragma once

#include "sparq-llama.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_sparq_params;

// One evaluation of ggml_sparq_attn over host arrays, for tests and research (sparq_llama.ops).
// Arrays are C-contiguous in ggml order (ne0 fastest): q [ns][n_head][n_q][d] f32,
// k [ns][n_head_kv][n_kv][d] of k_type, kt [ns][n_head_kv][d][n_kt] of kt_type (or NULL; n_kt = n_kv, or n_kv
// rounded up to 32 for q8_0; i8, the q4 index: [ns][n_head_kv][n_kv/32 rounded up][18*d]), v [ns][n_head_kv][n_kv][d_v] of v_type (ggml_types: f32, f16, bf16, or q8_0, q4_0,
// q4_1, q5_0, q5_1 as ggml's blocks of each row), mask [mask_ns][n_q][n_kv] f16 0/-inf (or NULL),
// vsum [ns][n_q][n_head_kv][d_v + 1] f32 (or NULL), kstat [ns][n_q][n_head_kv][2d + 1] f32 (or NULL);
// out [ns][n_q][n_head][d_v] f32.
struct sparq_eval_args {
    const char * device;   // ggml device name ("CPU", "CUDA0"); NULL or "": the CPU
    int          n_threads;
    int          k_type, kt_type, v_type;
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
    const float * kstat;
};

// 0 on success; otherwise 1 with a message in err (never aborts on bad arguments).
SPARQ_API int sparq_llama_eval_sparq_attn(const struct sparq_eval_args * args, char * err, size_t err_size);

// One of a context's per-layer KV tensors copied to host as f32 (quantized types dequantized), for the tests of
// SparQ's derived KV state against the cache it derives from. layer il; what: 0 the cache's K
// [n_stream][kv_size][n_embd_k_gqa], 1 the index K^T [n_stream][n_embd_k_gqa][row_len] (the q4 index's
// values as it reads them back), 2 the V sums
// [n_seq_max][(d_v + 1)*n_head_kv], 3 the key statistics [n_seq_max][(2*d_k + 1)*n_head_kv], 4 the occupancy of
// the cells of layer il's cache [n_stream][kv_size] (1: the cell holds a token), 5 the cells each sequence holds
// in its stream [n_seq_max][kv_size] (1: it does). ne_out[0..2] gets the
// tensor's ne (fastest first); out may be NULL to ask for the shape only, else it holds n_out floats. Returns 0,
// or 1 with a message in err (SparQ off, a layer without that piece, out too small).
struct llama_context;
SPARQ_API int sparq_llama_read_kv_tensor(struct llama_context * ctx, int32_t il, int32_t what, float * out,
                                         size_t n_out, int64_t * ne_out, char * err, size_t err_size);

// What llama.cpp's memory breakdown (llama_get_memory_breakdown, which its parameter fitting reads) reports for a
// context, summed over every buffer type: out[0] the model's bytes, out[1] the context's (KV caches with SparQ's
// derived state), out[2] the compute buffers'. Returns 0, or 1 when ctx or out is NULL.
SPARQ_API int sparq_llama_memory_breakdown(const struct llama_context * ctx, size_t * out);

// One evaluation of ggml_sparq_vsum_rows (sparq_llama.ops.vsum_rows): table [n_seq][(d_v + 1)*n_head_kv] f32,
// v [n_tokens][n_head_kv][v_ld] f32 (the op sees the first d_v of each v_ld components: a strided view), idx [n_tokens]
// i32, v_type a ggml_type (f32, f16, bf16); out [n_tokens][(d_v + 1)*n_head_kv] f32.
struct vsum_rows_eval_args {
    const char * device;   // NULL or "": the CPU
    int          n_threads;
    int          v_type;
    int64_t      d_v, n_head_kv, n_tokens, n_seq, v_ld;
    const float * table;
    const float * v;
    const int32_t * idx;
    float       * out;
    float       * table_out;  // NULL, or [n_seq][width] f32: the table after the op (it writes the rows back)
};
SPARQ_API int sparq_llama_eval_vsum_rows(const struct vsum_rows_eval_args * args, char * err, size_t err_size);

// One evaluation of ggml_sparq_kstat_rows (sparq_llama.ops.kstat_rows): table [n_seq][(2*d + 1)*n_head_kv] f32, k
// [n_stream][kv_size][d*n_head_kv] of k_type (a KV cache type, as ggml's blocks: the cache's keys), cells [n_tokens]
// i32 (each token's row of k over all streams), idx [n_tokens] i32; out [n_tokens][(2*d + 1)*n_head_kv] f32.
struct kstat_rows_eval_args {
    const char * device;   // NULL or "": the CPU
    int          n_threads;
    int          k_type;
    int64_t      d, n_head_kv, n_tokens, n_seq, kv_size, n_stream;
    const float   * table;
    const void    * k;
    const int32_t * cells;
    const int32_t * idx;
    float         * out;
    float         * table_out;  // NULL, or [n_seq][width] f32: the table after the op (it writes the rows back)
};
SPARQ_API int sparq_llama_eval_kstat_rows(const struct kstat_rows_eval_args * args, char * err, size_t err_size);

// One evaluation of ggml_sparq_index_write (sparq_llama.ops.index_write): kt [n_stream][n_embd][row_len] of kt_type
// (f32, f16, bf16 or q8_0 as ggml's blocks: the index before the op; i8: the q4 index
// [n_stream][row_len/32][n_embd/head_dim][18*head_dim]), k [n_stream][kv_size][n_embd] of k_type (a KV
// cache type, as ggml's blocks), cells [B*n_blk*ns] i32 (B = 32 for q8_0 and q4, else 1), mask [B*n_blk*ns] f32 (or NULL),
// blk [ns][n_blk] i64, s0 as the op takes them; kt_out gets the index after the op (kt's size in bytes).
struct index_write_eval_args {
    const char * device;   // NULL or "": the CPU
    int          n_threads;
    int          kt_type, k_type;
    int64_t      n_embd, row_len, kv_size, n_stream, n_blk, ns;
    int32_t      s0;
    const void    * kt;
    const void    * k;
    const int32_t * cells;
    const float   * mask;
    const int64_t * blk;
    void          * kt_out;
    int64_t         head_dim;  // the q4 index's head dim (kt_type i8); unused otherwise
};
SPARQ_API int sparq_llama_eval_index_write(const struct index_write_eval_args * args, char * err, size_t err_size);

struct ggml_centroid_params;

// One evaluation of ggml_centroid_attn over host arrays (sparq_llama.ops.centroid_attn). Arrays are
// C-contiguous in ggml order: q, k, v and mask as for sparq_eval_args; cent [ns][n_head_kv][n_cent][table_width]
// f32 (components, the cluster size, then with table_width 2d + 1 the variances); cell [ns][n_head_kv][n_kv] i32
// (-1: not clustered); coarse [ns][n_head_kv][n_coarse][table_width] f32 and parent [ns][n_head_kv][n_cent] i32,
// both or neither (two levels);
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
    int64_t         table_width;  // d + 1, or 2d + 1 with the variances; 0: d + 1
};
SPARQ_API int sparq_llama_eval_centroid_attn(const struct centroid_eval_args * args, char * err, size_t err_size);

// Spherical k-means of H problems of P rows as ggml graphs on a backend (sparq_llama.ops.kmeans_cosine; the
// clustering of a fixed prefix for centroid-sparse attention). x [H][P][d] f32; table [H][n][2d + 1] f32 out
// (member means of the unnormalised rows, the size, the members' per-component variances about the mean);
// assignment [H][P] i32 out; *n_iter_run out; init: enum llama_squeeze_init (the initial centroids); center: cluster
// each problem's rows minus their mean row (as a fixed prefix's keys are); weights [H][d] or NULL: the (centred)
// rows compared are times these per-component weights. 0 on success; otherwise 1 with a message in err.
struct kmeans_eval_args {
    const char * device;   // NULL or "": the CPU
    int          n_threads;
    int64_t      d, P, H, n_clusters;
    int          n_iter;
    const float * x;
    float       * table;
    int32_t     * assignment;
    int         * n_iter_run;
    int          init;
    int          center;
    const float * weights;
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
    double     * phase_s;  // NULL, or [n_layers][3] out: setup (state, normalising, seeding), iterations, the table
                           // (seconds)
    int          init;     // enum llama_squeeze_init
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

// Microbenchmark: ggml_sparq_attn vs ggml_flash_attn_ext (F32 precision) on the same random tensors (select
// qsigma with key sums as a model keeps them),
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
    int          kt_type;  // the index's ggml_type (f16, q8_0, ..., i8: the q4 index); -1: kv_type
};
SPARQ_API int sparq_llama_bench_attn(const struct sparq_bench_args * args, char * err, size_t err_size);

// The coarse threshold calibration of llama_squeeze_prepare (two levels) over host arrays, for tests against the float64 reference
// (sparq_llama.reference_squeeze.calibrate_threshold). Per layer: q [n_layers][n_rows][n_head][d] f32 (the
// calibration queries), table [n_layers][n_head_kv][n_cent][table_width] (components, the size, with width 2d + 1
// the variances); two levels: coarse [n_layers][n_head_kv][n_coarse][table_width] and parent
// [n_layers][n_head_kv][n_cent], else NULL. var_weight: the kept rule's variance term (needs width 2d + 1).
// Out: *threshold_coarse (two levels; 0 with one) and *kept (the mean share of the clustered cells under the kept coarse
// clusters; 1 with one level). 0, or 1 with err.
struct squeeze_calib_args {
    int64_t d, n_head, n_head_kv, n_rows, n_layers, n_cent, n_coarse;
    const float   * q;
    const float   * table;
    const float   * coarse;
    const int32_t * parent;
    float   scale;
    int     group;        // enum ggml_centroid_group
    float   keep;
    float   keep_coarse;  // two levels: 0 -> min(1, 2*keep)
    int     n_threads;
    float * threshold_coarse;
    float * kept;
    int64_t table_width;  // d + 1 or 2d + 1; 0: d + 1
    float   var_weight;
};
SPARQ_API int sparq_llama_eval_squeeze_calibrate(const struct squeeze_calib_args * args, char * err, size_t err_size);

#ifdef __cplusplus
}
#endif
