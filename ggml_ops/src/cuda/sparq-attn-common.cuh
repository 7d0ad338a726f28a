// Shared device code of the CUDA SparQ op (ggml_sparq_attn): the kernels' sizes, the op's arguments and scratch, row
// addressing, loads, block-wide reductions, and the instrumentation of the debugging build. The op's files:
//   sparq-attn.cu                  dispatch: host code, launches, the choice of the selection kernel
//   sparq-attn-common.cuh          this file
//   sparq-attn-query.cuh           kernel Q (I1, scaled query components)
//   sparq-attn-score.cuh           kernel A (approximate scores)
//   sparq-attn-select.cuh          kernels P, B, S (sampled threshold, sweep, exact selection)
//   sparq-attn-select-cluster.cuh  kernel PBS (P, B and S over a thread-block cluster)
//   sparq-attn-select-bound.cuh    kernel BS (one block per row, scoring the cells that per-block bounds keep)
//   sparq-attn-values.cuh          kernel LV (exact logits over I2, softmax, Sparse-V, V gather, mean)
// The headers are included by sparq-attn.cu only (one translation unit; the anonymous namespace is its own).
// Structure and reasons: docs/design.md, "CUDA kernels".
#pragma once

#include "attn-cuda-common.cuh"

#include "ggml-sparq.h"

// Kernel PBS needs thread-block clusters: the CUDA 12 runtime and device code for sm_90 or later. Other builds (older
// toolkits, HIP, MUSA) run kernels P, B and S.
#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA) && CUDART_VERSION >= 12000
#    define SPARQ_PBS_BUILT 1
#    include <cooperative_groups.h>
#else
#    define SPARQ_PBS_BUILT 0
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using namespace attn_cuda;  // pdl_wait, to_f32, load8, load8_row

// Kernel A's blocks are 4 warps, a chunk 1024 cells: with Llama-3 heads a model's 32k cache (33024 cells, 8 rows)
// made 136 blocks of 8 warps for 132 SMs, and the 4 SMs that ran two took the kernel's time; 264 blocks of 4 warps
// spread evenly (its loop alone, H100: 22.8 -> 16.8 us cold at 33024 cells; with Llama-2 heads, and at 131072
// cells, within 0.5 us: bench/results/cuda_kernel_a_loop.json; llama-bench, Llama-3 shape at 32k: 0.94x -> 0.99x
// dense, cuda_e2e.json). Kernel B's sweep takes kernel A's chunks (A_CHUNK == B_CHUNK), hence its 4 cells a thread.
constexpr int      A_THREADS   = 128;
constexpr int      A_CELLS     = 8;                      // cells per thread: one 16-byte load of f16 K^T
constexpr int64_t  A_CHUNK     = A_THREADS * A_CELLS;
constexpr int      A_WARPS     = A_THREADS / WARP_SIZE;
constexpr int      A_SM_WARPS  = 16;                     // kernel A's warps an SM: a_min_blocks, a_head_groups' wave
constexpr int      Q_THREADS   = 256;                    // kernels Q and P: one block per row
constexpr int      B_THREADS   = 256;
constexpr int      B_CELLS     = 4;                      // cells per thread in kernel B's sweep (lane + 32u)
constexpr int64_t  B_CHUNK     = B_THREADS * B_CELLS;
constexpr int      MAX_G       = 64;                     // query heads per KV head (row statistics in shared memory)
constexpr int      MAX_HEAD_DIM = 1024;
constexpr uint16_t F16_NEG_INF = 0xFC00;
constexpr int64_t  WAVE_BYTES  = int64_t(256) << 20;     // scratch budget of one wave of rows
constexpr int      N_CTR       = 8;                      // per-row counters (see counter)
static_assert(A_THREADS % WARP_SIZE == 0 && A_WARPS <= WARP_SIZE, "block reductions: the warps' results fit one warp");
static_assert(A_SM_WARPS % A_WARPS == 0 && (3*A_SM_WARPS/2) % A_WARPS == 0, "kernel A's warps an SM are whole blocks");
static_assert(Q_THREADS % WARP_SIZE == 0 && Q_THREADS / WARP_SIZE <= WARP_SIZE, "block reductions as for kernel A");
static_assert(B_THREADS % WARP_SIZE == 0 && B_THREADS / WARP_SIZE <= WARP_SIZE, "block reductions as for kernel A");

// Programmatic dependent launch (Hopper; pdl_wait in attn-cuda-common.cuh): each kernel is launched dependent on its
// predecessor and waits before it reads or writes anything; its blocks launch as the predecessor's blocks exit. None
// of the op's kernels releases its successor early (pdl_release): with the early release the op took 9-14 us longer on
// an H100 (Llama-2 and Llama-3 heads, 8k and 32k cells; docs/performance.md), likely because the successor's waiting
// blocks held slots and scheduler work the running kernel still needed.

// ---- instrumentation of the debugging build -----------------------------------------------------------------
// Compiled only with -DSPARQ_CUDA_INSTRUMENT (sparq-attn.cu's header says how); without it the macros below are
// empty: no instrumentation code and no environment reads. With it, for kernel tuning:
#ifdef SPARQ_CUDA_INSTRUMENT
// Timeline of the op's kernels (SPARQ_CUDA_TIMELINE=1 in the environment): per kernel the
// %globaltimer of its first block's start, of the first block past pdl_wait, of the last warp's end and of the last
// block's start (how long the grid took to be placed: a late block ends the kernel late); after
// the chain a one-thread kernel prints them relative to the chain's start and resets them. It shows the chain as it
// runs under dependent launches, which ncu cannot (ncu serialises kernels and flushes caches between them).
enum tl_kernel { TL_Q = 0, TL_A, TL_P, TL_B, TL_S, TL_PBS, TL_BS, TL_LV, TL_N };
__device__ unsigned long long g_tl[TL_N][4] = {
    { ~0ull, ~0ull, 0, 0 }, { ~0ull, ~0ull, 0, 0 }, { ~0ull, ~0ull, 0, 0 },
    { ~0ull, ~0ull, 0, 0 }, { ~0ull, ~0ull, 0, 0 }, { ~0ull, ~0ull, 0, 0 }, { ~0ull, ~0ull, 0, 0 },
    { ~0ull, ~0ull, 0, 0 } };
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
struct tl_scope {
    int k; bool on;
    __device__ tl_scope(int k_, bool on_) : k(k_), on(on_) {
        if (on && threadIdx.x == 0) {
            const unsigned long long t = global_ns();
            atomicMin(&g_tl[k][0], t);
            atomicMax(&g_tl[k][3], t);
        }
    }
    __device__ void waited() const {
        if (on && threadIdx.x == 0) { atomicMin(&g_tl[k][1], global_ns()); }
    }
    __device__ ~tl_scope() {  // on every return path; lane 0 of each warp
        if (on && threadIdx.x % WARP_SIZE == 0) { atomicMax(&g_tl[k][2], global_ns()); }
    }
};
// Kernel A marks only its end, explicitly: a tl_scope, or a mark before or after its wait, cost the instance of 8
// heads per pass ~100 bytes of spill (nvcc 13, sm_90), so its start shows as "-".
__device__ __forceinline__ void tl_end(int k, bool on) {
    if (on && threadIdx.x % WARP_SIZE == 0) { atomicMax(&g_tl[k][2], global_ns()); }
}
__global__ void sparq_timeline_dump(int64_t n_kv, int64_t n_rows) {
    static const char * const names[TL_N] = { "Q", "A", "P", "B", "S", "PBS", "BS", "LV" };
    unsigned long long t0 = ~0ull;
    for (int k = 0; k < TL_N; ++k) {
        t0 = min(t0, g_tl[k][0]);
    }
    printf("sparq timeline n_kv %lld rows %lld (us: start / past wait / end / last start):", (long long) n_kv,
           (long long) n_rows);
    for (int k = 0; k < TL_N; ++k) {
        if (g_tl[k][2] != 0) {
            printf(" %s", names[k]);
            for (int f = 0; f < 4; ++f) {
                const unsigned long long t = g_tl[k][f];
                if ((f < 2 && t == ~0ull) || (f == 3 && t == 0)) {
                    printf(" -");
                } else {
                    // signed: without kernel Q the earliest recorded start is after kernel A's end
                    printf(" %.2f", (double) (long long) (t - t0)*1e-3);
                }
            }
            printf(";");
        }
        g_tl[k][0] = ~0ull; g_tl[k][1] = ~0ull; g_tl[k][2] = 0; g_tl[k][3] = 0;
    }
    printf("\n");
}

// Phase timings of the tails (SPARQ_CUDA_TIMING=1 in the environment): thread 0 of row 0's block prints clock64()
// deltas between marks (kernels Q, P, S, PBS, BS and LV), and kernel S reports the rows that take its exact fallback.
#    define SPARQ_TL_SCOPE(k)      const tl_scope tl(k, a.timeline)
#    define SPARQ_TL_WAITED()      tl.waited()
#    define SPARQ_TL_END(k)        tl_end(k, a.timeline)
#    define SPARQ_TIMING_MARKS(n)  long long t_marks[n]
#    define SPARQ_TIMING_MARK(i) do { if (a.timing && threadIdx.x == 0) { t_marks[i] = clock64(); } } while (0)
#    define SPARQ_TIMING_PRINT(what, w, n) do { if (a.timing && threadIdx.x == 0 && (w) == 0) { \
        printf("%s:", what); for (int i_ = 1; i_ < (n); ++i_) printf(" %lld", t_marks[i_] - t_marks[i_ - 1]); \
        printf(" cycles\n"); } } while (0)
#else
#    define SPARQ_TL_SCOPE(k)
#    define SPARQ_TL_WAITED()
#    define SPARQ_TL_END(k)
#    define SPARQ_TIMING_MARKS(n)
#    define SPARQ_TIMING_MARK(i)           do { } while (0)
#    define SPARQ_TIMING_PRINT(what, w, n) do { } while (0)
#endif  // SPARQ_CUDA_INSTRUMENT

enum row_kind : int64_t { ROW_EMPTY = 0, ROW_DENSE = 1, ROW_SPARSE = 2 };
enum score_kind { SC_NONE = 0, SC_KT = 1, SC_GATHER = 2, SC_EXACT = 3, SC_Q4 = 4 };  // SC_Q4: the q4 index
enum counter { CTR_N_W = 0, CTR_N_S = 1, CTR_N_CAND = 2, CTR_N_F = 3 };
enum row_info { RI_KIND = 0, RI_N_VIS = 1, RI_W_LO = 2, RI_S_HI = 3, RI_THR = 4, RI_N_SEL = 5, RI_ZERO_FIRST = 6, N_RI = 8 };

struct sparq_args {
    const char * q; const char * k; const char * kt; const char * v;
    const char * mask; const char * vsum; const char * pos; const char * kstat;
    char * dst;
    ggml_type k_type, kt_type, v_type;  // read through dequant1 / dequant8 where a kernel runs for kv_any
    int64_t d, d_v, n_q, n_head, n_head_kv, ns, n_kv, group;
    size_t q_nb1, q_nb2, q_nb3;
    size_t k_nb1, k_nb2, k_nb3;
    size_t kt_nb1, kt_nb2, kt_nb3;
    size_t v_nb1, v_nb2, v_nb3;
    size_t m_nb1, m_nb3;  int64_t m_ns;
    size_t vs_nb1, vs_nb2, vs_nb3;
    size_t ks_nb1, ks_nb2, ks_nb3;
    size_t p_nb3;         int64_t p_ns;
    size_t o_nb1, o_nb2, o_nb3;
    ggml_sparq_op_params p;
    int32_t window, sinks, n_top;  // resolved for sparse rows: forced recent / first cells, cells to pick
    int32_t cell_bits;             // bits of a cell index in a candidate key
    int32_t n_chunks_a, n_chunks_b;
    int32_t a_head_groups;         // kernel A's blocks per chunk, each for G / a_head_groups of the row's heads
    int64_t n_words, cap;          // bitmap words per row, candidate-list capacity per row
    bool vec_kt, vec_kv, vec_logits;
    bool vec_kt_q8;                // a q8_0 index copied by warps (kernel A, q8_scores_warp)
    bool vec_mask, vec_pos;        // mask rows / positions allow 16-byte loads of 8 cells (kernel A)
    bool has_logits;               // kernel A writes logits (every policy but WINDOW without the mean)
    bool write_bmax;               // kernel A writes each thread's largest logit per head (kernel BS reads them)
#ifdef SPARQ_CUDA_INSTRUMENT
    bool timing;                   // SPARQ_CUDA_TIMING: print tail phase timings
    bool timeline;                 // SPARQ_CUDA_TIMELINE: print the kernels' start and end times (tl_scope)
#endif
};

struct sparq_scratch {
    float    * qs;       // [W][G][k1] scaled query components at I1 (kernel Q)
    int32_t  * i1;       // [W][k1]
    float    * logits;   // [W][G][n_kv] approximate (or exact) logits, -inf for hidden cells
    float    * bmax;     // [W][G][n_chunks_a*A_THREADS] the largest logit of each A_CELLS cells (kernel BS)
    uint32_t * bkeys;    // [W][n_chunks_a*A_CHUNK] kernel BS's keys of its kept cells, where shared memory is short
    int32_t  * bkept;    // [W][n_chunks_a*A_THREADS] kernel BS's kept blocks, likewise
    float    * cmax;     // [W][G][n_chunks_a]
    float    * csum;     // [W][G][n_chunks_a]
    int32_t  * cvis;     // [W][n_chunks_a][3]: visible cells, smallest and largest position
    float    * rstat;    // [W][2G]: max logit M_g, 1/Z_g
    int64_t  * rinfo;    // [W][N_RI]
    uint32_t * counters; // [W][N_CTR], zeroed by kernel P
    uint32_t * bitmap;   // [W][n_words]: I2
    uint64_t * cand;     // [W][cap]
    int32_t  * forced;   // [W][k2]: the forced cells of sparse rows, unordered (kernel B, bucket_sel)
    int32_t  * i2;       // [W][k2]: I2 in cell order (kernel S)
    float    * alpha;    // [W][G]: approximate probability mass of I2 (kernel S)
};

// ---- loads -----------------------------------------------------------------------------------------

// 8 consecutive values kept as loaded (16 bytes of f16/bf16, 32 of f32) and converted where they are used:
// kernel A keeps many rows in flight and so wants the loaded form, the smallest one.
template <typename T> struct raw8 { uint4 u; };
template <> struct raw8<float> { float4 a, b; };
__device__ __forceinline__ void load_raw8(const half * p, raw8<half> & r) { r.u = *(const uint4 *) p; }
__device__ __forceinline__ void load_raw8(const nv_bfloat16 * p, raw8<nv_bfloat16> & r) { r.u = *(const uint4 *) p; }
__device__ __forceinline__ void load_raw8(const float * p, raw8<float> & r) {
    r.a = ((const float4 *) p)[0]; r.b = ((const float4 *) p)[1];
}
__device__ __forceinline__ float raw8_at(const raw8<half> & r, int i) {
    const half2 h = ((const half2 *) &r.u)[i / 2];
    return i % 2 ? __high2float(h) : __low2float(h);
}
__device__ __forceinline__ float raw8_at(const raw8<nv_bfloat16> & r, int i) {
    const uint32_t w = ((const uint32_t *) &r.u)[i / 2];
    return __uint_as_float(i % 2 ? w & 0xFFFF0000u : w << 16);
}
__device__ __forceinline__ float raw8_at(const raw8<float> & r, int i) {
    return i < 4 ? ((const float *) &r.a)[i] : ((const float *) &r.b)[i - 4];
}

// ---- K and V of quantized or mixed types ---------------------------------------------------------------
// The kernels that read K or V (A's gather and exact scores, kernel Q's key statistics, LV) run for kv_any where K
// and V are not one float type: a quantized type (ggml's blocks of 32 values) or two different types. Their types
// are then run-time values of the op (the same over the grid: a uniform branch per load). Each value is
// dequantized as ggml defines its format (ggml-quants.c, dequantize_row_*), in the same float operations: the
// product of the integer and the scale, then the minimum added as a separate rounding (no fused multiply-add), so
// the values equal the CPU kernel's bit for bit.
struct kv_any {};
template <> struct raw8<kv_any> { float f[8]; };
__device__ __forceinline__ float raw8_at(const raw8<kv_any> & r, int i) { return r.f[i]; }

__device__ __forceinline__ bool is_quantized(ggml_type t) {
    return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
}

// 8 bytes / 4 bytes from a 2-byte aligned address: the blocks are 18 to 34 bytes long, so their values sit at even
// offsets only
__device__ __forceinline__ uint2 bytes8_at(const uint8_t * p) {
    const uint16_t * h = (const uint16_t *) p;
    return make_uint2(h[0] | (uint32_t) h[1] << 16, h[2] | (uint32_t) h[3] << 16);
}
__device__ __forceinline__ uint32_t bytes4_at(const uint8_t * p) {
    const uint16_t * h = (const uint16_t *) p;
    return h[0] | (uint32_t) h[1] << 16;
}
__device__ __forceinline__ int byte_of(const uint2 & b, int e) { return (int) (((e < 4 ? b.x : b.y) >> (8*(e % 4))) & 0xFF); }

// Values [e0, e0 + 8) of a row of a quantized type: e0 a multiple of 8, so they lie in one block (o = e0 % 32 within
// it). 4-bit types keep values j and j + 16 in the low and high nibble of byte j; 5-bit types add bit j of qh.
__device__ __forceinline__ void dequant8_quant(const char * row, ggml_type type, int64_t e0, float (&x)[8]) {
    static_assert(QK8_0 == 32 && QK4_0 == 32 && QK4_1 == 32 && QK5_0 == 32 && QK5_1 == 32, "blocks of 32 values");
    const int64_t ib = e0 / 32;
    const int o = (int) (e0 % 32), shift = o < 16 ? 0 : 4;
    switch (type) {
        case GGML_TYPE_Q8_0: {
            const block_q8_0 * b = (const block_q8_0 *) row + ib;
            const float d = __half2float(b->d);
            const uint2 q = bytes8_at((const uint8_t *) b->qs + o);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                x[e] = __fmul_rn((float) (int8_t) byte_of(q, e), d);
            }
        } break;
        case GGML_TYPE_Q4_0: {
            const block_q4_0 * b = (const block_q4_0 *) row + ib;
            const float d = __half2float(b->d);
            const uint2 q = bytes8_at(b->qs + o % 16);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                x[e] = __fmul_rn((float) (((byte_of(q, e) >> shift) & 0xF) - 8), d);
            }
        } break;
        case GGML_TYPE_Q4_1: {
            const block_q4_1 * b = (const block_q4_1 *) row + ib;
            const float d = __low2float(b->dm), m = __high2float(b->dm);
            const uint2 q = bytes8_at(b->qs + o % 16);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                x[e] = __fadd_rn(__fmul_rn((float) ((byte_of(q, e) >> shift) & 0xF), d), m);
            }
        } break;
        case GGML_TYPE_Q5_0: {
            const block_q5_0 * b = (const block_q5_0 *) row + ib;
            const float d = __half2float(b->d);
            const uint32_t qh = bytes4_at(b->qh);
            const uint2 q = bytes8_at(b->qs + o % 16);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int hi = (int) ((qh >> (o + e)) & 1) << 4;
                x[e] = __fmul_rn((float) ((((byte_of(q, e) >> shift) & 0xF) | hi) - 16), d);
            }
        } break;
        default: {  // GGML_TYPE_Q5_1
            const block_q5_1 * b = (const block_q5_1 *) row + ib;
            const float d = __low2float(b->dm), m = __high2float(b->dm);
            const uint32_t qh = bytes4_at(b->qh);
            const uint2 q = bytes8_at(b->qs + o % 16);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int hi = (int) ((qh >> (o + e)) & 1) << 4;
                x[e] = __fadd_rn(__fmul_rn((float) (((byte_of(q, e) >> shift) & 0xF) | hi), d), m);
            }
        } break;
    }
}

// Value e of a row of any K/V type.
__device__ __forceinline__ float dequant1(const char * row, ggml_type type, int64_t e) {
    switch (type) {
        case GGML_TYPE_F32:  return ((const float *) row)[e];
        case GGML_TYPE_F16:  return __half2float(((const half *) row)[e]);
        case GGML_TYPE_BF16: return __bfloat162float(((const nv_bfloat16 *) row)[e]);
        default: break;
    }
    const int64_t ib = e / 32;
    const int j = (int) (e % 32), jl = j % 16, shift = j < 16 ? 0 : 4;
    switch (type) {
        case GGML_TYPE_Q8_0: {
            const block_q8_0 * b = (const block_q8_0 *) row + ib;
            return __fmul_rn((float) b->qs[j], __half2float(b->d));
        }
        case GGML_TYPE_Q4_0: {
            const block_q4_0 * b = (const block_q4_0 *) row + ib;
            return __fmul_rn((float) (((b->qs[jl] >> shift) & 0xF) - 8), __half2float(b->d));
        }
        case GGML_TYPE_Q4_1: {
            const block_q4_1 * b = (const block_q4_1 *) row + ib;
            return __fadd_rn(__fmul_rn((float) ((b->qs[jl] >> shift) & 0xF), __low2float(b->dm)), __high2float(b->dm));
        }
        case GGML_TYPE_Q5_0: {
            const block_q5_0 * b = (const block_q5_0 *) row + ib;
            const int hi = (int) ((bytes4_at(b->qh) >> j) & 1) << 4;
            return __fmul_rn((float) ((((b->qs[jl] >> shift) & 0xF) | hi) - 16), __half2float(b->d));
        }
        default: {  // GGML_TYPE_Q5_1
            const block_q5_1 * b = (const block_q5_1 *) row + ib;
            const int hi = (int) ((bytes4_at(b->qh) >> j) & 1) << 4;
            return __fadd_rn(__fmul_rn((float) (((b->qs[jl] >> shift) & 0xF) | hi), __low2float(b->dm)), __high2float(b->dm));
        }
    }
}

// Values [e0, e0 + 8) of a row of n values of any K/V type (e0 a multiple of 8), zero past the end: float types one
// by one, quantized types (n a multiple of 32, so the 8 values exist or none does) from their block.
__device__ __forceinline__ void dequant8(const char * row, ggml_type type, int64_t e0, int64_t n, float (&x)[8]) {
    if (is_quantized(type)) {
        if (e0 < n) {
            dequant8_quant(row, type, e0, x);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                x[e] = 0.0f;
            }
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        x[e] = e0 + e < n ? dequant1(row, type, e0 + e) : 0.0f;
    }
}

// Elements [e0, e0 + 8) of a row of n values in their loaded form (load8_row's rules).
template <typename T>
__device__ __forceinline__ void load_raw8_row(const T * row, int64_t e0, int64_t n, bool vec, raw8<T> & r) {
    if (vec && e0 + 8 <= n) {
        load_raw8(row + e0, r);
        return;
    }
    T v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        v[e] = e0 + e < n ? row[e0 + e] : T(0.0f);
    }
    memcpy(&r, v, sizeof(r));
}

// ---- row addressing --------------------------------------------------------------------------------

struct row_coords {
    int64_t h, t, st;
};
__device__ __forceinline__ row_coords coords_of(const sparq_args & a, int64_t r) {  // heads fastest (as the CPU)
    return { r % a.n_head_kv, (r / a.n_head_kv) % a.n_q, r / (a.n_head_kv * a.n_q) };
}
__device__ __forceinline__ const float * q_row(const sparq_args & a, int64_t hq, const row_coords & c) {
    return (const float *) (a.q + c.t*a.q_nb1 + hq*a.q_nb2 + c.st*a.q_nb3);
}
__device__ __forceinline__ const uint16_t * mask_row(const sparq_args & a, const row_coords & c) {
    return a.mask ? (const uint16_t *) (a.mask + c.t*a.m_nb1 + (c.st % a.m_ns)*a.m_nb3) : nullptr;
}
__device__ __forceinline__ const int32_t * pos_row(const sparq_args & a, const row_coords & c) {
    return a.pos ? (const int32_t *) (a.pos + (c.st % a.p_ns)*a.p_nb3) : nullptr;
}
__device__ __forceinline__ bool visible(const uint16_t * m, int64_t j) { return !m || m[j] != F16_NEG_INF; }
__device__ __forceinline__ int64_t position(const int32_t * p, int64_t j) { return p ? p[j] : j; }

// The softcap's tanh in double: ggml-cuda builds with fast math, whose tanhf is the hardware approximation
// (relative error ~5e-4, far above the f32 reference tolerance).
__device__ __forceinline__ float logit_exact(const sparq_args & a, float dot) {
    float l = a.p.scale * dot;
    if (a.p.softcap > 0.0f) {
        l = a.p.softcap * (float) tanh((double) l / (double) a.p.softcap);
    }
    return l;
}

// ---- block-wide helpers ----------------------------------------------------------------------------

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int off = WARP_SIZE/2; off > 0; off >>= 1) {
        v = op(v, __shfl_xor_sync(0xFFFFFFFF, v, off));
    }
    return v;
}

// N values reduced over the warp at once, each exactly as warp_reduce does it (the same butterfly), with the N
// shuffles of a step in flight together: N chains of 5 dependent shuffles take about the time of one.
template <int N, typename T, typename Op>
__device__ __forceinline__ void warp_reduce_n(T (&v)[N], Op op) {
#pragma unroll
    for (int off = WARP_SIZE/2; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            v[i] = op(v[i], __shfl_xor_sync(0xFFFFFFFF, v[i], off));
        }
    }
}

// Reduction over the block in a fixed order (deterministic). red: 32 shared slots of T.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, T * red) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) {
        red[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < (int) (blockDim.x / WARP_SIZE) ? red[lane] : identity;
        v = warp_reduce(v, op);
        if (lane == 0) {
            red[0] = v;
        }
    }
    __syncthreads();
    return red[0];
}

struct op_max { template <typename T> __device__ T operator()(T x, T y) const { return x > y ? x : y; } };
struct op_min { template <typename T> __device__ T operator()(T x, T y) const { return x < y ? x : y; } };
struct op_add { template <typename T> __device__ T operator()(T x, T y) const { return x + y; } };

// Sum of s, minimum of lo and maximum of hi over the block in one pass (integers: order-free). red: 96 shared T.
template <typename T>
__device__ void block_sum_min_max(T & sum, T & lo, T & hi, T * red) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    sum = warp_reduce(sum, op_add());
    lo  = warp_reduce(lo, op_min());
    hi  = warp_reduce(hi, op_max());
    __syncthreads();
    if (lane == 0) {
        red[warp] = sum; red[32 + warp] = lo; red[64 + warp] = hi;
    }
    __syncthreads();
    sum = red[0]; lo = red[32]; hi = red[64];
    for (int i = 1; i < n_warps; ++i) {
        sum += red[i];
        lo = red[32 + i] < lo ? red[32 + i] : lo;
        hi = red[64 + i] > hi ? red[64 + i] : hi;
    }
    __syncthreads();
}

// Exclusive prefix sum over the block (fixed order); *total gets the sum. red: 32 shared ints.
static __device__ int block_exclusive_scan(int v, int * total, int * red) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    int incl = v;
#pragma unroll
    for (int off = 1; off < WARP_SIZE; off <<= 1) {
        const int y = __shfl_up_sync(0xFFFFFFFF, incl, off);
        incl += lane >= off ? y : 0;
    }
    __syncthreads();
    if (lane == WARP_SIZE - 1) {
        red[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        int x = lane < n_warps ? red[lane] : 0;
#pragma unroll
        for (int off = 1; off < WARP_SIZE; off <<= 1) {
            const int y = __shfl_up_sync(0xFFFFFFFF, x, off);
            x += lane >= off ? y : 0;
        }
        red[lane] = x;
    }
    __syncthreads();
    const int before = warp > 0 ? red[warp - 1] : 0;
    *total = red[n_warps - 1];
    __syncthreads();
    return before + incl - v;
}

}  // namespace
