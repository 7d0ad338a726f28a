// sparq-llama: the public C API of our additions to llama.cpp, exported from libllama.
// Functions only: llama.cpp's public structs are never changed (llama-cpp-python binds them by value).
#pragma once

#include <stddef.h>
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
};

// 0 on success; otherwise 1 with a message in err (never aborts on bad arguments).
SPARQ_API int sparq_llama_eval_sparq_attn(const struct sparq_eval_args * args, char * err, size_t err_size);

// Microbenchmark: ggml_sparq_attn vs ggml_flash_attn_ext (F32 precision) on the same random tensors,
// one decode query (n_q = 1, one stream, all cells visible), n_runs interleaved timed runs after a
// warm-up; times in microseconds. 0 on success, else 1 with a message in err.
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
};
SPARQ_API int sparq_llama_bench_attn(const struct sparq_bench_args * args, char * err, size_t err_size);

#ifdef __cplusplus
}
#endif
