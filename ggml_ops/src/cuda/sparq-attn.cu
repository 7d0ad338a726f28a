// CUDA kernel of ggml_sparq_attn. Semantics: ggml_ops/include/ggml-sparq.h and shared/DESIGN.md; the CPU
// kernel (ggml_ops/src/cpu/sparq-attn-cpu.cpp) is the reference for every detail (tie rules included).
//
// A row is (KV head h, query row t, stream s), as on the CPU; the query heads of h's group share the row's
// selection. Rows are processed in waves (scratch stays bounded for long prefill batches); per wave, six
// short kernels. Each kernel's grid is either one block per row (the serial steps) or is split along the
// sequence or over output slices, so that every SM works even with 8 KV heads:
//   Q. query (one block per row): I1 and the scaled query components at I1.
//   A. scores (grid: chunks of A_CHUNK cells x rows): the approximate logits of each chunk and the chunk's
//      softmax max/sum and visible-cell statistics.
//   P. prepare (one block per row): merges the chunk statistics (softmax normaliser, visible count,
//      position range) and sets a candidate threshold from a strided sample of the group score (one bucket
//      pass over the sample's keys), so that about 4x the needed cells pass it.
//   B. sweep (grid: chunks of B_CHUNK cells x rows): marks the row's forced cells (window and sinks, or every
//      visible cell of a dense row) in a bitmap whose words it owns, lists the forced cells of sparse rows, and
//      appends the cells whose group score passes the threshold to the row's candidate list.
//   S. select (one block per row): the exact top of the candidates by (score, cell) keys, equal scores going
//      to the lower cell (one bucket pass, the boundary bucket ranked pairwise; radix select where it is
//      large), I2 in cell order (from the lists for k2 <= LIST_MAX_K2, else out of the bitmap), alpha_g.
//   LV. logits and values (grid: output slices x heads, rows): exact logits of the head over I2, softmax,
//      Sparse-V cut, weighted sum of V, mean mix.
// On Hopper, where a few rows of up to 72k cells are all in flight at once (one decode step of one sequence), kernel
// PBS does P's, B's and S's work in one launch: a cluster of 8 blocks per row exchanging counts through distributed
// shared memory, the exact top by radix passes (see the kernel; pbs_cluster_for decides).
// One block per row would run the last steps as a serial chain of memory round trips (~45 us per step).
// When the sample misleads (too few or too many candidates) or positions are not distinct, kernel S
// falls back to exact selections over all cells: slower, same result. Launch sizes depend on shapes only
// (CUDA graphs stay on); no host round trip. History and measurements of each variant: bench/notes_cuda.md
// (v6 = the bucket selection, v6a, and LV, v6b; SPARQ_CUDA_RADIX_SELECT=1 selects as v5c did, for measuring).
#include "sparq-attn.cuh"
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

namespace {

using namespace attn_cuda;  // pdl_wait, pdl_release, to_f32, load8, load8_row

constexpr int      A_THREADS   = 256;
constexpr int      A_CELLS     = 8;                      // cells per thread: one 16-byte load of f16 K^T
constexpr int64_t  A_CHUNK     = A_THREADS * A_CELLS;
constexpr int      A_WARPS     = A_THREADS / WARP_SIZE;
// Kernel A: K^T rows in flight per thread (16 bytes of each for f16/bf16) and blocks per SM (the register
// budget: 64K / (256 * blocks) per thread; a_min_blocks below). For K^T, two blocks of 16 rows in flight beat
// three of 8 (bench/harness_a/NOTES.md, H100, Llama-2 heads, with the shorter prologue and epilogue: 39.2 ->
// 36.4 us at 32k, 65.3 -> 58.6 at 64k): half the DRAM round trips per block, and 2 blocks per SM make 1.94
// waves of the 32k grid (16 x 32 blocks) where 3 made 1.29, whose last 0.29 wave ran ~12 us alone at a
// fraction of the bandwidth. With 3-4 heads per pass (GQA, G = 4) 8 rows in flight fit 128 registers without spill
// but made Llama-3's kernel A slower (session 18: 24.7 -> 26.7 us at 33024 cells, 27.4 -> 31.1 at 65792), so 4 stay.
template <typename T, int NG> __host__ __device__ constexpr int a_unroll() {
    return (NG <= 2 ? 16 : 4) / (sizeof(T) == 4 ? 2 : 1);
}
constexpr int      B_THREADS   = 256;
constexpr int      B_CELLS     = 8;                      // cells per thread in kernel B's sweep (lane + 32u)
constexpr int64_t  B_CHUNK     = B_THREADS * B_CELLS;
// Kernel P's sample for the candidate threshold: at least SAMPLE cells (rows permitting), and at most SAMPLE_MAX,
// strided so that the threshold's rank in the sample is at least SAMPLE_RANK (sample_plan). The count of a row's
// cells above the sample's r-th key is ~ stride * Gamma(r): at rank 6 (a 64k row with a fixed 1024-cell sample)
// ~5e-4 of the rows fell below n_top and took kernel S's exact fallback over all cells (~2.3 ms each, ~1.2 ms per
// decode token of the Llama-2 shape at 64k; bench/notes_cuda.md, session 12); at rank 16 that is ~3e-9.
constexpr int      SAMPLE      = 1024;
constexpr int      SAMPLE_MAX  = 4096;
constexpr int      SAMPLE_RANK = 16;
constexpr int      MAX_G       = 64;                     // query heads per KV head (row statistics in shared memory)
constexpr int      MAX_HEAD_DIM = 1024;
constexpr uint16_t F16_NEG_INF = 0xFC00;
constexpr int64_t  WAVE_BYTES  = int64_t(256) << 20;     // scratch budget of one wave of rows
constexpr int      N_CTR       = 8;                      // per-row counters (see ctr_*)

// Programmatic dependent launch (Hopper; pdl_wait / pdl_release in attn-cuda-common.cuh): each kernel is
// launched while its predecessor still runs and waits before it reads or writes anything; the kernels of one
// or a few blocks per row also let their successor's blocks launch at once (pdl_release), which hides the
// launch latency between the six kernels. Kernel A releases once its blocks have passed their wait too: the
// release takes effect only when every block of A has released or exited, i.e. when A's last block has a slot,
// so kernel P's blocks never take a slot from a waiting block of A (SPARQ_CUDA_A_RELEASE_EXIT=1: release only
// at exit, as before session 15, for A/B runs).

#ifdef SPARQ_CUDA_INSTRUMENT
// Timeline of the op's kernels (SPARQ_CUDA_TIMELINE=1 in the environment; for kernel tuning only): per kernel the
// %globaltimer of its first block's start, of the first block past pdl_wait, and of the last warp's end; after
// the chain a one-thread kernel prints them relative to the chain's start and resets them. It shows the chain as it
// runs under dependent launches, which ncu cannot (ncu serialises kernels and flushes caches between them).
enum tl_kernel { TL_Q = 0, TL_A, TL_P, TL_B, TL_S, TL_PBS, TL_LV, TL_N };
__device__ unsigned long long g_tl[TL_N][3] = {
    { ~0ull, ~0ull, 0 }, { ~0ull, ~0ull, 0 }, { ~0ull, ~0ull, 0 },
    { ~0ull, ~0ull, 0 }, { ~0ull, ~0ull, 0 }, { ~0ull, ~0ull, 0 }, { ~0ull, ~0ull, 0 } };
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
struct tl_scope {
    int k; bool on;
    __device__ tl_scope(int k_, bool on_) : k(k_), on(on_) {
        if (on && threadIdx.x == 0) { atomicMin(&g_tl[k][0], global_ns()); }
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
    static const char * const names[TL_N] = { "Q", "A", "P", "B", "S", "PBS", "LV" };
    unsigned long long t0 = ~0ull;
    for (int k = 0; k < TL_N; ++k) {
        t0 = min(t0, g_tl[k][0]);
    }
    printf("sparq timeline n_kv %lld rows %lld (us: start / past wait / end):", (long long) n_kv, (long long) n_rows);
    for (int k = 0; k < TL_N; ++k) {
        if (g_tl[k][2] != 0) {
            printf(" %s", names[k]);
            for (int f = 0; f < 3; ++f) {
                const unsigned long long t = g_tl[k][f];
                if (f < 2 && t == ~0ull) {
                    printf(" -");
                } else {
                    printf(" %.2f", (double) (t - t0)*1e-3);
                }
            }
            printf(";");
        }
        g_tl[k][0] = ~0ull; g_tl[k][1] = ~0ull; g_tl[k][2] = 0;
    }
    printf("\n");
}

// Phase timings of the tails (SPARQ_CUDA_TIMING=1 in the environment): thread 0 of row 0's last block prints
// clock64() deltas between marks; for kernel tuning only.

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
enum score_kind { SC_NONE = 0, SC_KT = 1, SC_GATHER = 2, SC_EXACT = 3 };
// Kernel A's blocks per SM: 2 for K^T (above) and for 4-8 heads per pass; the gather and exact scores of 1-2
// heads keep 3 (no rows in flight to trade for it: more blocks hide their per-cell round trips).
template <int POL, int NG> constexpr int a_min_blocks() { return POL == SC_KT || NG > 2 ? 2 : 3; }
enum counter { CTR_N_W = 0, CTR_N_S = 1, CTR_N_CAND = 2, CTR_N_F = 3 };
enum row_info { RI_KIND = 0, RI_N_VIS = 1, RI_W_LO = 2, RI_S_HI = 3, RI_THR = 4, RI_N_SEL = 5, RI_ZERO_FIRST = 6, N_RI = 8 };

struct sparq_args {
    const char * q; const char * k; const char * kt; const char * v;
    const char * mask; const char * vsum; const char * pos;
    char * dst;
    int64_t d, d_v, n_q, n_head, n_head_kv, ns, n_kv, group;
    size_t q_nb1, q_nb2, q_nb3;
    size_t k_nb1, k_nb2, k_nb3;
    size_t kt_nb1, kt_nb2, kt_nb3;
    size_t v_nb1, v_nb2, v_nb3;
    size_t m_nb1, m_nb3;  int64_t m_ns;
    size_t vs_nb1, vs_nb2, vs_nb3;
    size_t p_nb3;         int64_t p_ns;
    size_t o_nb1, o_nb2, o_nb3;
    ggml_sparq_op_params p;
    int32_t window, sinks, n_top;  // resolved for sparse rows: forced recent / first cells, cells to pick
    int32_t cell_bits;             // bits of a cell index in a candidate key
    int32_t n_chunks_a, n_chunks_b;
    int64_t n_words, cap;          // bitmap words per row, candidate-list capacity per row
    bool vec_kt, vec_kv, vec_logits;
    bool vec_mask, vec_pos;        // mask rows / positions allow 16-byte loads of 8 cells (kernel A)
    bool has_logits;               // kernel A writes logits (every policy but WINDOW without the mean)
#ifdef SPARQ_CUDA_INSTRUMENT
    bool timing;                   // SPARQ_CUDA_TIMING: print tail phase timings
    bool timeline;                 // SPARQ_CUDA_TIMELINE: print the kernels' start and end times (tl_scope)
#endif
};

struct sparq_scratch {
    float    * qs;       // [W][G][k1] scaled query components at I1 (kernel Q)
    int32_t  * i1;       // [W][k1]
    float    * logits;   // [W][G][n_kv] approximate (or exact) logits, -inf for hidden cells
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

// Kernel A's K^T loads: each row is read once per decode step, so they skip L1 and leave L2 first
// (evict-first policy), which keeps the logits that kernels P and B read next in L2. Plain loads before sm_80.
__device__ __forceinline__ uint64_t l2_evict_first() {
#if __CUDA_ARCH__ >= 800
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
#else
    return 0;
#endif
}
__device__ __forceinline__ uint4 load16_stream(const void * p, uint64_t pol) {
    uint4 r;
#if __CUDA_ARCH__ >= 800
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(pol));
#else
    GGML_UNUSED(pol);
    r = *(const uint4 *) p;
#endif
    return r;
}
__device__ __forceinline__ void load_raw8_stream(const half * p, raw8<half> & r, uint64_t pol) { r.u = load16_stream(p, pol); }
__device__ __forceinline__ void load_raw8_stream(const nv_bfloat16 * p, raw8<nv_bfloat16> & r, uint64_t pol) {
    r.u = load16_stream(p, pol);
}
__device__ __forceinline__ void load_raw8_stream(const float * p, raw8<float> & r, uint64_t pol) {
    const uint4 a = load16_stream(p, pol), b = load16_stream(p + 4, pol);
    r.a = make_float4(__uint_as_float(a.x), __uint_as_float(a.y), __uint_as_float(a.z), __uint_as_float(a.w));
    r.b = make_float4(__uint_as_float(b.x), __uint_as_float(b.y), __uint_as_float(b.z), __uint_as_float(b.w));
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

// Kernel A: the mask and positions of a thread's cells [j0, j0 + A_CELLS), loaded as they are (16-byte loads
// where a.vec_mask / a.vec_pos allow and the 8 cells exist) before the block's first barrier and used after
// it, so that they, I1 and the query components take one round trip (the position loads used to wait for the
// mask's, and the query's for both). Elsewhere cells_use reads them one by one.
struct cells_raw {
    uint4 m;       // 8 f16 mask values
    int4  p0, p1;  // 8 positions
};
__device__ __forceinline__ void cells_load(const sparq_args & a, const uint16_t * m, const int32_t * pr, int64_t j0,
                                           cells_raw & r) {
    static_assert(A_CELLS == 8, "one 16-byte mask load and two position loads per thread");
    const bool full = j0 + A_CELLS <= a.n_kv;
    r.m  = make_uint4(0, 0, 0, 0);
    r.p0 = make_int4(0, 0, 0, 0);
    r.p1 = r.p0;
    if (full && m && a.vec_mask) {
        r.m = *(const uint4 *) (m + j0);
    }
    if (full && pr && a.vec_pos) {
        r.p0 = ((const int4 *) (pr + j0))[0];
        r.p1 = ((const int4 *) (pr + j0))[1];
    }
}
// vis bit u: cell j0 + u exists and is visible; the visible cells' count and smallest / largest position.
__device__ __forceinline__ void cells_use(const sparq_args & a, const uint16_t * m, const int32_t * pr, int64_t j0,
                                          const cells_raw & r, uint32_t & vis, int & n_vis, int & p_min, int & p_max) {
    const bool full = j0 + A_CELLS <= a.n_kv;
    const bool vm = full && m && a.vec_mask, vp = full && pr && a.vec_pos;
    const uint16_t * mv = (const uint16_t *) &r.m;
    const int32_t pv[A_CELLS] = { r.p0.x, r.p0.y, r.p0.z, r.p0.w, r.p1.x, r.p1.y, r.p1.z, r.p1.w };
    vis = 0; n_vis = 0; p_min = INT32_MAX; p_max = INT32_MIN;
#pragma unroll
    for (int u = 0; u < A_CELLS; ++u) {
        const int64_t j = j0 + u;
        if (vm ? mv[u] != F16_NEG_INF : j < a.n_kv && visible(m, j)) {
            vis |= 1u << u;
            ++n_vis;
            const int32_t pj = vp ? pv[u] : (int32_t) position(pr, j);
            p_min = min(p_min, pj);
            p_max = max(p_max, pj);
        }
    }
}

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

struct select_state {
    uint64_t prefix;
    uint32_t need;
    int      done;
};

constexpr int HIST_WORDS = 256 * (B_THREADS / WARP_SIZE + 1);  // per-warp histograms + their sum

// Radix select over keys key_of(0..n) (0 = not an item; items have distinct keys): returns T such that
// exactly `need` items have key >= T (need <= number of items). Digits of 8 bits from bit top_shift down;
// stops early once a digit's bin holds exactly the remaining need. Keys share their leading digits (scores
// of one row lie within a few binades), so counting goes through per-warp histograms with the lanes of a
// warp that hit the same bin merged first (__match_any_sync): no pile-up of atomics on one address.
// hist: HIST_WORDS shared words; blockDim.x <= B_THREADS.
template <typename KeyFn>
__device__ uint64_t block_select(int64_t n, uint32_t need, int top_shift, KeyFn key_of, uint32_t * hist,
                                 select_state * sst) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    uint32_t * total = hist + 256*n_warps;
    if (threadIdx.x == 0) {
        sst->prefix = 0;
        sst->need   = need;
        sst->done   = 0;
    }
    uint64_t pmask = 0;
    for (int shift = top_shift; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256*n_warps; b += blockDim.x) {
            hist[b] = 0;
        }
        __syncthreads();
        const uint64_t prefix = sst->prefix;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            const uint64_t key = key_of(i);
            const uint32_t bin = key != 0 && (key & pmask) == prefix ? (uint32_t) (key >> shift) & 0xFF : 256u;
            const uint32_t peers = __match_any_sync(__activemask(), bin);
            if (bin < 256 && lane == __ffs(peers) - 1) {
                atomicAdd(&hist[warp*256 + bin], (uint32_t) __popc(peers));
            }
        }
        __syncthreads();
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            uint32_t sum = 0;
            for (int w = 0; w < n_warps; ++w) {
                sum += hist[w*256 + b];
            }
            total[b] = sum;
        }
        __syncthreads();
        if (threadIdx.x < WARP_SIZE) {
            // lane l owns bins 255 - 8l ... 248 - 8l (descending); prefix sums over lanes find the bin where the
            // count from the top reaches `need`
            uint32_t c[8], tot = 0;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                c[e] = total[255 - 8*lane - e];
                tot += c[e];
            }
            uint32_t incl = tot;
#pragma unroll
            for (int off = 1; off < WARP_SIZE; off <<= 1) {
                const uint32_t y = __shfl_up_sync(0xFFFFFFFF, incl, off);
                incl += lane >= off ? y : 0;
            }
            const uint32_t need_now = sst->need;
            __syncwarp();
            if (incl - tot < need_now && incl >= need_now) {
                uint32_t cum = incl - tot;
                for (int e = 0; e < 8; ++e) {
                    if (cum + c[e] >= need_now) {
                        sst->prefix = prefix | ((uint64_t) (255 - 8*lane - e) << shift);
                        sst->need   = need_now - cum;
                        sst->done   = c[e] == need_now - cum;
                        break;
                    }
                    cum += c[e];
                }
            }
        }
        __syncthreads();
        pmask |= (uint64_t) 0xFF << shift;
        if (sst->done) {
            break;
        }
    }
    const uint64_t result = sst->prefix;
    __syncthreads();
    return result;
}

__device__ __forceinline__ int top_shift_for(int bits) { return ((bits - 1) / 8) * 8; }

// Exclusive prefix sum over the block (fixed order); *total gets the sum. red: 32 shared ints.
__device__ int block_exclusive_scan(int v, int * total, int * red) {
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

// One-pass bucket select (the short lists of kernels P and S; the radix select above needs a pass per 8 bits):
// 32-bit keys key_of(0..n) (0 = not an item) in [lo, lo + (BUCKETS_PER_THREAD*blockDim.x << shift)) counted in
// buckets of width 2^shift from lo; finds the bucket that holds the need-th largest key (1 <= need <= number of
// items): its index, the items in higher buckets and the items in it. Lanes of a warp that hit one bucket are
// merged first (equal keys of a degenerate list do not pile up on one shared address). hist: n_bins shared words.
constexpr int BUCKETS_PER_THREAD = 8;
struct bucket_state {
    uint32_t bin, above, count;
};
__device__ __forceinline__ int bucket_shift(uint32_t lo, uint32_t hi) {
    const uint32_t n_bins = BUCKETS_PER_THREAD*blockDim.x;
    int shift = 0;
    while (((hi - lo) >> shift) >= n_bins) {
        ++shift;
    }
    return shift;
}
template <typename KeyFn>
__device__ bucket_state bucket_find(int64_t n, uint32_t need, uint32_t lo, int shift, KeyFn key_of, uint32_t * hist,
                                    int * red, bucket_state * bs) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int n_bins = BUCKETS_PER_THREAD*blockDim.x;
    for (int b = threadIdx.x; b < n_bins; b += blockDim.x) {
        hist[b] = 0;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint32_t key = key_of(i);
        const uint32_t bin = key != 0 ? (key - lo) >> shift : UINT32_MAX;
        const uint32_t peers = __match_any_sync(__activemask(), bin);
        if (bin != UINT32_MAX && lane == __ffs(peers) - 1) {
            atomicAdd(&hist[bin], (uint32_t) __popc(peers));
        }
    }
    __syncthreads();
    // thread t owns buckets n_bins-1-8t down to n_bins-8-8t; a scan in thread order counts the items above them
    uint32_t c[BUCKETS_PER_THREAD];
    int tot = 0;
#pragma unroll
    for (int e = 0; e < BUCKETS_PER_THREAD; ++e) {
        c[e] = hist[n_bins - 1 - BUCKETS_PER_THREAD*threadIdx.x - e];
        tot += c[e];
    }
    int total;
    const uint32_t above = (uint32_t) block_exclusive_scan(tot, &total, red);
    if (above < need && above + tot >= need) {
        uint32_t cum = above;
#pragma unroll
        for (int e = 0; e < BUCKETS_PER_THREAD; ++e) {
            if (cum < need && cum + c[e] >= need) {
                bs->bin   = n_bins - 1 - BUCKETS_PER_THREAD*threadIdx.x - e;
                bs->above = cum;
                bs->count = c[e];
            }
            cum += c[e];
        }
    }
    __syncthreads();
    const bucket_state r = *bs;
    __syncthreads();
    return r;
}

// Group scores of N cells j[u]: the sum over the group's heads of the approximate probability
// exp(l - M_g) / Z_g (rstat = [M_g..., 1/Z_g...]); 0 where cand[u] is false. The logit loads of the N cells
// are issued together. The one formula for the sample, the sweep and the fallback, so their keys agree.
template <int N>
__device__ __forceinline__ void group_scores(const float * lrow, int64_t n_kv, int64_t G, const float * rstat,
                                             const int64_t (&j)[N], const bool (&cand)[N], float (&c)[N],
                                             int64_t g_first = 0) {  // g_first > 0: c holds the heads before it
    if (g_first == 0) {
#pragma unroll
        for (int u = 0; u < N; ++u) {
            c[u] = 0.0f;
        }
    }
    for (int64_t g = g_first; g < G; ++g) {
        float lv[N];
#pragma unroll
        for (int u = 0; u < N; ++u) {
            lv[u] = cand[u] ? lrow[g*n_kv + j[u]] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < N; ++u) {
            c[u] += __expf(lv[u] - rstat[g]) * rstat[G + g];
        }
    }
}
__device__ __forceinline__ uint32_t score_key(float c) { return __float_as_uint(c) + 1u; }  // c >= 0: order kept

// ---- kernel A: scores ------------------------------------------------------------------------------

// factor_g = scale / sqrt(rho_g), rho_g = |q_g[I1]|_1 / |q_g|_1 (double, as the CPU), into fac: a warp per head, lanes
// strided, one butterfly; q_of(g) gives head g's d components (global memory or a shared copy: the same values, so
// the same bits). Ends with a barrier (fac is read by the whole block).
template <typename QFn>
__device__ void query_factors(const sparq_args & a, int64_t G, int64_t d, const int * i1, float * fac, QFn q_of) {
    const int k1 = a.p.k1;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int64_t g = warp; g < G; g += blockDim.x / WARP_SIZE) {
        const float * qg = q_of(g);
        double all = 0.0, sel = 0.0;
        for (int64_t i = lane; i < d; i += WARP_SIZE) {
            all += fabs((double) qg[i]);
        }
        for (int i = lane; i < k1; i += WARP_SIZE) {
            sel += fabs((double) qg[i1[i]]);
        }
        all = warp_reduce(all, op_add());
        sel = warp_reduce(sel, op_add());
        if (lane == 0) {
            const double rho = all > 0.0 ? sel / all : 1.0;
            fac[g] = (float) (a.p.scale / sqrt(rho > 0.0 ? rho : 1.0));
        }
    }
    __syncthreads();
}

// I1 of row c (ascending; the k1 largest components of sum_g |q_g|, ties to the lower component) into i1, and
// factor_g = scale / sqrt(rho_g) into fac. Shared scratch: absum [d] floats, rank [d] ints.
__device__ void row_query(const sparq_args & a, const row_coords & c, float * absum, int * rank, int * i1, float * fac) {
    const int64_t d = a.d, G = a.group;
    const int k1 = a.p.k1;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        float sum = 0.0f;  // in head order, as the CPU
        for (int64_t g = 0; g < G; ++g) {
            sum += fabsf(q_row(a, c.h*G + g, c)[i]);
        }
        absum[i] = sum;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        const float ai = absum[i];
        int rk = 0;
        for (int64_t j = 0; j < d; ++j) {
            const float b = absum[j];
            rk += (b > ai) | ((b == ai) & (j < i));
        }
        rank[i] = rk;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        if (rank[i] < k1) {
            int at = 0;
            for (int64_t j = 0; j < i; ++j) {
                at += rank[j] < k1;
            }
            i1[at] = (int) i;
        }
    }
    __syncthreads();
    query_factors(a, G, d, i1, fac, [&](int64_t g) { return q_row(a, c.h*G + g, c); });
}

// row_query's results (the same I1, the same factors bit for bit) in fewer dependent steps, for kernel Q: the row's
// queries are read from global memory once, into qrow [G][d] (row_query reads them three times); each component's
// rank is counted by R consecutive lanes (as many as fit, up to a warp) over a 1/R share of the others (row_query:
// one thread over all d); I1 is compacted in order by one warp's ballots (row_query: each selected component
// counts the selected ones below it, O(d) serial loads). The factors: query_factors over the same values, as
// row_query. Shared: absum [d], rank [d], qrow [G*d] floats.
// Timeline at 32k (H100, session 15): kernel Q's body 6.2 us with row_query, 4.7 us with this, of a ~86 us chain.
__device__ void row_query_fast(const sparq_args & a, const row_coords & c, float * absum, int * rank, float * qrow,
                               int * i1, float * fac) {
    const int d = (int) a.d, G = (int) a.group, k1 = a.p.k1, nt = (int) blockDim.x;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int idx = threadIdx.x; idx < G*d; idx += nt) {  // every head's loads in flight together
        qrow[idx] = q_row(a, c.h*G + idx / d, c)[idx % d];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += nt) {
        float sum = 0.0f;  // in head order, as the CPU
        for (int g = 0; g < G; ++g) {
            sum += fabsf(qrow[g*d + i]);
        }
        absum[i] = sum;
    }
    __syncthreads();
    int R = 1;  // lanes per component; R divides the warp, so a component's lanes are in one warp
    while (2*R <= WARP_SIZE && 2*R*d <= nt) {
        R *= 2;
    }
    const int n_t = (d*R + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE;  // whole warps: the shuffles below
    for (int t = threadIdx.x; t < n_t; t += nt) {
        const int i = t / R, p = t % R;
        int rk = 0;
        if (i < d) {
            const float ai = absum[i];
#pragma unroll 8
            for (int j = p; j < d; j += R) {
                const float b = absum[j];
                rk += (b > ai) | ((b == ai) & (j < i));
            }
        }
        for (int off = R/2; off > 0; off >>= 1) {
            rk += __shfl_xor_sync(0xFFFFFFFF, rk, off);
        }
        if (i < d && p == 0) {
            rank[i] = rk;
        }
    }
    __syncthreads();
    if (warp == 0) {
        int run = 0;
        for (int i0 = 0; i0 < d; i0 += WARP_SIZE) {
            const int i = i0 + lane;
            const bool take = i < d && rank[i] < k1;
            const uint32_t b = __ballot_sync(0xFFFFFFFF, take);
            if (take) {
                i1[run + __popc(b & ((1u << lane) - 1))] = i;
            }
            run += __popc(b);
        }
    }
    __syncthreads();
    query_factors(a, G, d, i1, fac, [&](int64_t g) { return (const float *) qrow + g*d; });
}

// Kernel Q's shared memory: absum and rank [d] each, and with the fast path the row's queries [G][d] (the fast path
// runs where they fit in Q_SMEM_MAX bytes; SPARQ_CUDA_Q_V14=1 turns it off, for A/B runs).
constexpr size_t Q_SMEM_MAX = 32 << 10;
__host__ __device__ inline bool query_fast(int64_t d, int64_t G) {
    return sizeof(float) * (G + 2)*d <= Q_SMEM_MAX;
}

// Kernel Q, one block per row: I1 and every head's components at I1 scaled by scale / sqrt(rho_g), into scratch
// for kernel A.
__global__ void __launch_bounds__(A_THREADS) sparq_query(const sparq_args a, const sparq_scratch s, int64_t r0) {
    extern __shared__ float smq[];  // [d] sums of |q|, [d] ranks, the fast path's [G][d] queries
    __shared__ int i1[MAX_HEAD_DIM];
    __shared__ float fac[MAX_G];
    SPARQ_TL_SCOPE(TL_Q);
    pdl_wait();
    SPARQ_TL_WAITED();
    pdl_release();
    const int64_t w = blockIdx.x;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t d = a.d, G = a.group;
    const int k1 = a.p.k1;
    if (query_fast(d, G)) {
        float * qrow = smq + 2*d;
        row_query_fast(a, c, smq, (int *) (smq + d), qrow, i1, fac);
        for (int64_t idx = threadIdx.x; idx < G*k1; idx += blockDim.x) {
            const int64_t g = idx / k1, i = idx % k1;
            s.qs[(w*G + g)*k1 + i] = qrow[g*d + i1[i]] * fac[g];
        }
    } else {
        row_query(a, c, smq, (int *) (smq + d), i1, fac);
        for (int64_t idx = threadIdx.x; idx < G*k1; idx += blockDim.x) {
            const int64_t g = idx / k1, i = idx % k1;
            s.qs[(w*G + g)*k1 + i] = q_row(a, c.h*G + g, c)[i1[i]] * fac[g];
        }
    }
    for (int i = threadIdx.x; i < k1; i += blockDim.x) {
        s.i1[w*k1 + i] = i1[i];
    }
}

// Heads g0 .. g0+NG of the row into shared memory: scaled components at I1 (SparQ) or whole rows (exact).
template <int POL, int NG>
__device__ void load_query_pass(const sparq_args & a, const sparq_scratch & s, int64_t w, const row_coords & c,
                                int64_t g0, float * qs) {
    const int64_t G = a.group, d = a.d;
    const int k1 = a.p.k1;
    if (g0 > 0) {
        __syncthreads();  // qs of the previous pass is no longer read (none before the first: its loads go out with I1's)
    }
    if (POL == SC_KT || POL == SC_GATHER) {
        for (int idx = threadIdx.x; idx < NG*k1; idx += blockDim.x) {
            const int gg = idx / k1, i = idx % k1;
            qs[idx] = g0 + gg >= G ? 0.0f : s.qs[(w*G + g0 + gg)*k1 + i];
        }
    } else if (POL == SC_EXACT) {
        for (int64_t idx = threadIdx.x; idx < NG*d; idx += blockDim.x) {
            const int64_t gg = idx / d, i = idx % d;
            qs[idx] = g0 + gg < G ? q_row(a, c.h*G + g0 + gg, c)[i] : 0.0f;
        }
    }
    __syncthreads();
}

// Kernel P's threshold sample of a sparse row: every stride-th cell, n_samp cells; the threshold is the sample's key at
// rank + 1, so ~target = rank * stride cells pass it. The target is 8 n_top + 64 (4 n_top + 16 before session 12),
// at most half the candidate list's capacity, at least 4 n_top + 16.
struct sample_plan {
    int64_t stride, n_samp, rank;
};
__device__ inline sample_plan plan_sample(int64_t n_kv, int64_t n_top, int64_t cap) {
    const int64_t target = max(4*n_top + 16, min(8*n_top + 64, cap / 2));
    int64_t stride = min(n_kv / SAMPLE, target / SAMPLE_RANK);
    stride = max(stride, (n_kv + SAMPLE_MAX - 1) / SAMPLE_MAX);
    stride = max(stride, (int64_t) 1);
    return { stride, (n_kv + stride - 1) / stride, target / stride };
}

// Kernel A's chunk statistics of row w merged (kernel P; every block of kernel PBS, the same loop so the same bits):
// per head the softmax max M_g and 1/Z_g into rst [2G] (and into scratch where write_global; a warp per head, lanes
// across chunks, one round of loads), and the visible cells and their position range, in every thread. Ends with
// a barrier (rst complete).
struct row_merge {
    int64_t n_vis, p_min, p_max;
};
__device__ row_merge merge_chunk_stats(const sparq_args & a, const sparq_scratch & s, int64_t w, float * rst,
                                       bool write_global, int64_t * redl) {
    const int64_t G = a.group, nA = a.n_chunks_a;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    float * rstat = s.rstat + w*2*G;
    for (int64_t g = warp; g < G; g += blockDim.x / WARP_SIZE) {
        const float * cm = s.cmax + (w*G + g)*nA;
        const float * cs = s.csum + (w*G + g)*nA;
        float mx = -INFINITY;
        for (int64_t ch = lane; ch < nA; ch += WARP_SIZE) {
            mx = fmaxf(mx, cm[ch]);
        }
        mx = warp_reduce(mx, op_max());
        double total = 0.0;
        for (int64_t ch = lane; ch < nA; ch += WARP_SIZE) {
            total += cm[ch] == -INFINITY ? 0.0 : cs[ch] * exp((double) cm[ch] - mx);
        }
        total = warp_reduce(total, op_add());
        if (lane == 0) {
            const float inv_z = total > 0.0 ? (float) (1.0 / total) : 0.0f;
            rst[g] = mx;
            rst[G + g] = inv_z;
            if (write_global) {
                rstat[g] = mx;
                rstat[G + g] = inv_z;
            }
        }
    }
    row_merge rm = { 0, INT64_MAX, INT64_MIN };
    for (int64_t ch = threadIdx.x; ch < nA; ch += blockDim.x) {
        const int32_t * cv = s.cvis + (w*nA + ch)*3;
        if (cv[0] > 0) {
            rm.n_vis += cv[0];
            rm.p_min = min(rm.p_min, (int64_t) cv[1]);
            rm.p_max = max(rm.p_max, (int64_t) cv[2]);
        }
    }
    block_sum_min_max(rm.n_vis, rm.p_min, rm.p_max, redl);  // its barriers publish rst
    return rm;
}

// Kernel P's work for one row: merge the chunk statistics, classify the row, set the candidate threshold.
__device__ void prepare_row(const sparq_args & a, const sparq_scratch & s, int64_t w, int64_t r) {
    SPARQ_TIMING_MARKS(5);
    SPARQ_TIMING_MARK(0);
    __shared__ uint32_t skey[SAMPLE_MAX];
    __shared__ uint32_t hist[HIST_WORDS];
    __shared__ int64_t info[N_RI];
    __shared__ int red[32];
    __shared__ uint32_t red3[96];
    __shared__ bucket_state bst;
    const int64_t G = a.group, n_kv = a.n_kv;
    __shared__ float rst[2*MAX_G];
    __shared__ int64_t redl[96];
    SPARQ_TIMING_MARK(1);
    const row_merge rm = merge_chunk_stats(a, s, w, rst, true, redl);
    const int64_t n_vis = rm.n_vis, p_min = rm.p_min, p_max = rm.p_max;
    if (threadIdx.x == 0) {
        info[RI_KIND]  = n_vis == 0 ? ROW_EMPTY : n_vis <= a.p.k2 ? ROW_DENSE : ROW_SPARSE;
        info[RI_N_VIS] = n_vis;
        info[RI_W_LO]  = p_max - a.window;   // window: position > w_lo
        info[RI_S_HI]  = p_min + a.sinks;    // sinks:  position < s_hi
        info[RI_THR]   = 1;                  // every candidate
        info[RI_ZERO_FIRST] = 0;
    }
    SPARQ_TIMING_MARK(2);
    SPARQ_TIMING_MARK(3);  // set on every path (again after the sample where there is one)
    __syncthreads();  // rstat (global, this block) and info
    if (info[RI_KIND] == ROW_SPARSE && a.n_top > 0) {
        // threshold: the sample's value at the rank that leaves ~target cells above it
        const sample_plan sp = plan_sample(n_kv, a.n_top, a.cap);
        const int64_t stride = sp.stride, n_samp = sp.n_samp;
        const float * lrow = s.logits + w*G*n_kv;
        const int64_t w_lo = info[RI_W_LO], s_hi = info[RI_S_HI];
        const row_coords c = coords_of(a, r);
        const uint16_t * m = mask_row(a, c);
        const int32_t * pr = pos_row(a, c);
        // 8 samples per thread in flight: the masks and positions, then the logits of the candidates
        uint32_t cnt = 0, kmin = UINT32_MAX, kmax = 0;
        for (int64_t i0 = threadIdx.x; i0 < n_samp; i0 += 8*blockDim.x) {
            bool cand[8];
            int64_t j[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int64_t i = i0 + u*blockDim.x;
                j[u] = i * stride;
                cand[u] = i < n_samp && visible(m, j[u]);
                const int64_t pj = cand[u] ? position(pr, j[u]) : 0;
                cand[u] = cand[u] && !(pj > w_lo || pj < s_hi);
            }
            float c[8];
            group_scores(lrow, n_kv, G, rst, j, cand, c);
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int64_t i = i0 + u*blockDim.x;
                if (i < n_samp) {
                    const uint32_t key = cand[u] ? score_key(c[u]) : 0u;
                    skey[i] = key;
                    cnt += cand[u];
                    kmin = cand[u] ? min(kmin, key) : kmin;
                    kmax = cand[u] ? max(kmax, key) : kmax;
                }
            }
        }
        block_sum_min_max(cnt, kmin, kmax, red3);
        const int64_t n_valid = cnt;
        SPARQ_TIMING_MARK(3);
        const int64_t rank = sp.rank;
        if (rank < n_valid) {
            // the lower bound of the bucket that holds the sample's (rank+1)-th key: at most a bucket's worth of
            // extra candidates pass (any threshold is correct: it only filters)
            const int shift = bucket_shift(kmin, kmax);
            const bucket_state b = bucket_find(n_samp, (uint32_t) rank + 1, kmin, shift,
                                               [&](int64_t i) { return skey[i]; }, hist, red, &bst);
            if (threadIdx.x == 0) {
                info[RI_THR] = (int64_t) (kmin + (b.bin << shift));
            }
        }
        __syncthreads();
    }
    // A threshold at the zero score: the group scores of most cells underflowed to 0 (a peaked row), so every
    // cell would pass it and kernel S would fall back to the exact selection over all cells (~1 ms at 32k).
    // Zero-score cells tie, and ties go to the lower cell: only the first sweep chunk's zero-score cells can be
    // needed, unless it holds fewer than the top needs, which kernel S sees (fewer than n_top candidates).
    if (threadIdx.x == 0 && info[RI_KIND] == ROW_SPARSE && a.n_top > 0 && info[RI_THR] <= (int64_t) score_key(0.0f) &&
        n_kv > B_CHUNK) {
        info[RI_ZERO_FIRST] = 1;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < N_RI; i += blockDim.x) {
        s.rinfo[w*N_RI + i] = info[i];
    }
    SPARQ_TIMING_MARK(4);
    SPARQ_TIMING_PRINT("P: start, merge, sample, select", w, 5);
}

// Kernel A (grid: chunks of A_CHUNK cells x rows; A_THREADS threads, A_CELLS cells each). Per pass of NG heads:
// the approximate logits of the chunk's cells, -inf for hidden cells, and the chunk's max and sum of exponentials
// per head; once per block the chunk's visible count and position range. Phases, each chosen so that a block
// spends its life with K^T loads in flight (bench/harness_a/NOTES.md):
//   prologue: I1, the first pass's query components, the mask and the positions in one round trip (one barrier);
//   K^T rows a_unroll at a time (evict-first, no L1);
//   epilogue: one barrier for every head's block max, one for the sums; the visible count and position range
//   ride along (their warp results are in shared memory since the prologue). The reduction trees are
//   block_reduce's (warp butterfly, then the A_WARPS warp results in lanes 0 .. A_WARPS-1 of one butterfly), so
//   the statistics are bit for bit those of one block_reduce per value (was 5 per head and pass, 3 barriers
//   each); the logits' products and their order are unchanged. Checked bit for bit against the previous kernel
//   for f16/bf16/f32, 1-8 heads per pass, two passes, a dead head, gather/exact/none, ragged lengths, no or a
//   misaligned mask (harness: bench/harness_a, port_matrix).
template <typename T, int POL, int NG>
__global__ void __launch_bounds__(A_THREADS, a_min_blocks<POL, NG>()) sparq_scores(const sparq_args a, const sparq_scratch s, int64_t r0) {
    extern __shared__ float qs[];  // [NG][k1] scaled components, or [NG][d] query rows
    __shared__ float red_max[NG][A_WARPS], red_sum[NG][A_WARPS];
    __shared__ int   red_cells[3][A_WARPS];  // visible count, smallest and largest position per warp
    pdl_wait();
    pdl_release();
    __shared__ int   i1_buf[MAX_HEAD_DIM];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t w = blockIdx.y, chunk = blockIdx.x;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, d = a.d, n_kv = a.n_kv;
    const int k1 = a.p.k1;
    if (POL == SC_KT || POL == SC_GATHER) {
        for (int i = threadIdx.x; i < k1; i += blockDim.x) {
            i1_buf[i] = s.i1[w*k1 + i];
        }
    }
    const uint16_t * m  = mask_row(a, c);
    const int32_t  * pr = pos_row(a, c);
    const int64_t j0 = chunk*A_CHUNK + (int64_t) threadIdx.x*A_CELLS;
    cells_raw cr;
    cells_load(a, m, pr, j0, cr);  // in flight with I1 and the first pass's query (used after its barrier)

    uint32_t vis;  // bit u: cell j0 + u is visible
    int n_vis, p_min, p_max;
    if (POL == SC_NONE) {
        cells_use(a, m, pr, j0, cr, vis, n_vis, p_min, p_max);
        if (threadIdx.x < G) {
            for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
                s.cmax[(w*G + g)*a.n_chunks_a + chunk] = -INFINITY;
                s.csum[(w*G + g)*a.n_chunks_a + chunk] = 0.0f;
            }
        }
        n_vis = block_reduce(n_vis, op_add(), 0, red_cells[0]);
        p_min = block_reduce(p_min, op_min(), INT32_MAX, red_cells[0]);
        p_max = block_reduce(p_max, op_max(), INT32_MIN, red_cells[0]);
        if (threadIdx.x == 0) {
            int32_t * cv = s.cvis + (w*a.n_chunks_a + chunk)*3;
            cv[0] = n_vis; cv[1] = p_min; cv[2] = p_max;
        }
        SPARQ_TL_END(TL_A);
        return;
    }

    // the first pass's query (no barrier before it), then the cells' statistics: each warp's go to shared memory
    // here and are read after the first pass's barriers (nothing of cr and the statistics stays live in the loop)
    load_query_pass<POL, NG>(a, s, w, c, 0, qs);
    cells_use(a, m, pr, j0, cr, vis, n_vis, p_min, p_max);
    n_vis = warp_reduce(n_vis, op_add());
    p_min = warp_reduce(p_min, op_min());
    p_max = warp_reduce(p_max, op_max());
    if (lane == 0) {
        red_cells[0][warp] = n_vis; red_cells[1][warp] = p_min; red_cells[2][warp] = p_max;
    }
    for (int64_t g0 = 0; g0 < G; g0 += NG) {
        if (g0 > 0) {
            load_query_pass<POL, NG>(a, s, w, c, g0, qs);
        }
        float acc[NG][A_CELLS];
#pragma unroll
        for (int g = 0; g < NG; ++g) {
#pragma unroll
            for (int u = 0; u < A_CELLS; ++u) {
                acc[g][u] = 0.0f;
            }
        }
        if (POL == SC_KT) {
            // r rows of K^T: each thread reads 8 consecutive cells of a row with one 16-byte load (two for f32),
            // A_UNROLL rows in flight
            const char * ktb = a.kt + c.h*a.kt_nb2 + c.st*a.kt_nb3;
            const bool vec = a.vec_kt && j0 + A_CELLS <= n_kv;
            constexpr int A_UNROLL = a_unroll<T, NG>();
#pragma unroll 1
            for (int i = 0; i < k1; i += A_UNROLL) {
                raw8<T> x[A_UNROLL];
                if (vec) {
                    const uint64_t pol = l2_evict_first();  // one instruction: cheaper than a register pair in the loop
#pragma unroll
                    for (int uu = 0; uu < A_UNROLL; ++uu) {
                        load_raw8_stream((const T *) (ktb + (int64_t) i1_buf[min(i + uu, k1 - 1)]*a.kt_nb1) + j0, x[uu], pol);
                    }
                }
#pragma unroll
                for (int uu = 0; uu < A_UNROLL; ++uu) {
                    if (i + uu >= k1) {
                        continue;
                    }
                    float xf[A_CELLS];
                    if (vec) {
#pragma unroll
                        for (int u = 0; u < A_CELLS; ++u) {
                            xf[u] = raw8_at(x[uu], u);
                        }
                    } else {
                        const T * row = (const T *) (ktb + (int64_t) i1_buf[i + uu]*a.kt_nb1);
#pragma unroll
                        for (int u = 0; u < A_CELLS; ++u) {
                            xf[u] = j0 + u < n_kv ? to_f32(row[j0 + u]) : 0.0f;
                        }
                    }
#pragma unroll
                    for (int g = 0; g < NG; ++g) {
                        const float qv = qs[g*k1 + i + uu];
#pragma unroll
                        for (int u = 0; u < A_CELLS; ++u) {
                            acc[g][u] += qv * xf[u];
                        }
                    }
                }
            }
        } else {
            // default layout (gather k1 components of each row-major K row) or exact scores
#pragma unroll
            for (int u = 0; u < A_CELLS; ++u) {
                const int64_t j = j0 + u;
                if (j >= n_kv) {
                    continue;
                }
                const T * krow = (const T *) (a.k + j*a.k_nb1 + c.h*a.k_nb2 + c.st*a.k_nb3);
                if (POL == SC_GATHER) {
                    for (int i = 0; i < k1; ++i) {
                        const float x = to_f32(krow[i1_buf[i]]);
#pragma unroll
                        for (int g = 0; g < NG; ++g) {
                            acc[g][u] += qs[g*k1 + i] * x;
                        }
                    }
                } else {
                    for (int64_t i = 0; i < d; ++i) {
                        const float x = to_f32(krow[i]);
#pragma unroll
                        for (int g = 0; g < NG; ++g) {
                            acc[g][u] += qs[g*d + i] * x;
                        }
                    }
#pragma unroll
                    for (int g = 0; g < NG; ++g) {
                        acc[g][u] = logit_exact(a, acc[g][u]);
                    }
                }
            }
        }
        // hidden cells: -inf; write the logits; every head's block max through one barrier. The NG heads' warp
        // reductions run side by side (warp_reduce_n: session 19 measured this epilogue at ~3.6 us per block with
        // them one after another); a pass's heads past G (g0 + g >= G) are reduced too and not written.
        float mx[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            mx[g] = -INFINITY;
#pragma unroll
            for (int u = 0; u < A_CELLS; ++u) {
                acc[g][u] = (vis >> u) & 1 ? acc[g][u] : -INFINITY;
                mx[g] = fmaxf(mx[g], acc[g][u]);
            }
            if (g0 + g >= G) {
                continue;
            }
            float * lrow = s.logits + (w*G + g0 + g)*n_kv;
            if (a.vec_logits && j0 + A_CELLS <= n_kv) {
                ((float4 *) (lrow + j0))[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
                ((float4 *) (lrow + j0))[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
            } else {
#pragma unroll
                for (int u = 0; u < A_CELLS; ++u) {
                    if (j0 + u < n_kv) {
                        lrow[j0 + u] = acc[g][u];
                    }
                }
            }
        }
        warp_reduce_n(mx, op_max());
        if (lane == 0) {
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                red_max[g][warp] = mx[g];
            }
        }
        __syncthreads();
        // the chunk's sum of exponentials per head, through the second barrier
        float sum[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            mx[g] = lane < A_WARPS ? red_max[g][lane] : -INFINITY;
        }
        warp_reduce_n(mx, op_max());
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            sum[g] = 0.0f;
            if (mx[g] != -INFINITY) {
#pragma unroll
                for (int u = 0; u < A_CELLS; ++u) {
                    sum[g] += (vis >> u) & 1 ? __expf(acc[g][u] - mx[g]) : 0.0f;
                }
            }
        }
        warp_reduce_n(sum, op_add());
        if (lane == 0) {
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                red_sum[g][warp] = sum[g];
            }
        }
        __syncthreads();
        if (warp == 0) {
            // red_* are next written after the next pass's first barrier (load_query_pass), which warp 0 reaches
            // only after these reads. mx already holds every head's block max (the same reduction over red_max).
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                sum[g] = lane < A_WARPS ? red_sum[g][lane] : 0.0f;
            }
            warp_reduce_n(sum, op_add());
            if (lane == 0) {
#pragma unroll
                for (int g = 0; g < NG; ++g) {
                    if (g0 + g < G) {
                        s.cmax[(w*G + g0 + g)*a.n_chunks_a + chunk] = mx[g];
                        s.csum[(w*G + g0 + g)*a.n_chunks_a + chunk] = sum[g];
                    }
                }
            }
            if (g0 == 0) {
                const bool in = lane < A_WARPS;
                const int nv = warp_reduce(in ? red_cells[0][lane] : 0, op_add());
                const int lo = warp_reduce(in ? red_cells[1][lane] : INT32_MAX, op_min());
                const int hi = warp_reduce(in ? red_cells[2][lane] : INT32_MIN, op_max());
                if (lane == 0) {
                    int32_t * cv = s.cvis + (w*a.n_chunks_a + chunk)*3;
                    cv[0] = nv; cv[1] = lo; cv[2] = hi;
                }
            }
        }
    }
    SPARQ_TL_END(TL_A);
}

// Kernel P, one block per row: merges kernel A's chunk statistics and sets the row's candidate threshold. A
// kernel of its own (not kernel A's last block) so that kernel A carries none of its shared memory and runs
// more blocks per SM.
__global__ void __launch_bounds__(A_THREADS) sparq_prepare(const sparq_args a, const sparq_scratch s, int64_t r0) {
    SPARQ_TL_SCOPE(TL_P);
    pdl_wait();
    SPARQ_TL_WAITED();
    pdl_release();
    // kernel B's counters of this row start at zero (here rather than a memset: a memset would break the
    // chain of dependent launches)
    for (int i = threadIdx.x; i < N_CTR; i += blockDim.x) {
        s.counters[blockIdx.x*N_CTR + i] = 0;
    }
    prepare_row(a, s, blockIdx.x, r0 + blockIdx.x);
}

// ---- kernel B: select and attend --------------------------------------------------------------------

// Threads per selected row in the gathers: enough 8-element vectors to cover n values, a power of two up to
// a warp (so the dot-product reduction stays inside one warp).
__host__ __device__ __forceinline__ int threads_per_row(int64_t n) {
    const int nvec = (int) ((n + 7) / 8);
    int tpr = 1;
    while (tpr < nvec && tpr < WARP_SIZE) {
        tpr <<= 1;
    }
    return tpr;
}

__device__ __forceinline__ void mark_cell(uint32_t * bm, int64_t j) { atomicOr(&bm[j >> 5], 1u << (j & 31)); }
// Bitmap words are read past L1 (__ldcg): this block's atomics update them in L2.
__device__ __forceinline__ bool marked(const uint32_t * bm, int64_t j) { return (__ldcg(bm + (j >> 5)) >> (j & 31)) & 1u; }

__device__ __forceinline__ uint64_t order_key(int64_t pos, int64_t j) {  // (position, cell) as one unsigned key
    return ((uint64_t) ((uint32_t) pos ^ 0x80000000u) << 32) | (uint64_t) j;
}

// Exact selections over every cell of the row (the fallback): window and sinks by (position, cell), then the
// top of the group score over the rest.
__device__ void select_all_cells(const sparq_args & a, const sparq_scratch & s, int64_t w, const row_coords & c,
                                 uint32_t * hist, select_state * sst) {
    const int64_t n_kv = a.n_kv, G = a.group;
    const uint16_t * m  = mask_row(a, c);
    const int32_t  * pr = pos_row(a, c);
    uint32_t * bm = s.bitmap + w*a.n_words;
    const float * lrow  = s.logits + w*G*n_kv;
    const float * rstat = s.rstat + w*2*G;
    for (int64_t i = threadIdx.x; i < a.n_words; i += blockDim.x) {
        bm[i] = 0;
    }
    __syncthreads();
    auto key_window = [&](int64_t j) -> uint64_t { return visible(m, j) ? order_key(position(pr, j), j) + 1 : 0; };
    auto key_sinks  = [&](int64_t j) -> uint64_t { return visible(m, j) ? ~order_key(position(pr, j), j) : 0; };
    if (a.window > 0) {
        const uint64_t thr = block_select(n_kv, (uint32_t) a.window, 56, key_window, hist, sst);
        for (int64_t j = threadIdx.x; j < n_kv; j += blockDim.x) {
            const uint64_t key = key_window(j);
            if (key != 0 && key >= thr) {
                mark_cell(bm, j);
            }
        }
    }
    if (a.sinks > 0) {
        const uint64_t thr = block_select(n_kv, (uint32_t) a.sinks, 56, key_sinks, hist, sst);
        for (int64_t j = threadIdx.x; j < n_kv; j += blockDim.x) {
            const uint64_t key = key_sinks(j);
            if (key != 0 && key >= thr) {
                mark_cell(bm, j);
            }
        }
    }
    __syncthreads();
    if (a.n_top > 0) {
        const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
        auto key_cand = [&](int64_t j) -> uint64_t {
            if (!visible(m, j) || marked(bm, j)) {
                return 0;
            }
            const int64_t cell[1] = { j };
            const bool cand[1] = { true };
            float score[1];
            group_scores(lrow, n_kv, G, rstat, cell, cand, score);
            return ((uint64_t) score_key(score[0]) << a.cell_bits) | (cmask - (uint64_t) j);
        };
        const uint64_t thr = block_select(n_kv, (uint32_t) a.n_top, top_shift_for(31 + a.cell_bits), key_cand, hist, sst);
        for (int64_t j = threadIdx.x; j < n_kv; j += blockDim.x) {
            const uint64_t key = key_cand(j);  // only this thread sets bit j: the key cannot change under it
            if (key != 0 && key >= thr) {
                mark_cell(bm, j);
            }
        }
    }
    __syncthreads();
}

// Candidate-list capacity per row: the sample threshold passes ~4 n_top cells; at least B_CHUNK so that a sweep
// block's own list fits.
__host__ __device__ inline int64_t candidate_cap(int64_t k2) { return 4*k2 + 4096; }

// Kernel S builds I2 from lists (forced cells + the selected top, ranked by cell) up to this k2; above it from
// the bitmap (the rank by cell costs k2 steps per cell).
constexpr int LIST_MAX_K2 = 512;

// Kernel S's shared memory (dynamic part), in bytes from the start: the candidate keys, I2, the list of I2 cells.
struct smem_s_layout {
    size_t keys, i2, uni, total;
};
__host__ __device__ inline smem_s_layout smem_s_plan(int64_t cap, int64_t k2) {
    smem_s_layout l;
    l.keys  = 0;
    l.i2    = cap*sizeof(uint64_t);
    l.uni   = l.i2 + k2*sizeof(int32_t);
    l.total = l.uni + (k2 <= LIST_MAX_K2 ? k2*sizeof(int32_t) : 0);
    return l;
}
constexpr int BND_CAP     = 128;  // keys of the boundary bucket ranked pairwise; more: radix select

// Kernel B: the sweep (grid: chunks of B_CHUNK cells x rows). Each warp takes a strip of 32 * B_CELLS cells,
// lane + 32u, and owns word u of the strip in the bitmap (no atomics, no clearing).
// Sparse rows with a top to find (session 12): one round of loads per thread. A cell with a finite logit from kernel A
// is visible (hidden cells get -inf there), so the first head's logits replace the mask except for cells at -inf;
// the positions are loaded with them only where kernel A's position range of the chunk (A_CHUNK == B_CHUNK) reaches
// the window or the sinks.
// Other rows (dense, empty, no top) and SPARQ_CUDA_SWEEP_V6=1: masks and positions first, then the logits of the
// candidates (two or three rounds).
static_assert(A_CHUNK == B_CHUNK, "kernel B reads kernel A's chunk statistics of its own chunk");
// At least 6 blocks per SM (40 registers, no spill; 8 spilled 88 bytes once the mask fallback for -inf logits came
// in): at 48 registers 5 fitted and a 64k step's 1024 blocks ran in 1.55 waves, but 8 blocks per SM measured the same
// (19.6 vs 19.3 us under ncu, session 12).
__global__ void __launch_bounds__(B_THREADS, 6) sparq_sweep(const sparq_args a, const sparq_scratch s, int64_t r0) {
    extern __shared__ __align__(16) uint64_t local[];  // this block's candidates (B_CHUNK <= cap)
    __shared__ float rst[2*MAX_G];
    __shared__ int red[32];
    __shared__ uint32_t n_local, at_global, n_local_f, at_forced;
    SPARQ_TL_SCOPE(TL_B);
    pdl_wait();
    SPARQ_TL_WAITED();
    pdl_release();
    const int64_t w = blockIdx.y, chunk = blockIdx.x;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, n_kv = a.n_kv;
    const int64_t * ri = s.rinfo + w*N_RI;
    const int64_t kind = ri[RI_KIND], w_lo = ri[RI_W_LO], s_hi = ri[RI_S_HI];
    const uint32_t thr = (uint32_t) ri[RI_THR];
    // zero-score candidates only from the first chunk (see kernel P)
    const uint32_t thr_zero = ri[RI_ZERO_FIRST] && chunk > 0 ? score_key(0.0f) + 1u : thr;
    const float * lrow  = s.logits + w*G*n_kv;
    const uint16_t * m  = mask_row(a, c);
    const int32_t  * pr = pos_row(a, c);
    uint32_t * bm  = s.bitmap + w*a.n_words;
    uint32_t * ctr = s.counters + w*N_CTR;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const bool find_cand = kind == ROW_SPARSE && a.n_top > 0;
    const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
    const bool from_logits = find_cand;
    const int32_t * cv = s.cvis + (w*a.n_chunks_a + chunk)*3;
    // positions are needed where a cell of the chunk can be in the window or the sinks
    const bool need_pos = !from_logits || (cv[0] > 0 && ((int64_t) cv[2] > w_lo || (int64_t) cv[1] < s_hi));
    for (int64_t i = threadIdx.x; i < 2*G; i += blockDim.x) {
        rst[i] = s.rstat[w*2*G + i];
    }
    if (threadIdx.x == 0) {
        n_local = 0;
        n_local_f = 0;
    }
    __syncthreads();
    const bool list_forced = kind == ROW_SPARSE;

    const int64_t strip = chunk*B_CHUNK + (int64_t) warp*WARP_SIZE*B_CELLS;
    bool vis[B_CELLS], mark[B_CELLS], cand[B_CELLS];
    int64_t cells[B_CELLS], pos_c[B_CELLS];
    float score[B_CELLS] = {};
    if (from_logits) {  // the first head's logits and the needed positions in one round
#pragma unroll
        for (int u = 0; u < B_CELLS; ++u) {
            const int64_t j = cells[u] = strip + u*WARP_SIZE + lane;
            score[u] = j < n_kv ? lrow[j] : -INFINITY;  // the logit until the score below
            pos_c[u] = need_pos && j < n_kv ? position(pr, j) : 0;
        }
    }
    int n_w = 0, n_s = 0;
#pragma unroll
    for (int u = 0; u < B_CELLS; ++u) {
        const int64_t j = cells[u] = strip + u*WARP_SIZE + lane;
        if (from_logits) {
            // a finite logit means visible; -inf is a hidden cell, or a visible one whose approximate logit
            // overflowed (the mask says which: read only for these cells)
            vis[u] = score[u] != -INFINITY || (j < n_kv && visible(m, j));
        } else {
            vis[u] = j < n_kv && visible(m, j);
            pos_c[u] = vis[u] ? position(pr, j) : 0;
        }
        const bool in_w = kind == ROW_SPARSE && vis[u] && need_pos && pos_c[u] > w_lo;
        const bool in_s = kind == ROW_SPARSE && vis[u] && need_pos && pos_c[u] < s_hi;
        n_w += in_w;
        n_s += in_s;
        mark[u] = kind == ROW_DENSE ? vis[u] : (in_w || in_s);
        cand[u] = find_cand && vis[u] && !mark[u];
    }
    if (from_logits) {
        // group_scores' first head from the loaded logits (0 + x, as there), then the other heads
#pragma unroll
        for (int u = 0; u < B_CELLS; ++u) {
            score[u] = cand[u] ? 0.0f + __expf(score[u] - rst[0]) * rst[G] : 0.0f;
        }
        if (G > 1) {
            group_scores(lrow, n_kv, G, rst, cells, cand, score, 1);
        }
    } else if (find_cand) {
        group_scores(lrow, n_kv, G, rst, cells, cand, score);
    }
#pragma unroll
    for (int u = 0; u < B_CELLS; ++u) {
        const int64_t j = strip + u*WARP_SIZE + lane;
        const uint32_t word = __ballot_sync(0xFFFFFFFF, mark[u]);
        if (lane == 0 && strip + u*WARP_SIZE < n_kv) {
            bm[(strip + u*WARP_SIZE) / WARP_SIZE] = word;
        }
        if (cand[u]) {
            const uint32_t key32 = score_key(score[u]);
            if (key32 >= thr && key32 >= thr_zero) {
                local[atomicAdd(&n_local, 1u)] = ((uint64_t) key32 << a.cell_bits) | (cmask - (uint64_t) j);
            }
        }
        if (list_forced && mark[u]) {  // from the other end: candidates and forced cells of the chunk are disjoint
            local[B_CHUNK - 1 - atomicAdd(&n_local_f, 1u)] = (uint64_t) j;
        }
    }
    n_w = block_reduce(n_w, op_add(), 0, red);
    n_s = block_reduce(n_s, op_add(), 0, red);
    if (threadIdx.x == 0) {
        at_global = n_local > 0 ? atomicAdd(&ctr[CTR_N_CAND], n_local) : 0;
        at_forced = n_local_f > 0 ? atomicAdd(&ctr[CTR_N_F], n_local_f) : 0;
        if (kind == ROW_SPARSE) {
            atomicAdd(&ctr[CTR_N_W], (uint32_t) n_w);
            atomicAdd(&ctr[CTR_N_S], (uint32_t) n_s);
        }
    }
    __syncthreads();
    uint64_t * cl = s.cand + w*a.cap;
    for (uint32_t i = threadIdx.x; i < n_local; i += blockDim.x) {
        if (at_global + i < a.cap) {
            cl[at_global + i] = local[i];
        }
    }
    int32_t * fl = s.forced + w*a.p.k2;
    for (uint32_t i = threadIdx.x; i < n_local_f; i += blockDim.x) {
        if (at_forced + i < a.p.k2) {
            fl[at_forced + i] = (int32_t) local[B_CHUNK - 1 - i];
        }
    }
}

// I2 in cell order from the row's bitmap bm into i2 (shared or global memory): each thread counts a run of words (loaded
// at once), a block scan places them; at most k2 cells. Returns their count. red: 32 shared ints.
__device__ int i2_from_bitmap(const sparq_args & a, const uint32_t * bm, int32_t * i2, int * red) {
    constexpr int WORDS_IN_REGS = 16;
    const int64_t k2 = a.p.k2;
    const int64_t wpt = (a.n_words + blockDim.x - 1) / blockDim.x;
    const int64_t wd0 = threadIdx.x*wpt, wd1 = min(a.n_words, wd0 + wpt);
    uint32_t wv[WORDS_IN_REGS];
    int cnt = 0, n_sel = 0;
    if (wpt <= WORDS_IN_REGS) {
#pragma unroll
        for (int u = 0; u < WORDS_IN_REGS; ++u) {
            wv[u] = wd0 + u < wd1 ? __ldcg(bm + wd0 + u) : 0u;
        }
#pragma unroll
        for (int u = 0; u < WORDS_IN_REGS; ++u) {
            cnt += __popc(wv[u]);
        }
    } else {
        for (int64_t wd = wd0; wd < wd1; ++wd) {
            cnt += __popc(__ldcg(bm + wd));
        }
    }
    int at = block_exclusive_scan(cnt, &n_sel, red);
    for (int64_t wd = wd0; wd < wd1; ++wd) {
        const uint32_t word = wpt <= WORDS_IN_REGS ? wv[(int) min(wd - wd0, (int64_t) WORDS_IN_REGS - 1)] : __ldcg(bm + wd);
        for (uint32_t bits = word; bits; bits &= bits - 1) {
            if (at < k2) {
                i2[at] = (int32_t) (wd*32 + __ffs(bits) - 1);
            }
            ++at;
        }
    }
    return (int) min((int64_t) n_sel, k2);
}

// alpha_g = the approximate probability mass of I2 (one warp per head), for sparse rows with the mean on; i2 in shared
// or global memory (written by this block before a barrier).
__device__ void row_alpha(const sparq_args & a, const sparq_scratch & s, int64_t w, const int32_t * i2, int n_sel,
                          const float * rst) {
    const int64_t G = a.group, n_kv = a.n_kv;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const float * lrow = s.logits + w*G*n_kv;
    for (int64_t g = warp; g < G; g += blockDim.x / WARP_SIZE) {
        float sum = 0.0f;
#pragma unroll 4
        for (int i = lane; i < n_sel; i += WARP_SIZE) {
            sum += __expf(lrow[g*n_kv + i2[i]] - rst[g]) * rst[G + g];
        }
        sum = warp_reduce(sum, op_add());
        if (lane == 0) {
            s.alpha[w*G + g] = sum;
        }
    }
}

// Kernel S, one block per row: the final selection (the exact top of the candidates, or the fallback over all
// cells), I2 in cell order into scratch with its size, and alpha_g for sparse rows with the mean on.
__global__ void __launch_bounds__(B_THREADS) sparq_select(const sparq_args a, const sparq_scratch s, int64_t r0) {
    SPARQ_TIMING_MARKS(5);
    SPARQ_TIMING_MARK(0);
    extern __shared__ __align__(16) unsigned char sms[];  // smem_s_layout
    __shared__ uint32_t hist[HIST_WORDS];
    __shared__ select_state sst;
    __shared__ float rst[2*MAX_G];
    __shared__ int red[32];
    __shared__ uint32_t red3[96];
    __shared__ uint64_t bnd[BND_CAP];
    __shared__ bucket_state bst;
    __shared__ uint32_t n_uni, n_bnd;
    SPARQ_TL_SCOPE(TL_S);
    pdl_wait();
    SPARQ_TL_WAITED();
    pdl_release();
    const int64_t w = blockIdx.x;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, k2 = a.p.k2;
    const smem_s_layout L = smem_s_plan(a.cap, k2);
    uint64_t * keys = (uint64_t *) (sms + L.keys);
    int32_t  * i2   = (int32_t *)  (sms + L.i2);
    int32_t  * uni  = (int32_t *)  (sms + L.uni);  // I2 unordered (list path)
    int64_t  * ri   = s.rinfo + w*N_RI;
    const int64_t kind = ri[RI_KIND];
    const int tid = threadIdx.x;
    if (kind == ROW_EMPTY) {
        if (tid == 0) {
            ri[RI_N_SEL] = 0;
        }
        return;
    }
    for (int64_t i = tid; i < 2*G; i += blockDim.x) {
        rst[i] = s.rstat[w*2*G + i];
    }
    uint32_t * bm = s.bitmap + w*a.n_words;
    bool from_list = false;
    int n_sel = 0;
    if (kind == ROW_SPARSE) {
        const uint32_t * ctr = s.counters + w*N_CTR;
        const int64_t n_w = ctr[CTR_N_W], n_s = ctr[CTR_N_S], n_cand = ctr[CTR_N_CAND], n_f = ctr[CTR_N_F];
        const bool fast = n_w == a.window && n_s == a.sinks && ri[RI_W_LO] >= ri[RI_S_HI] - 1 &&
                          (a.n_top == 0 || (n_cand >= a.n_top && n_cand <= a.cap));
        from_list = fast && k2 <= LIST_MAX_K2 && n_f == n_w + n_s && n_f + a.n_top <= k2;
        if (from_list) {
            // I2 unordered: the forced cells (kernel B's list), then the exact top of the candidates: one bucket
            // pass over their 32-bit scores; the keys of the boundary bucket ranked pairwise by (score, cell)
            const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
            const int32_t * fl = s.forced + w*k2;
            if (tid == 0) {
                n_uni = (uint32_t) n_f;
                n_bnd = 0;
            }
            for (int64_t i = tid; i < n_f; i += blockDim.x) {
                uni[i] = fl[i];
            }
            if (a.n_top > 0) {
                const uint64_t * cl = s.cand + w*a.cap;
                uint32_t dummy = 0, kmin = UINT32_MAX, kmax = 0;
#pragma unroll 4
                for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                    const uint64_t key = cl[i];
                    keys[i] = key;
                    const uint32_t k32 = (uint32_t) (key >> a.cell_bits);
                    kmin = min(kmin, k32);
                    kmax = max(kmax, k32);
                }
                block_sum_min_max(dummy, kmin, kmax, red3);
                const int shift = bucket_shift(kmin, kmax);
                auto key32_of = [&](int64_t i) { return (uint32_t) (keys[i] >> a.cell_bits); };
                const bucket_state b = bucket_find(n_cand, (uint32_t) a.n_top, kmin, shift, key32_of, hist, red, &bst);
                if (b.count <= BND_CAP) {
                    for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                        const uint64_t key = keys[i];
                        const uint32_t bin = (key32_of(i) - kmin) >> shift;
                        if (bin > b.bin) {
                            uni[atomicAdd(&n_uni, 1u)] = (int32_t) (cmask - (key & cmask));
                        } else if (bin == b.bin) {
                            bnd[atomicAdd(&n_bnd, 1u)] = key;
                        }
                    }
                    __syncthreads();
                    const uint32_t need = (uint32_t) a.n_top - b.above;
                    for (uint32_t t = tid; t < b.count; t += blockDim.x) {
                        const uint64_t key = bnd[t];
                        uint32_t rk = 0;
                        for (uint32_t u = 0; u < b.count; ++u) {
                            rk += bnd[u] > key;
                        }
                        if (rk < need) {
                            uni[atomicAdd(&n_uni, 1u)] = (int32_t) (cmask - (key & cmask));
                        }
                    }
                } else {
                    const uint64_t thr = block_select(n_cand, (uint32_t) a.n_top, top_shift_for(31 + a.cell_bits),
                                                      [&](int64_t i) { return keys[i]; }, hist, &sst);
                    for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                        if (keys[i] >= thr) {
                            uni[atomicAdd(&n_uni, 1u)] = (int32_t) (cmask - (keys[i] & cmask));
                        }
                    }
                }
            }
            __syncthreads();
            // I2 in cell order: each cell's rank among the (distinct) cells of the list
            n_sel = (int) n_uni;
            for (int t = tid; t < n_sel; t += blockDim.x) {
                const int32_t cell = uni[t];
                int rk = 0;
                for (int u = 0; u < n_sel; ++u) {
                    rk += uni[u] < cell;
                }
                i2[rk] = cell;
            }
        } else if (fast && a.n_top > 0) {
            const uint64_t * cl = s.cand + w*a.cap;
#pragma unroll 4
            for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                keys[i] = cl[i];
            }
            __syncthreads();
            const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
            const uint64_t thr = block_select(n_cand, (uint32_t) a.n_top, top_shift_for(31 + a.cell_bits),
                                              [&](int64_t i) { return keys[i]; }, hist, &sst);
            for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                if (keys[i] >= thr) {
                    mark_cell(bm, (int64_t) (cmask - (keys[i] & cmask)));
                }
            }
        } else if (!fast) {
#ifdef SPARQ_CUDA_INSTRUMENT
            if (a.timing && tid == 0) {
                printf("S: exact fallback, row %lld: window %lld/%d, sinks %lld/%d, candidates %lld (need %lld..%lld)\n",
                       (long long) (r0 + w), (long long) n_w, a.window, (long long) n_s, a.sinks, (long long) n_cand,
                       (long long) a.n_top, (long long) a.cap);
            }
#endif
            select_all_cells(a, s, w, c, hist, &sst);
        }
        __syncthreads();
    }
    SPARQ_TIMING_MARK(1);

    if (!from_list) {
        n_sel = i2_from_bitmap(a, bm, i2, red);
    }
    __syncthreads();
    for (int i = tid; i < n_sel; i += blockDim.x) {
        s.i2[w*k2 + i] = i2[i];
    }
    if (tid == 0) {
        ri[RI_N_SEL] = n_sel;
    }
    SPARQ_TIMING_MARK(2);

    if (kind == ROW_SPARSE && a.p.mean_on) {
        row_alpha(a, s, w, i2, n_sel, rst);
    }
    SPARQ_TIMING_MARK(3);
    SPARQ_TIMING_PRINT("S: select, I2, alpha", w, 4);
}

// ---- kernel PBS: P, B and S as one kernel per row over a thread-block cluster (Hopper) -------------------------

// Kernels P, B and S run each row's selection as a chain of dependent memory round trips and block barriers in
// one block per row (P, S) or through a global candidate list (B): ~35 us of the chain's ~86 at 32k (session 15's
// timeline). Kernel PBS spreads a row over a cluster of 8 or 16 blocks that exchange their counts through
// distributed shared memory: no sample, no threshold guess, no candidate list, no fallback for a misleading sample.
//   1. block b takes cells [b*span, (b+1)*span), thread t of it the cpt cells from b*span + t*cpt (so the order of
//      threads is the order of cells); their first-head logits are loaded (16-byte loads, all in flight) before the
//      block merges kernel A's chunk statistics (as kernel P, the same bits): the row's kind, window and sinks
//      bounds and softmax statistics are known in every block without an exchange;
//   2. visibility (from the logits, the mask only for -inf), forced cells (window, sinks; every visible cell of a
//      dense row), group scores as kernel B, 32-bit keys in place of the logits, and the histogram of the keys'
//      exponents (the first radix digit);
//   3. the exact top n_top of the candidates by (score, cell), equal scores to the lower cell: a radix select over the
//      composite key K = key << cell_bits | ~cell, 8-bit digits from the top, one block histogram per pass summed over
//      the cluster by every block: one cluster barrier per pass (most rows take two); the first carries the counts of
//      forced window and sink cells; later passes look only at the cells whose exponent is the boundary's;
//   4. I2 in cell order: each thread's selected cells, a block scan, the blocks before this one from the cluster;
//      alpha_g from the selected cells' scores (G = 1) or logits, summed over the blocks in rank order.
// Rows whose window or sinks do not come out exact (positions not distinct) take kernel S's exact selection over
// all cells in the cluster's first block. Sizes: span = cpt * PBS_THREADS cells, cpt a multiple of 4 up to 36.
// Where it runs (pbs_cluster_for): kernel PBS is built for latency, one wave of clusters doing few cells each; kernels P, B
// and S for throughput (kernel B's sweep spreads any number of cells over many blocks, and its per-cell work is a
// threshold test where PBS's is a key, a histogram count and a select test). Measured (H100, session 16, op bench,
// Llama-2 heads, 64 cells per thread at most then): B = 1 at 4k 60 vs 72 us, at 32k 92 vs 100, at 64k 134 vs 136, at
// 128k 212 vs 195; B = 8 slower at every length (e.g. 32k 372 vs 321). So PBS runs for n_kv <= 73728 (cpt <= 36) when
// every row's cluster is resident at once (measured so, B = 1: 4k 61 vs 72 us, 32k 91 vs 100); devices before Hopper
// and SPARQ_CUDA_PBS=0 run P, B and S. The bound was 32768 (cpt <= 16, multiples of 8) until session 17 found that a
// decode at depth 32k has n_kv 33024 (the cache view is padded), so end to end at "32k" PBS had not run; there it is
// worth more than the op bench shows (llama-bench tg at 32k: 7.36 vs 8.03 ms; op 96 vs 104 us): notes_cuda.md.
// Few long rows (GQA: 8 rows at B = 1) take clusters of 16 blocks (session 18, op with Llama-3 heads at 65792 cells:
// 83 us vs 97 with clusters of 8 and 91 with P, B, S). Versions and phase timings: bench/notes_cuda.md, sessions 16-18.
constexpr int PBS_THREADS = 256;
constexpr int PBS_MAX_CPT = 36;    // rows up to 73728 cells: decodes at depth 64k (n_kv 65792, padded) take PBS
constexpr int PBS_REG_CPT = 20;    // a thread's first logits held in registers during the merge (more would spill)
constexpr int PBS_BINS    = 256;  // 8-bit digits
static_assert(PBS_BINS == PBS_THREADS, "a thread per histogram bin");
static_assert(A_CHUNK % 8 == 0, "a thread's group of 4 cells lies in one chunk of kernel A");

// What a block publishes to its cluster (read by the others through distributed shared memory).
struct pbs_exchange {
    uint32_t hist[2][PBS_BINS];  // radix histogram of the pass; by parity, so one cluster barrier per pass suffices:
                                 // a block clears hist[p] in pass p + 2, after every block has passed pass p + 1's
                                 // barrier, i.e. finished reading pass p's
    int      n_w, n_s, n_sel;    // forced window and sink cells, selected cells
    float    alpha[MAX_G];       // the block's part of alpha_g
};

// cells per thread, a multiple of 4 (16-byte accesses), with clusters of cl blocks per row
__host__ __device__ inline int pbs_cpt(int64_t n_kv, int cl) {
    const int64_t per_thread = (n_kv + cl*PBS_THREADS - 1) / (cl*PBS_THREADS);
    return (int) ((per_thread + 3) / 4 * 4);
}
// A thread's keys in shared memory: cpt words and 4 or 8 of padding, a stride of 4 mod 8 words, so that the 16-byte
// accesses of 8 consecutive threads (one phase of a warp's vector access) fall on distinct banks.
__host__ __device__ inline int pbs_stride(int cpt) { return cpt % 8 == 0 ? cpt + 4 : cpt + 8; }
constexpr int PBS_VEC = PBS_REG_CPT / 4;  // 16-byte loads of a thread's logits in flight during the merge

// Four first-head logits from cell j (-inf past the row's end or without logits): one 16-byte load where aligned.
__device__ __forceinline__ uint4 pbs_logits4(const sparq_args & a, const float * lrow, int64_t n_kv, int64_t j) {
    if (a.has_logits && a.vec_logits && j + 4 <= n_kv) {
        return *(const uint4 *) (lrow + j);
    }
    uint32_t e4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        e4[e] = a.has_logits && j + e < n_kv ? __float_as_uint(lrow[j + e]) : __float_as_uint(-INFINITY);
    }
    return make_uint4(e4[0], e4[1], e4[2], e4[3]);
}

// The bin of this thread's cluster-wide histogram (bin 255 - tid: the scans run from the top bin down), the sum of the
// cluster's blocks' hist[bin], read through distributed shared memory.
#if SPARQ_PBS_BUILT
template <int CL>
__device__ __forceinline__ uint32_t pbs_cluster_bin(const cooperative_groups::cluster_group & cluster, uint32_t * hist) {
    uint32_t cnt = 0;
#pragma unroll
    for (int b0 = 0; b0 < CL; b0 += 8) {
        uint32_t part[8];
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            part[b] = cluster.map_shared_rank(hist, b0 + b)[PBS_BINS - 1 - threadIdx.x];
        }
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            cnt += part[b];
        }
    }
    return cnt;
}
#endif  // SPARQ_PBS_BUILT

template <int CL>  // blocks per row (cluster size): 8 or 16
__global__ void __launch_bounds__(PBS_THREADS, 3) sparq_pbs(const sparq_args a, const sparq_scratch s, int64_t r0) {
    static_assert(CL == 8 || CL == 16, "a warp's lanes read the cluster's blocks");
#if SPARQ_PBS_BUILT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    extern __shared__ __align__(16) uint32_t keys[];  // [PBS_THREADS][stride]: logits, then 0 hidden / score keys
    __shared__ pbs_exchange ex;
    __shared__ float rst[2*MAX_G];
    __shared__ int64_t redl[96];
    __shared__ int red[32];
    __shared__ bool pos_chunk[PBS_MAX_CPT*PBS_THREADS/A_CHUNK + 2];  // the A chunks this block's cells meet (a span
                                                                     // not on chunk edges meets up to 2 more than
                                                                     // span / A_CHUNK): can any of their cells be forced
    __shared__ float fred[32];  // block_reduce of alpha_g's parts
    __shared__ uint32_t bin_found[3];  // the pass's boundary bin, the items above it, the items in it
    __shared__ int64_t row_sum[3];     // from the cluster: forced window cells, sink cells; selected cells before this block
    __shared__ uint32_t hist[HIST_WORDS];  // kernel S's exact selection (first block, rows that need it)
    __shared__ select_state sst;
    SPARQ_TIMING_MARKS(10);
    SPARQ_TL_SCOPE(TL_PBS);
    pdl_wait();
    SPARQ_TL_WAITED();
    pdl_release();
    SPARQ_TIMING_MARK(0);
    const int rank = (int) cluster.block_rank();
    const int64_t w = blockIdx.x / CL;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, n_kv = a.n_kv, k2 = a.p.k2;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int cpt = pbs_cpt(n_kv, CL);
    const int64_t base = rank*(int64_t) cpt*PBS_THREADS, j0 = base + (int64_t) tid*cpt;  // this thread: [j0, j0 + cpt)
    uint32_t * mine = keys + tid*pbs_stride(cpt);
    const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
    const float * lrow = s.logits + w*G*n_kv;

    // 1. the first head's logits of this thread's cells (the first PBS_REG_CPT), in flight during the merge
    uint4 raw_l[PBS_VEC];
#pragma unroll
    for (int v = 0; v < PBS_VEC; ++v) {
        raw_l[v] = 4*v < cpt ? pbs_logits4(a, lrow, n_kv, j0 + 4*v) : make_uint4(0, 0, 0, 0);
    }
    const row_merge rm = merge_chunk_stats(a, s, w, rst, rank == 0, redl);
    SPARQ_TIMING_MARK(1);
    const int64_t kind = rm.n_vis == 0 ? ROW_EMPTY : rm.n_vis <= k2 ? ROW_DENSE : ROW_SPARSE;
    const int64_t w_lo = rm.p_max - a.window, s_hi = rm.p_min + a.sinks;  // window: pos > w_lo; sinks: pos < s_hi
    int64_t * ri = s.rinfo + w*N_RI;
    if (rank == 0 && tid == 0) {
        ri[RI_KIND] = kind;
        ri[RI_N_VIS] = rm.n_vis;
        ri[RI_W_LO] = w_lo;
        ri[RI_S_HI] = s_hi;
    }
    if (kind == ROW_EMPTY) {  // the same in every block: no exchange
        if (rank == 0 && tid == 0) {
            ri[RI_N_SEL] = 0;
        }
        return;
    }
    const bool sparse = kind == ROW_SPARSE, find_cand = sparse && a.n_top > 0;
    const uint16_t * m = mask_row(a, c);
    const int32_t * pr = pos_row(a, c);
    const int64_t ch0 = base / A_CHUNK;  // a block's span need not start or end at a chunk's edge (cpt % 8 == 4)
    const int n_chunks_block = (int) ((base + (int64_t) cpt*PBS_THREADS - 1) / A_CHUNK - ch0 + 1);
    for (int i = tid; i < n_chunks_block; i += PBS_THREADS) {
        const int64_t ch = ch0 + i;
        const int32_t * cv = s.cvis + (w*a.n_chunks_a + ch)*3;
        pos_chunk[i] = ch < a.n_chunks_a && sparse && cv[0] > 0 && ((int64_t) cv[2] > w_lo || (int64_t) cv[1] < s_hi);
    }
    ex.hist[0][tid] = 0;
#pragma unroll
    for (int v = 0; v < PBS_VEC; ++v) {
        if (4*v < cpt) {
            *(uint4 *) (mine + 4*v) = raw_l[v];
        }
    }
    for (int u0 = 4*PBS_VEC; u0 < cpt; u0 += 4) {  // rows of more than PBS_REG_CPT cells per thread: the rest now
        *(uint4 *) (mine + u0) = pbs_logits4(a, lrow, n_kv, j0 + u0);
    }
    __syncthreads();

    // 2. keys in place of the logits, forced bits, the exponents' histogram (the first digit of K)
    uint64_t forced = 0;
    int64_t n_ws = 0;  // forced window cells + (sink cells << 32)
    for (int u0 = 0; u0 < cpt; u0 += 4) {
        const bool need_pos = pos_chunk[(j0 + u0) / A_CHUNK - ch0];  // 4 cells never straddle a chunk's edge
        const uint4 raw = *(const uint4 *) (mine + u0);
        int64_t cells[4];
        float score[4] = { __uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z), __uint_as_float(raw.w) };
        bool vis[4], scored[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int64_t j = cells[u] = j0 + u0 + u;
            vis[u] = score[u] != -INFINITY || (j < n_kv && visible(m, j));
            const int64_t pj = need_pos && vis[u] ? position(pr, j) : 0;
            const bool in_w = sparse && vis[u] && need_pos && pj > w_lo;
            const bool in_s = sparse && vis[u] && need_pos && pj < s_hi;
            n_ws += (int64_t) in_w + ((int64_t) in_s << 32);
            const bool mark = kind == ROW_DENSE ? vis[u] : (in_w || in_s);
            forced |= (uint64_t) mark << (u0 + u);
            scored[u] = sparse && a.has_logits && vis[u];  // forced cells too: their scores go into alpha_g
        }
        // group scores as kernel B: the first head from the logit (0 + x, as group_scores), then the other heads
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            score[u] = scored[u] ? 0.0f + __expf(score[u] - rst[0]) * rst[G] : 0.0f;
        }
        if (G > 1) {
            group_scores(lrow, n_kv, G, rst, cells, scored, score, 1);
        }
        uint32_t key[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            key[u] = scored[u] ? score_key(score[u]) : (vis[u] ? 1u : 0u);
            if (find_cand && vis[u] && !((forced >> (u0 + u)) & 1)) {
                atomicAdd(&ex.hist[0][key[u] >> 23], 1u);  // K's top 8 of 31 + cell_bits bits: the key's bits 30..23
            }
        }
        *(uint4 *) (mine + u0) = make_uint4(key[0], key[1], key[2], key[3]);
    }
    n_ws = block_reduce(n_ws, op_add(), (int64_t) 0, redl);
    if (tid == 0) {
        ex.n_w = (int) (n_ws & 0xFFFFFFFF);
        ex.n_s = (int) (n_ws >> 32);
    }
    SPARQ_TIMING_MARK(2);

    // 3. the cluster's sums: the forced counts, the first digit's histogram; the boundary bin; further passes
    cluster.sync();  // also: every block of the cluster runs, so its shared memory can be read
    if (warp == 0) {
        const pbs_exchange * o = cluster.map_shared_rank(&ex, lane % CL);
        int64_t nw_b = lane < CL ? o->n_w : 0, ns_b = lane < CL ? o->n_s : 0;
        nw_b = warp_reduce(nw_b, op_add());
        ns_b = warp_reduce(ns_b, op_add());
        if (lane == 0) {
            row_sum[0] = nw_b;
            row_sum[1] = ns_b;
        }
    }
    uint32_t cnt = find_cand ? pbs_cluster_bin<CL>(cluster, ex.hist[0]) : 0;
    __syncthreads();
    SPARQ_TIMING_MARK(3);
    // kernel S's condition for the fast path: exactly the window and the sinks forced, and disjoint
    const bool exact_all = sparse && !(row_sum[0] == a.window && row_sum[1] == a.sinks && w_lo >= s_hi - 1);
    const int total_bits = 31 + a.cell_bits;  // group scores are at most G <= 64: score_key < 2^31
    int sh = total_bits - 8, width = 8, par = 0, n_pass = 0;
    uint64_t prefix = 0;
    uint32_t top_digit = 0;  // the boundary's exponent (the first pass's bin)
    if (find_cand && !exact_all) {
        uint32_t need = (uint32_t) a.n_top;
        for (;;) {
            ++n_pass;
            int n_items = 0;
            const uint32_t above = (uint32_t) block_exclusive_scan((int) cnt, &n_items, red);
            if (above < need && above + cnt >= need) {
                bin_found[0] = PBS_BINS - 1 - tid; bin_found[1] = above; bin_found[2] = cnt;
            }
            __syncthreads();
            prefix = (prefix << width) | bin_found[0];
            top_digit = n_pass == 1 ? bin_found[0] : top_digit;
            need -= bin_found[1];
            if (bin_found[2] == need || sh == 0) {
                break;
            }
            const int sh_next = max(0, sh - 8);
            width = sh - sh_next;
            sh = sh_next;
            par ^= 1;
            uint32_t * h = ex.hist[par];
            h[tid] = 0;
            __syncthreads();
            for (int u0 = 0; u0 < cpt; u0 += 4) {
                const uint4 raw = *(const uint4 *) (mine + u0);
                const uint32_t k4[4] = { raw.x, raw.y, raw.z, raw.w };
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    if (k4[u] >> 23 == top_digit && k4[u] != 0 && !((forced >> (u0 + u)) & 1)) {
                        const uint64_t K = ((uint64_t) k4[u] << a.cell_bits) | (cmask - (uint64_t) (j0 + u0 + u));
                        if ((K >> (sh + width)) == prefix) {
                            atomicAdd(&h[(uint32_t) (K >> sh) & ((1u << width) - 1)], 1u);
                        }
                    }
                }
            }
            cluster.sync();
            cnt = pbs_cluster_bin<CL>(cluster, h);
        }
    }
    SPARQ_TIMING_MARK(4);

    // 4. the selected cells: forced, or candidates with K >= prefix << sh; this thread's cells are consecutive
    const uint64_t thr = prefix << sh;
    uint64_t sel = 0;
    float part_alpha = 0.0f;  // alpha_0's part (G = 1: the scores themselves)
    if (!exact_all) {
        for (int u0 = 0; u0 < cpt; u0 += 4) {
            const uint4 raw = *(const uint4 *) (mine + u0);
            const uint32_t k4[4] = { raw.x, raw.y, raw.z, raw.w };
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const bool f = (forced >> (u0 + u)) & 1;
                bool top = false;
                if (find_cand && k4[u] != 0 && !f && k4[u] >> 23 >= top_digit) {
                    const uint64_t K = ((uint64_t) k4[u] << a.cell_bits) | (cmask - (uint64_t) (j0 + u0 + u));
                    top = K >= thr;
                }
                sel |= (uint64_t) (f || top) << (u0 + u);
                if ((f || top) && G == 1 && a.has_logits) {
                    part_alpha += __uint_as_float(k4[u] - 1u);
                }
            }
        }
    }
    int n_sel_block = 0;
    const int at_thread = block_exclusive_scan(__popcll(sel), &n_sel_block, red);
    SPARQ_TIMING_MARK(5);
    // alpha_g's part of this block (sparse rows with the mean on), in a fixed order
    const bool want_alpha = sparse && a.p.mean_on && !exact_all;
    if (want_alpha) {
        for (int64_t g = 0; g < G; ++g) {
            float p = part_alpha;
            if (G > 1) {
                p = 0.0f;
                for (uint64_t bits = sel; bits; bits &= bits - 1) {
                    const int64_t j = j0 + __ffsll((long long) bits) - 1;
                    p += __expf(lrow[g*n_kv + j] - rst[g]) * rst[G + g];
                }
            }
            p = block_reduce(p, op_add(), 0.0f, fred);
            if (tid == 0) {
                ex.alpha[g] = p;
            }
        }
    }
    SPARQ_TIMING_MARK(6);
    if (tid == 0) {
        ex.n_sel = n_sel_block;
    }
    cluster.sync();
    if (warp == 0) {  // lane b: block b's count; this block's offset and the row's total
        const int n_b = lane < CL ? cluster.map_shared_rank(&ex, lane % CL)->n_sel : 0;
        const int64_t before = warp_reduce(lane < rank ? (int64_t) n_b : (int64_t) 0, op_add());
        const int64_t total = warp_reduce((int64_t) n_b, op_add());
        if (lane == 0) {
            row_sum[2] = before;
            if (rank == 0 && !exact_all) {
                ri[RI_N_SEL] = min(total, k2);
            }
        }
    }
    if (want_alpha && rank == 0) {
        for (int64_t g = tid; g < G; g += PBS_THREADS) {
            float sum = 0.0f;  // in rank order
#pragma unroll
            for (int b0 = 0; b0 < CL; b0 += 8) {
                float part[8];
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    part[b] = cluster.map_shared_rank(&ex, b0 + b)->alpha[g];
                }
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    sum += part[b];
                }
            }
            s.alpha[w*G + g] = sum;
        }
    }
    cluster.barrier_arrive();  // this block's reads of other blocks' shared memory are done; wait before exiting
    __syncthreads();  // row_sum[2]
    SPARQ_TIMING_MARK(7);
    int32_t * i2 = s.i2 + w*k2;
    if (!exact_all) {
        int64_t at = row_sum[2] + at_thread;
        for (uint64_t bits = sel; bits; bits &= bits - 1, ++at) {
            if (at < k2) {
                i2[at] = (int32_t) (j0 + __ffsll((long long) bits) - 1);
            }
        }
    } else if (rank == 0) {
        // positions not distinct: kernel S's exact selection over every cell, in this block
        select_all_cells(a, s, w, c, hist, &sst);
        const int n = i2_from_bitmap(a, s.bitmap + w*a.n_words, i2, red);
        __syncthreads();  // i2 (global) written by this block
        if (a.p.mean_on) {
            row_alpha(a, s, w, i2, n, rst);
        }
        if (tid == 0) {
            ri[RI_N_SEL] = n;
        }
    }
    SPARQ_TIMING_MARK(8);
    cluster.barrier_wait();
    SPARQ_TIMING_MARK(9);
#ifdef SPARQ_CUDA_INSTRUMENT
    if (a.timing && tid == 0 && w == 0 && rank == 0) {
        printf("PBS passes %d exact_all %d cpt %d\n", n_pass, (int) exact_all, cpt);
    }
#endif
    SPARQ_TIMING_PRINT("PBS: merge, keys+count, exchange, radix, select, alpha, exchange, i2, wait", w*CL + rank, 10);
#else
    NO_DEVICE_CODE;
#endif
}

// Kernel LV (grid: (slices of SLICE output components) x heads, rows): the exact logits of one head over I2
// into shared memory, then its softmax over I2 (recomputed by each block of the row, in a fixed order), the
// Sparse-V threshold, and the weighted sum of the V rows' slice: 8 components per thread, SLICE/8 threads per
// cell, the cell groups reduced through shared memory; then the mean-value mix.
// SLICE: 32 when the rows are few (one decode step of one sequence: more blocks per row shorten the row's chain);
// 128 when the 32-slices would fill more than a wave (batched decode: every block of a head recomputes the
// head's logits over I2, so wide slices do that work once instead of d_v/32 times). lv_slice() picks.
constexpr int V_THREADS = 256;
constexpr int V_SLICE_NARROW = 32;
constexpr int V_SLICE_WIDE   = 128;
template <int SLICE> __host__ __device__ constexpr int v_tpc()    { return SLICE / 8; }                 // threads per cell
template <int SLICE> __host__ __device__ constexpr int v_groups() { return V_THREADS / v_tpc<SLICE>(); } // cells in flight per round

// The logits: a group of tpr threads per cell (8 components per thread and vector), CIF cells in flight per group,
// the V rows' first slice loaded together with the K rows. Each block of the head reads the K rows over I2 (from L2
// after the first); v6b, measured against separate kernels L and V in bench/notes_cuda.md.
template <typename T, int VPT, int SLICE>
__global__ void __launch_bounds__(V_THREADS, 2) sparq_logits_values(const sparq_args a, const sparq_scratch s, int64_t r0) {
    constexpr int V_SLICE = SLICE, V_TPC = v_tpc<SLICE>(), V_GROUPS = v_groups<SLICE>();
    extern __shared__ __align__(16) unsigned char smlv[];  // [k2] I2, [k2] logits of head g
    __shared__ float red[32];
    __shared__ float part[V_GROUPS][V_SLICE];
    SPARQ_TL_SCOPE(TL_LV);
    pdl_wait();
    SPARQ_TL_WAITED();
    const int64_t w = blockIdx.y, G = a.group, d = a.d, d_v = a.d_v, k2 = a.p.k2;
    const int64_t n_slices = (d_v + V_SLICE - 1) / V_SLICE;
    const int64_t slice = blockIdx.x % n_slices, g = blockIdx.x / n_slices;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t * ri = s.rinfo + w*N_RI;
    const int64_t kind = ri[RI_KIND], n_sel = ri[RI_N_SEL];
    int32_t * i2 = (int32_t *) smlv;
    float   * lg = (float *) (smlv + k2*sizeof(int32_t));
    float * out = (float *) (a.dst + (c.h*G + g)*a.o_nb1 + c.t*a.o_nb2 + c.st*a.o_nb3);
    const int tid = threadIdx.x, grp = tid / V_TPC, lv = tid % V_TPC;
    const int64_t dim0 = slice*V_SLICE;
    if (kind == ROW_EMPTY) {
        if (tid < V_SLICE && dim0 + tid < d_v) {
            out[dim0 + tid] = 0.0f;
        }
        return;
    }
    for (int64_t i = tid; i < n_sel; i += blockDim.x) {
        i2[i] = s.i2[w*k2 + i];
    }
    const int tpr = threads_per_row(d), slots = blockDim.x / tpr, slot = tid / tpr, lr = tid % tpr;
    const float * qg = q_row(a, c.h*G + g, c);
    float qv[VPT][8];
#pragma unroll
    for (int vi = 0; vi < VPT; ++vi) {
        const int64_t e0 = (int64_t) (lr + vi*tpr)*8;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            qv[vi][e] = e0 + e < d ? qg[e0 + e] : 0.0f;
        }
    }
    __syncthreads();
    // this thread's V components of the first round of cells (grp, grp + V_GROUPS), loaded with the K rows
    const char * vb = a.v + c.h*a.v_nb2 + c.st*a.v_nb3;
    const int64_t e0v = dim0 + lv*8;
    float xv[2][8];
    auto load_v = [&](int64_t i0) {
#pragma unroll
        for (int uu = 0; uu < 2; ++uu) {
            const int64_t i = i0 + uu*V_GROUPS;
            if (i < n_sel) {
                load8_row((const T *) (vb + (int64_t) i2[i]*a.v_nb1), e0v, d_v, a.vec_kv, xv[uu]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    xv[uu][e] = 0.0f;
                }
            }
        }
    };
    load_v(grp);
    // exact logits of head g over I2: a group of tpr threads per cell, CIF cells in flight per group
    constexpr int CIF = (sizeof(T) == 4 ? 4 : 8) / VPT;
    const char * kb = a.k + c.h*a.k_nb2 + c.st*a.k_nb3;
    for (int64_t ib = 0; ib < n_sel; ib += CIF*slots) {
        raw8<T> x[CIF][VPT];
#pragma unroll
        for (int uu = 0; uu < CIF; ++uu) {
            const int64_t i = ib + uu*slots + slot;
            const T * row = (const T *) (kb + (int64_t) (i < n_sel ? i2[i] : 0)*a.k_nb1);
#pragma unroll
            for (int vi = 0; vi < VPT; ++vi) {
                const int64_t e0 = (int64_t) (lr + vi*tpr)*8;
                if (i < n_sel && e0 < d) {
                    load_raw8_row(row, e0, d, a.vec_kv, x[uu][vi]);
                } else {
                    x[uu][vi] = {};
                }
            }
        }
#pragma unroll
        for (int uu = 0; uu < CIF; ++uu) {
            const int64_t i = ib + uu*slots + slot;
            float dot = 0.0f;
#pragma unroll
            for (int vi = 0; vi < VPT; ++vi) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    dot += qv[vi][e] * raw8_at(x[uu][vi], e);
                }
            }
            for (int off = tpr/2; off > 0; off >>= 1) {
                dot += __shfl_xor_sync(0xFFFFFFFF, dot, off);
            }
            if (lr == 0 && i < n_sel) {
                lg[i] = logit_exact(a, dot);
            }
        }
    }
    __syncthreads();
    // softmax statistics and the Sparse-V cut (as kernel V)
    float mx = -INFINITY;
    for (int64_t i = tid; i < n_sel; i += blockDim.x) {
        mx = fmaxf(mx, lg[i]);
    }
    mx = block_reduce(mx, op_max(), -INFINITY, red);
    float sum = 0.0f;
    for (int64_t i = tid; i < n_sel; i += blockDim.x) {
        sum += __expf(lg[i] - mx);
    }
    sum = block_reduce(sum, op_add(), 0.0f, red);
    const float inv = 1.0f / sum;
    float keep = 0.0f, renorm = 1.0f;
    if (a.p.sparse_v_thresh > 0.0f) {
        keep = fminf(a.p.sparse_v_thresh, inv);
        float kept = 0.0f;
        for (int64_t i = tid; i < n_sel; i += blockDim.x) {
            const float p = __expf(lg[i] - mx) * inv;
            kept += p >= keep ? p : 0.0f;
        }
        renorm = 1.0f / block_reduce(kept, op_add(), 0.0f, red);
    }
    float acc[8] = {};
    for (int64_t i0 = grp; i0 < n_sel; i0 += 2*V_GROUPS) {
        if (i0 != grp) {
            load_v(i0);
        }
        float p[2];
#pragma unroll
        for (int uu = 0; uu < 2; ++uu) {
            const int64_t i = i0 + uu*V_GROUPS;
            p[uu] = 0.0f;
            if (i < n_sel) {
                const float wi = __expf(lg[i] - mx) * inv;
                p[uu] = wi >= keep ? wi * renorm : 0.0f;
            }
        }
#pragma unroll
        for (int uu = 0; uu < 2; ++uu) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                acc[e] += p[uu] * xv[uu][e];
            }
        }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        part[grp][lv*8 + e] = acc[e];
    }
    __syncthreads();
    if (tid < V_SLICE && dim0 + tid < d_v) {
        float y = 0.0f;
        for (int q = 0; q < V_GROUPS; ++q) {
            y += part[q][tid];
        }
        if (kind == ROW_SPARSE && a.p.mean_on) {
            const int64_t dim = dim0 + tid;
            float vmean;
            if (a.vsum) {
                const float * vs = (const float *) (a.vsum + c.h*a.vs_nb1 + c.t*a.vs_nb2 + c.st*a.vs_nb3);
                vmean = vs[d_v] > 0.0f ? vs[dim] / vs[d_v] : 0.0f;
            } else {
                const uint16_t * m = mask_row(a, c);
                float vsum = 0.0f;
                for (int64_t j = 0; j < a.n_kv; ++j) {
                    if (visible(m, j)) {
                        vsum += to_f32(((const T *) (vb + j*a.v_nb1))[dim]);
                    }
                }
                vmean = vsum / (float) ri[RI_N_VIS];
            }
            const float al = s.alpha[w*G + g];
            y = al*y + (1.0f - al)*vmean;
        }
        out[dim0 + tid] = y;
    }
}

// ---- host ------------------------------------------------------------------------------------------

// Opt a kernel into more than the default 48 KiB of shared memory (static + dynamic) when a launch needs it;
// once per kernel, device and size (the attribute is per device: with -sm layer each GPU needs its own).
template <auto kernel>
void ensure_smem(size_t bytes) {
    static size_t configured[GGML_CUDA_MAX_DEVICES] = {};  // one array per kernel instance
    const int device = ggml_cuda_get_device();
    if (bytes <= configured[device]) {
        return;
    }
    cudaFuncAttributes attr;
    CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    if (attr.sharedSizeBytes + bytes > 48*1024) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) bytes));
    }
    configured[device] = bytes;
}

template <typename T, int POL, int NG>
void launch_scores(dim3 grid, size_t smem, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s, int64_t r0) {
    ensure_smem<sparq_scores<T, POL, NG>>(smem);
    ggml_cuda_kernel_launch(sparq_scores<T, POL, NG>, ggml_cuda_kernel_launch_params(grid, A_THREADS, smem, stream), a, s, r0);
}

template <typename T, int POL>
void launch_scores_ng(int ng, dim3 grid, size_t smem, cudaStream_t stream, const sparq_args & a,
                      const sparq_scratch & s, int64_t r0) {
    switch (ng) {
        case 1:  launch_scores<T, POL, 1>(grid, smem, stream, a, s, r0); break;
        case 2:  launch_scores<T, POL, 2>(grid, smem, stream, a, s, r0); break;
        case 4:  launch_scores<T, POL, 4>(grid, smem, stream, a, s, r0); break;
        default: launch_scores<T, POL, 8>(grid, smem, stream, a, s, r0); break;
    }
}

// Kernel LV's slice width (see the kernel): 32 unless the 32-slices of these rows make more than one wave of
// V_MIN_BLOCKS-per-SM blocks. Measured on the H100 (session 13, op bench, Llama-2 heads): B = 1 at 32k narrow 94 /
// wide 97 us; B = 4 at 8k 112 / 104; B = 8 at 8k 158 / 141.5 (LV alone 42.7 / 18.7 us under ncu).
// SPARQ_CUDA_LV_SLICE=32|128 (a.lv_slice) forces one (A/B runs, tests of both paths).
constexpr int V_MIN_BLOCKS = 2;
int lv_slice(const sparq_args & a, int64_t nw) {
    const int64_t n_narrow = ((a.d_v + V_SLICE_NARROW - 1) / V_SLICE_NARROW) * a.group * nw;
    const int64_t wave = (int64_t) ggml_cuda_info().devices[ggml_cuda_get_device()].nsm * V_MIN_BLOCKS;
    return n_narrow > wave ? V_SLICE_WIDE : V_SLICE_NARROW;
}

template <typename T, int VPT, int SLICE>
void launch_lv(int64_t nw, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s, int64_t r0) {
    const dim3 grid_v((unsigned) (((a.d_v + SLICE - 1) / SLICE) * a.group), (unsigned) nw);
    const size_t smem_lv = 2*sizeof(float)*a.p.k2;
    ensure_smem<sparq_logits_values<T, VPT, SLICE>>(smem_lv);
    ggml_cuda_kernel_launch(sparq_logits_values<T, VPT, SLICE>, ggml_cuda_kernel_launch_params(grid_v, V_THREADS, smem_lv, stream),
                            a, s, r0);
}

template <typename T>
void launch_logits_values(int vpt, int slice, int64_t nw, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s,
                          int64_t r0) {
    const bool wide = slice == V_SLICE_WIDE;
    switch (vpt) {
        case 1:  wide ? launch_lv<T, 1, V_SLICE_WIDE>(nw, stream, a, s, r0) : launch_lv<T, 1, V_SLICE_NARROW>(nw, stream, a, s, r0); break;
        case 2:  wide ? launch_lv<T, 2, V_SLICE_WIDE>(nw, stream, a, s, r0) : launch_lv<T, 2, V_SLICE_NARROW>(nw, stream, a, s, r0); break;
        default: wide ? launch_lv<T, 4, V_SLICE_WIDE>(nw, stream, a, s, r0) : launch_lv<T, 4, V_SLICE_NARROW>(nw, stream, a, s, r0); break;
    }
}

// Kernel PBS's dynamic shared memory at cpt cells per thread: the keys of a block's cells.
size_t pbs_smem(int cpt) { return sizeof(uint32_t) * pbs_stride(cpt)*PBS_THREADS; }

#if SPARQ_PBS_BUILT
// A launch of kernel PBS for nw rows at cpt cells per thread: clusters of cl blocks, dependent on its predecessor by
// ggml_cuda_kernel_launch's rules (GGML_CUDA_USE_PDL; GGML_CUDA_PDL=0 turns it off) where `dependent`.
struct pbs_launch {
    cudaLaunchAttribute attrs[2];
    cudaLaunchConfig_t  cfg = {};

    pbs_launch(int64_t nw, int cl, int cpt, cudaStream_t stream, bool dependent) {
        cfg.gridDim = dim3((unsigned) (nw*cl));
        cfg.blockDim = dim3(PBS_THREADS);
        cfg.dynamicSmemBytes = pbs_smem(cpt);
        cfg.stream = stream;
        attrs[0].id = cudaLaunchAttributeClusterDimension;
        attrs[0].val.clusterDim.x = cl;
        attrs[0].val.clusterDim.y = 1;
        attrs[0].val.clusterDim.z = 1;
        cfg.attrs = attrs;
        cfg.numAttrs = 1;
#if defined(GGML_CUDA_USE_PDL)
        static const bool pdl = [] {
            const char * e = getenv("GGML_CUDA_PDL");
            return e == nullptr || atoi(e) != 0;
        }();
        if (dependent && pdl) {
            attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attrs[1].val.programmaticStreamSerializationAllowed = 1;
            cfg.numAttrs = 2;
        }
#else
        GGML_UNUSED(dependent);
#endif
    }
    pbs_launch(const pbs_launch &) = delete;  // cfg points at attrs
    pbs_launch & operator=(const pbs_launch &) = delete;
};

// How many clusters of CL blocks at the largest size are resident at once on the current device (0: none)
template <int CL>
int pbs_resident_clusters() {
    if (CL > 8) {  // 16 is Hopper's non-portable size: the kernel opts in
        if (cudaFuncSetAttribute(sparq_pbs<CL>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
            (void) cudaGetLastError();
            return 0;
        }
    }
    ensure_smem<sparq_pbs<CL>>(pbs_smem(PBS_MAX_CPT));
    const pbs_launch l(1, CL, PBS_MAX_CPT, nullptr, false);
    int n_clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&n_clusters, sparq_pbs<CL>, &l.cfg) != cudaSuccess) {
        n_clusters = 0;
    }
    (void) cudaGetLastError();  // a refused query leaves no error behind
    return n_clusters;
}
#endif  // SPARQ_PBS_BUILT

// Rows longer than this many cells per thread at clusters of 8 take clusters of 16 where those fit (pbs_cluster_for)
constexpr int PBS_CL16_FROM_CPT = 20;

// The cluster size kernel PBS takes for nw rows of n_kv cells on the current device, 0 for kernels P, B and S (see the
// kernel): Hopper or later with the kernel built for it (a cluster launch), rows of at most PBS_MAX_CPT cells per thread,
// every row's cluster resident at once (the occupancy of the largest size, once per device), and not switched off
// (SPARQ_CUDA_PBS=0: kernels P, B and S, for A/B runs). Clusters of 16 halve the cells per thread of few long rows
// (GQA models: 8 rows whose 8-block clusters would leave half the SMs idle); SPARQ_CUDA_PBS_CLUSTER=8 or 16 prefers
// that size wherever it fits, for A/B runs.
int pbs_cluster_for(int64_t n_kv, int64_t nw) {
    if (!SPARQ_PBS_BUILT) {
        return 0;
    }
#if SPARQ_PBS_BUILT
    static int resident[GGML_CUDA_MAX_DEVICES][2] = {};  // clusters of 8, of 16 (0: none, or not Hopper)
    static bool known[GGML_CUDA_MAX_DEVICES] = {};
    const int device = ggml_cuda_get_device();
    if (!known[device]) {
        known[device] = true;
        cudaFuncAttributes attr;
        CUDA_CHECK(cudaFuncGetAttributes(&attr, sparq_pbs<8>));
        if (ggml_cuda_info().devices[device].cc >= GGML_CUDA_CC_HOPPER && attr.binaryVersion >= 90) {
            resident[device][0] = pbs_resident_clusters<8>();
            resident[device][1] = pbs_resident_clusters<16>();
        }
    }
    const bool fits8  = pbs_cpt(n_kv, 8)  <= PBS_MAX_CPT && nw <= resident[device][0];
    const bool fits16 = pbs_cpt(n_kv, 16) <= PBS_MAX_CPT && nw <= resident[device][1];
    if (fits16 && (!fits8 || pbs_cpt(n_kv, 8) > PBS_CL16_FROM_CPT)) {
        return 16;
    }
    return fits8 ? 8 : 0;
#else
    GGML_UNUSED(n_kv); GGML_UNUSED(nw);
    return 0;
#endif  // SPARQ_PBS_BUILT
}

// Kernel PBS: a cluster of cl blocks per row, launched dependent on kernel A as the other kernels are
// (ggml_cuda_kernel_launch's rules: GGML_CUDA_PDL=0 turns dependent launches off).
template <int CL>
void launch_pbs(int64_t nw, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s, int64_t r0) {
#if SPARQ_PBS_BUILT
    const pbs_launch l(nw, CL, pbs_cpt(a.n_kv, CL), stream, true);
    ensure_smem<sparq_pbs<CL>>(l.cfg.dynamicSmemBytes);
    CUDA_CHECK(cudaLaunchKernelEx(&l.cfg, sparq_pbs<CL>, a, s, r0));
#else
    GGML_UNUSED(nw); GGML_UNUSED(stream); GGML_UNUSED(a); GGML_UNUSED(s); GGML_UNUSED(r0);
    (void) sparq_pbs<CL>;
    GGML_ABORT("kernel PBS is not built (pbs_cluster_for returns 0)");
#endif  // SPARQ_PBS_BUILT
}

template <typename T>
void launch_all(int pol, int ng, int vpt, dim3 grid_a, size_t smem_a, int64_t nw, size_t smem_s, cudaStream_t stream,
                const sparq_args & a, const sparq_scratch & s, int64_t r0) {
    switch (pol) {
        case SC_NONE:   launch_scores<T, SC_NONE, 1>(grid_a, smem_a, stream, a, s, r0); break;
        case SC_KT:     launch_scores_ng<T, SC_KT>    (ng, grid_a, smem_a, stream, a, s, r0); break;
        case SC_GATHER: launch_scores_ng<T, SC_GATHER>(ng, grid_a, smem_a, stream, a, s, r0); break;
        default:        launch_scores_ng<T, SC_EXACT> (ng, grid_a, smem_a, stream, a, s, r0); break;
    }
    const int pbs_cl = pbs_cluster_for(a.n_kv, nw);
    if (pbs_cl == 16) {
        launch_pbs<16>(nw, stream, a, s, r0);
    } else if (pbs_cl == 8) {
        launch_pbs<8>(nw, stream, a, s, r0);
    } else {
        const dim3 rows((unsigned) nw), grid_b((unsigned) a.n_chunks_b, (unsigned) nw);
        ggml_cuda_kernel_launch(sparq_prepare, ggml_cuda_kernel_launch_params(rows, A_THREADS, 0, stream), a, s, r0);
        ggml_cuda_kernel_launch(sparq_sweep, ggml_cuda_kernel_launch_params(grid_b, B_THREADS, sizeof(uint64_t)*B_CHUNK, stream),
                                a, s, r0);
        ensure_smem<sparq_select>(smem_s);
        ggml_cuda_kernel_launch(sparq_select, ggml_cuda_kernel_launch_params(rows, B_THREADS, smem_s, stream), a, s, r0);
    }
    launch_logits_values<T>(vpt, lv_slice(a, nw), nw, stream, a, s, r0);
}

bool aligned16(const void * p) { return ((uintptr_t) p & 15) == 0; }
bool strides16(const ggml_tensor * t) { return t->nb[1] % 16 == 0 && t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0; }

// Scratch of one wave: each array 256-byte aligned.
struct scratch_plan {
    size_t qs, i1, logits, cmax, csum, cvis, rstat, rinfo, counters, bitmap, cand, forced, i2, alpha, total;
};
scratch_plan plan_scratch(const sparq_args & a, bool scores, int64_t W) {
    const int64_t G = a.group;
    scratch_plan p;
    size_t o = 0;
    auto take = [&](size_t bytes) { const size_t at = o; o += (bytes + 255) & ~size_t(255); return at; };
    p.qs       = take(sizeof(float) * W*G*a.p.k1);
    p.i1       = take(sizeof(int32_t) * W*a.p.k1);
    p.logits   = take(scores ? sizeof(float) * W*G*a.n_kv : 0);
    p.cmax     = take(sizeof(float) * W*G*a.n_chunks_a);
    p.csum     = take(sizeof(float) * W*G*a.n_chunks_a);
    p.cvis     = take(sizeof(int32_t) * W*a.n_chunks_a*3);
    p.rstat    = take(sizeof(float) * W*2*G);
    p.rinfo    = take(sizeof(int64_t) * W*N_RI);
    p.counters = take(sizeof(uint32_t) * W*N_CTR);
    p.bitmap   = take(sizeof(uint32_t) * W*a.n_words);
    p.cand     = take(a.n_top > 0 ? sizeof(uint64_t) * W*a.cap : 0);
    p.forced   = take(sizeof(int32_t) * W*a.p.k2);
    p.i2       = take(sizeof(int32_t) * W*a.p.k2);
    p.alpha    = take(sizeof(float) * W*G);
    p.total    = o;
    return p;
}

}  // namespace

bool ggml_cuda_sparq_attn_supported(int device, const ggml_tensor * op) {
    const ggml_tensor * q = op->src[0], * k = op->src[1], * kt = op->src[2], * v = op->src[3];
    const ggml_tensor * mask = op->src[4], * vsum = op->src[5], * pos = op->src[6];
    const bool kv_type_ok = k->type == GGML_TYPE_F32 || k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_BF16;
    if (q->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32 || !kv_type_ok || v->type != k->type ||
        (kt && kt->type != k->type) || (mask && mask->type != GGML_TYPE_F16) ||
        (vsum && vsum->type != GGML_TYPE_F32) || (pos && pos->type != GGML_TYPE_I32)) {
        return false;
    }
    for (const ggml_tensor * t : { q, k, kt, v, mask, vsum, pos }) {
        if (t && t->nb[0] != ggml_type_size(t->type)) {
            return false;
        }
    }
    const int64_t d = q->ne[0], G = q->ne[2] / k->ne[2];
    if (!ggml_is_contiguous(op) || d > MAX_HEAD_DIM || v->ne[0] > MAX_HEAD_DIM || G > MAX_G) {
        return false;
    }
    // kernel S keeps the candidate keys and I2 in shared memory
    const ggml_sparq_op_params p = ggml_sparq_get_op_params(op);
    const size_t smem_s = smem_s_plan(candidate_cap(p.k2), p.k2).total + 12*1024;  // + static
    return smem_s <= ggml_cuda_info().devices[device].smpbo;
}

void ggml_cuda_sparq_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0], * k = dst->src[1], * kt = dst->src[2], * v = dst->src[3];
    const ggml_tensor * mask = dst->src[4], * vsum = dst->src[5], * pos = dst->src[6];
    GGML_ASSERT(ggml_cuda_sparq_attn_supported(ctx.device, dst));

    sparq_args a = {};
    a.q = (const char *) q->data; a.k = (const char *) k->data; a.kt = kt ? (const char *) kt->data : nullptr;
    a.v = (const char *) v->data; a.mask = mask ? (const char *) mask->data : nullptr;
    a.vsum = vsum ? (const char *) vsum->data : nullptr; a.pos = pos ? (const char *) pos->data : nullptr;
    a.dst = (char *) dst->data;
    a.d = q->ne[0]; a.n_q = q->ne[1]; a.n_head = q->ne[2]; a.ns = q->ne[3];
    a.n_kv = k->ne[1]; a.n_head_kv = k->ne[2]; a.d_v = v->ne[0]; a.group = a.n_head / a.n_head_kv;
    a.q_nb1 = q->nb[1]; a.q_nb2 = q->nb[2]; a.q_nb3 = q->nb[3];
    a.k_nb1 = k->nb[1]; a.k_nb2 = k->nb[2]; a.k_nb3 = k->nb[3];
    if (kt) {
        a.kt_nb1 = kt->nb[1]; a.kt_nb2 = kt->nb[2]; a.kt_nb3 = kt->nb[3];
    }
    a.v_nb1 = v->nb[1]; a.v_nb2 = v->nb[2]; a.v_nb3 = v->nb[3];
    if (mask) {
        a.m_nb1 = mask->nb[1]; a.m_nb3 = mask->nb[3]; a.m_ns = mask->ne[3];
    }
    if (vsum) {
        a.vs_nb1 = vsum->nb[1]; a.vs_nb2 = vsum->nb[2]; a.vs_nb3 = vsum->nb[3];
    }
    if (pos) {
        a.p_nb3 = pos->nb[3]; a.p_ns = pos->ne[3];
    }
    a.o_nb1 = dst->nb[1]; a.o_nb2 = dst->nb[2]; a.o_nb3 = dst->nb[3];
    a.p = ggml_sparq_get_op_params(dst);
    a.sinks  = a.p.sinks;
    a.window = a.p.policy == GGML_SPARQ_POLICY_WINDOW ? a.p.k2 - a.p.sinks : a.p.window;
    a.n_top  = std::max(0, a.p.k2 - a.window - a.sinks);
    a.cell_bits = 1;
    while ((int64_t(1) << a.cell_bits) < a.n_kv) {
        ++a.cell_bits;
    }
    a.n_chunks_a = (int32_t) ((a.n_kv + A_CHUNK - 1) / A_CHUNK);
    a.n_chunks_b = (int32_t) ((a.n_kv + B_CHUNK - 1) / B_CHUNK);
    a.n_words    = (a.n_kv + 31) / 32;
    a.cap        = candidate_cap(a.p.k2);
    a.vec_kt     = kt && aligned16(kt->data) && strides16(kt);
    a.vec_kv     = aligned16(k->data) && strides16(k) && aligned16(v->data) && strides16(v);
    a.vec_logits = a.n_kv % 4 == 0;
    a.vec_mask   = mask && aligned16(mask->data) && mask->nb[1] % 16 == 0 && mask->nb[3] % 16 == 0;
    a.vec_pos    = pos && aligned16(pos->data) && pos->nb[3] % 16 == 0;
#ifdef SPARQ_CUDA_INSTRUMENT
    a.timing     = getenv("SPARQ_CUDA_TIMING") != nullptr;
    static const bool timeline = getenv("SPARQ_CUDA_TIMELINE") != nullptr;
    a.timeline = timeline;
#endif

    const bool scores = a.p.policy != GGML_SPARQ_POLICY_WINDOW || a.p.mean_on;
    a.has_logits = scores;
    const int pol = !scores ? SC_NONE : a.p.policy != GGML_SPARQ_POLICY_SPARQ ? SC_EXACT : kt ? SC_KT : SC_GATHER;
    const int64_t G = a.group;
    const int ng = G >= 8 ? 8 : G >= 4 ? (G == 4 ? 4 : 8) : G >= 2 ? (G == 2 ? 2 : 4) : 1;
    const int64_t n_vec = (a.d + 7) / 8;  // kernel LV: K vectors of 8 components per thread
    const int vpt = n_vec <= 32 ? 1 : n_vec <= 64 ? 2 : 4;

    const int64_t n_rows = a.n_head_kv * a.n_q * a.ns;
    const int64_t row_bytes = plan_scratch(a, scores, 1).total;
    const int64_t W = std::max<int64_t>(1, std::min<int64_t>({ n_rows, 65535, WAVE_BYTES / row_bytes }));
    const scratch_plan plan = plan_scratch(a, scores, W);
    ggml_cuda_pool_alloc<char> buf(ctx.pool(), plan.total);
    char * base = buf.get();
    sparq_scratch s;
    s.qs       = (float *)    (base + plan.qs);
    s.i1       = (int32_t *)  (base + plan.i1);
    s.logits   = (float *)    (base + plan.logits);
    s.cmax     = (float *)    (base + plan.cmax);
    s.csum     = (float *)    (base + plan.csum);
    s.cvis     = (int32_t *)  (base + plan.cvis);
    s.rstat    = (float *)    (base + plan.rstat);
    s.rinfo    = (int64_t *)  (base + plan.rinfo);
    s.counters = (uint32_t *) (base + plan.counters);
    s.bitmap   = (uint32_t *) (base + plan.bitmap);
    s.cand     = (uint64_t *) (base + plan.cand);
    s.forced   = (int32_t *)  (base + plan.forced);
    s.i2       = (int32_t *)  (base + plan.i2);
    s.alpha    = (float *)    (base + plan.alpha);

    const size_t smem_q = sizeof(float) * (query_fast(a.d, a.group) ? a.group + 2 : 2)*a.d;
    const size_t smem_a = sizeof(float) * ng*std::max<int64_t>(a.p.k1, a.d);
    const size_t smem_s = smem_s_plan(a.cap, a.p.k2).total;
    cudaStream_t stream = ctx.stream();
    for (int64_t r0 = 0; r0 < n_rows; r0 += W) {
        const int64_t nw = std::min(W, n_rows - r0);
        const dim3 grid_a((unsigned) a.n_chunks_a, (unsigned) nw);
        if (pol == SC_KT || pol == SC_GATHER) {
            ggml_cuda_kernel_launch(sparq_query, ggml_cuda_kernel_launch_params(dim3((unsigned) nw), A_THREADS, smem_q, stream),
                                    a, s, r0);
        }
        switch (k->type) {
            case GGML_TYPE_F32:  launch_all<float>      (pol, ng, vpt, grid_a, smem_a, nw, smem_s, stream, a, s, r0); break;
            case GGML_TYPE_F16:  launch_all<half>       (pol, ng, vpt, grid_a, smem_a, nw, smem_s, stream, a, s, r0); break;
            default:             launch_all<nv_bfloat16>(pol, ng, vpt, grid_a, smem_a, nw, smem_s, stream, a, s, r0); break;
        }
#ifdef SPARQ_CUDA_INSTRUMENT
        if (a.timeline) {
            sparq_timeline_dump<<<1, 1, 0, stream>>>(a.n_kv, nw);
        }
#endif
        CUDA_CHECK(cudaGetLastError());
    }
}
