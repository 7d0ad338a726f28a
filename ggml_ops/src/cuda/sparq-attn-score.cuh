// Kernel A of the CUDA SparQ op (included by sparq-attn.cu only; the op's files: sparq-attn-common.cuh), a grid of
// chunks of A_CHUNK cells x rows: the approximate logits of each chunk (from K^T rows at I1 with kernel Q's scaled
// query components (sparq-attn-query.cuh), gathered K components, the q4 index's integer dot products, or exact dot
// products for the exact and window policies), the chunk's softmax max and sum per head, and its visible-cell count
// and position range. docs/design.md, "CUDA kernels".
#pragma once

#include "sparq-attn-common.cuh"

namespace {

// Kernel A: K^T rows in flight per thread (16 bytes of each for f16/bf16) and warps per SM (the register
// budget: 64K / (32 * warps) per thread; a_min_blocks below). For K^T, 16 warps of 16 rows in flight beat 24 warps
// of 8 (H100, Llama-2 heads: 36.4 vs 39.2 us at 32k, 58.6 vs 65.3 at 64k): half the DRAM round trips per
// block, and 16 warps per SM made 1.94 waves of the 32k grid where 24 made 1.29, whose last 0.29 wave ran ~12 us
// alone at a fraction of the bandwidth. With 3-4 heads per pass (GQA, G = 4) 8 rows in flight fit
// 128 registers without spill but make Llama-3's kernel A slower (26.7 vs 24.7 us at 33024 cells, 31.1 vs 27.4 at
// 65792), so 4 stay.
template <typename T, int NG> __host__ __device__ constexpr int a_unroll() {
    return (NG <= 2 ? 16 : 4) / (sizeof(T) == 4 ? 2 : 1);
}
// Kernel A's blocks per SM, counted in warps: A_SM_WARPS (16) for K^T (above) and for 4-8 heads per pass; the gather
// and exact scores of 1-2 heads keep 24 (no rows in flight to trade for it: more warps hide their per-cell round
// trips), and so does the q8_0 index copied by warps (T = q8_warp: its rows wait in shared memory, not in registers)
// for 1-2 heads per pass, where its 72 registers and ~37 KB of shared memory (a_warp_smem) let 6 blocks share an SM:
// H100, Llama-2 heads, 131072 cells, 157 us against 161-165 with the 4 blocks of the instance that also read the index
// by threads (128 registers for its 16 rows in flight). With 4 heads per pass, 24 warps held it to 80 registers and a
// stack, and Llama-3 heads at 131072 cells took 101-104.5 us against 97.5-98.5 at 16.
struct q8_warp {};
template <typename T, int POL, int NG> constexpr int a_min_blocks() {
    if constexpr (std::is_same_v<T, q8_warp>) {
        return (NG <= 2 ? 3*A_SM_WARPS/2 : A_SM_WARPS) / A_WARPS;
    }
    return (POL == SC_KT || POL == SC_Q4 || NG > 2 ? A_SM_WARPS : 3*A_SM_WARPS/2) / A_WARPS;
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

// Value e (0-3) of 4 int8 values as a float, exactly (float) (int8_t) byte, from the word with each byte offset by 128
// (word ^ 0x80808080): the offset byte u becomes the low byte of the float 2^23 + u (one byte permute), then 2^23 + 128
// is subtracted (exact). Two full-rate instructions a value, where the integer-to-float conversion runs at a quarter
// of the FMA rate: with the q8 index's two components per f16 one, the conversions bound kernel A otherwise.
__device__ __forceinline__ uint32_t i8_bias(uint32_t word) { return word ^ 0x80808080u; }
__device__ __forceinline__ float i8_as_f32(uint32_t biased_word, int e) {
    return __uint_as_float(__byte_perm(biased_word, 0x4B000000u, 0x7440u | (uint32_t) e)) - 8388736.0f;
}

// A q8_0 index (K^T rows as ggml's q8_0 blocks of 32 cells): a thread's 8 cells lie in one block (j0 is a multiple
// of 8), kept as loaded, the block's f16 scale and the 8 int8 values. raw8_at gives the int8 value as a float; the
// scale goes into the query coefficient (q_i * d, then times the value), as the CPU kernel folds it: the same
// products, one multiply per block rather than per cell. A thread alone can read the 34-byte blocks only in 2-byte
// pieces; where K^T is 16-byte aligned its warp copies them whole instead (q8_scores_warp below).
template <> struct raw8<block_q8_0> { uint2 q; half d; };
__device__ __forceinline__ float raw8_at(const raw8<block_q8_0> & r, int i) {
    return i8_as_f32(i8_bias(i < 4 ? r.q.x : r.q.y), i % 4);
}

// Cells [j0, j0 + 8) of a K^T row (the byte address of the row): 16-byte streaming loads of a float index, the block's
// scale and values of a q8_0 index.
template <typename T>
__device__ __forceinline__ void load_kt8(const char * row, int64_t j0, raw8<T> & r, uint64_t pol) {
    if constexpr (std::is_same_v<T, block_q8_0>) {
        GGML_UNUSED(pol);
        const block_q8_0 * b = (const block_q8_0 *) row + j0 / QK8_0;
        r.d = b->d;
        r.q = bytes8_at((const uint8_t *) b->qs + j0 % QK8_0);
    } else {
        load_raw8_stream((const T *) row + j0, r, pol);
    }
}

// ---- kernel A: a q8_0 index read by warps ---------------------------------------------------------------
// Where K^T is 16-byte aligned with strides of whole 16 bytes (a.vec_kt_q8), a warp's 256 cells of a row are 8 whole
// blocks, 272 contiguous bytes starting at a multiple of 16: Q8_WARP_PIECES lanes copy them with 16-byte asynchronous
// copies (cp.async) into the warp's area of shared memory, Q8_ROWS rows a stage in a ring of Q8_RING stages (the next
// rows' copies fly while the current ones are used, and no registers wait for them), and each thread reads its block's
// scale and 8 values from there. A thread reading its own block takes 5 two-byte loads per row, and with half of f16's
// bytes in flight per load it left kernel A latency bound: the q8 index at k1 = 64 took the time of the f16 index at
// k1 = 64, twice its bytes (H100, Llama-2 heads: 101 vs 88 us for the op at 32k against the f16 index at k1 = 32, the
// same bytes; 255 vs 193 at 128k).
constexpr int Q8_WARP_BLOCKS = WARP_SIZE*A_CELLS/QK8_0;
constexpr int Q8_WARP_BYTES  = Q8_WARP_BLOCKS*(int) sizeof(block_q8_0);
constexpr int Q8_WARP_PIECES = Q8_WARP_BYTES/16;
constexpr int Q8_STAGE_ROW   = Q8_WARP_BYTES + 16;  // + a piece: a thread reads its 8 values as 3 aligned words
static_assert(QK8_0 % A_CELLS == 0, "a thread's cells lie in one block");
static_assert(Q8_WARP_BYTES % 16 == 0 && Q8_WARP_PIECES <= WARP_SIZE, "a warp's blocks are whole 16-byte pieces");
// K^T rows per stage, and stages in a warp's ring: Q8_RING - 1 stages (24 rows) are in flight while one is used. Two
// stages of 16 rows (8 with 3 or more heads per pass) left kernel A latency bound where rows are few: with Llama-3
// heads (8 KV heads, B = 1) it streamed 0.5 TB/s at 32k, each warp waiting on 8 round trips of 8 rows (H100, the op's
// timeline: kernel A 34 us at 32k, 67 us at 128k). The ring takes the same shared memory as two stages of 16 rows.
constexpr int Q8_ROWS = 8;
constexpr int Q8_RING = 4;
// Kernel A's query components of a head in shared memory: k1 rounded up to whole stages of Q8_ROWS rows, the rows past
// k1 zero (and I1 there row k1 - 1), so that the q8 warp loop needs no test per row: a zero coefficient times the finite
// values of a real row adds +0 and leaves every sum's bits as they are.
__host__ __device__ constexpr int a_qs_stride(int k1) { return (k1 + Q8_ROWS - 1) / Q8_ROWS * Q8_ROWS; }
// Kernel A's dynamic shared memory: the query components (or rows), then the q4 index's coefficients where SC_Q4
__host__ __device__ constexpr size_t a_qs_bytes(int ng, int64_t k1, int64_t d) {
    return ((sizeof(float)*ng*(a_qs_stride((int) k1) > d ? a_qs_stride((int) k1) : d)) + 15) & ~size_t(15);
}
__host__ __device__ constexpr size_t a_stage_bytes() { return size_t(A_WARPS)*Q8_RING*Q8_ROWS*Q8_STAGE_ROW; }
// The q8_warp instance's dynamic shared memory, all of its shared memory but the reductions' few words: the query
// components (NG x a_qs_stride(k1)), I1 (a_qs_stride(k1) rows) and the warps' rings
__host__ __device__ constexpr size_t a_warp_qs_bytes(int ng, int k1) { return (sizeof(float)*ng*a_qs_stride(k1) + 15) & ~size_t(15); }
__host__ __device__ constexpr size_t a_warp_i1_bytes(int k1) { return (sizeof(uint32_t)*a_qs_stride(k1) + 15) & ~size_t(15); }
__host__ __device__ constexpr size_t a_warp_smem(int ng, int k1) {
    return a_warp_qs_bytes(ng, k1) + a_warp_i1_bytes(k1) + a_stage_bytes();
}

// The first src_bytes (0-16) of 16 bytes copied from global to shared memory asynchronously, the rest zero-filled;
// the copies' group commit and wait (each thread for its own copies; a barrier then shares them). The copies are
// evict-first in L2, as the loads are (each row is read once a step): without the policy the loop alone's copies took
// up to 3.5 us more, a plain stream of the same bytes up to 3.6 us more (cuda_kernel_a_l2_policy.json). The policy is
// made in the same statement as each copy: made once and passed in (as l2_evict_first does for the loads), ptxas 13.0
// (sm_90) assembled kernel A's 8-head instance into copies whose policy register was never written, which trapped
// (compute-sanitizer: illegal instruction). Only the q8_warp instance copies, and the host launches it only where the
// device's compiled code has the copies (a.vec_kt_q8: NVIDIA, sm_80 and later).
__device__ __forceinline__ void copy16_async(void * dst, const void * src, int src_bytes) {
#ifdef CP_ASYNC_AVAILABLE
    const unsigned sdst = (unsigned) __cvta_generic_to_shared(dst);
    asm volatile("{\n\t.reg .b64 pol;\n\tcreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n\t"
                 "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, pol;\n\t}"
                 :: "r"(sdst), "l"(src), "r"(src_bytes) : "memory");
#else
    GGML_UNUSED(dst); GGML_UNUSED(src); GGML_UNUSED(src_bytes);
    NO_DEVICE_CODE;
#endif
}
__device__ __forceinline__ void copies_commit() {
#ifdef CP_ASYNC_AVAILABLE
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void copies_wait() {
#ifdef CP_ASYNC_AVAILABLE
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// K^T row i from base: one 32 x 32 -> 64-bit multiply-add (the host keeps kt_nb1 below 2^32), where a 64-bit product
// took ~10 instructions a row in the q8 warp loop
__device__ __forceinline__ const char * kt_row(const char * base, uint32_t i, const sparq_args & a) {
    return base + (uint64_t) i * (uint32_t) a.kt_nb1;
}

// The q8_0 index's products of the warp's cells from first_cell (a multiple of 256) into acc, as kernel A's thread
// loop makes them (the same products in the same order, so the same bits). Blocks past the row's end are zero-filled:
// their cells do not exist and are hidden.
template <int NG>
__device__ void q8_scores_warp(const sparq_args & a, const char * ktb, const uint32_t * i1_buf, const float * qs,
                               int64_t first_cell, uint8_t * stage, float (&acc)[NG][A_CELLS]) {
    constexpr int U = Q8_ROWS;
    const int lane = threadIdx.x % WARP_SIZE, k1 = a.p.k1, qstride = a_qs_stride(k1);
    const int64_t first_block = first_cell / QK8_0, n_blocks = (a.n_kv + QK8_0 - 1) / QK8_0;
    const int n_valid = (int) (n_blocks - first_block < Q8_WARP_BLOCKS ? n_blocks - first_block : Q8_WARP_BLOCKS);
    const int piece = min(max(n_valid*(int) sizeof(block_q8_0) - 16*lane, 0), 16);
    const char * src = piece > 0 ? ktb + first_block*(int64_t) sizeof(block_q8_0) + 16*lane : ktb;  // a valid address
    const int n_stages = (k1 + U - 1) / U;
    // stage t's copies into its ring slot, as one commit group; past the last stage an empty group, so that every
    // round commits one and the wait below always leaves Q8_RING - 1 groups in flight
    const auto issue = [&](int t) {
        if (t < n_stages && lane < Q8_WARP_PIECES) {
#pragma unroll
            for (int uu = 0; uu < U; ++uu) {
                copy16_async(stage + ((t % Q8_RING)*U + uu)*Q8_STAGE_ROW + 16*lane,
                             kt_row(src, i1_buf[t*U + uu], a), piece);
            }
        }
        copies_commit();
    };
    // the thread's block scale and values within a row's stage: 8 values from an even offset, as 3 words shifted
    const int blk = (int) sizeof(block_q8_0)*(lane / (QK8_0/A_CELLS));
    const int val = blk + (int) sizeof(half) + A_CELLS*(lane % (QK8_0/A_CELLS));
    const int shift = 8*(val % 4);
#pragma unroll
    for (int t = 0; t < Q8_RING - 1; ++t) {
        issue(t);
    }
#pragma unroll 1
    for (int t = 0; t < n_stages; ++t) {
        issue(t + Q8_RING - 1);  // into the slot used in round t - 1 (released by that round's last __syncwarp)
        copies_wait<Q8_RING - 1>();  // stage t's group is complete
        __syncwarp();
        const int i = t*U;
#pragma unroll
        for (int uu = 0; uu < U; ++uu) {  // rows past k1: zero coefficients (a_qs_stride)
            const uint8_t * row = stage + ((t % Q8_RING)*U + uu)*Q8_STAGE_ROW;
            const float xscale = __half2float(*(const half *) (row + blk));
            const uint32_t * w = (const uint32_t *) (row + (val & ~3));
            const uint32_t lo = i8_bias(__funnelshift_r(w[0], w[1], shift));
            const uint32_t hi = i8_bias(__funnelshift_r(w[1], w[2], shift));
            float xf[A_CELLS];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                xf[u]     = i8_as_f32(lo, u);
                xf[4 + u] = i8_as_f32(hi, u);
            }
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                const float qv = __fmul_rn(qs[g*qstride + i + uu], xscale);
#pragma unroll
                for (int u = 0; u < A_CELLS; ++u) {
                    acc[g][u] += qv * xf[u];
                }
            }
        }
        __syncwarp();  // the slot is refilled by the next round's copies
    }
}

// The index's products of a thread's cells [j0, j0 + A_CELLS) into acc, each thread reading its own cells of a_unroll
// K^T rows at a time: 16-byte streaming loads of a float index, the block's scale and values of a q8_0 index.
template <typename T, int NG>
__device__ void kt_scores_thread(const sparq_args & a, const char * ktb, const uint32_t * i1_buf, const float * qs,
                                 int64_t j0, float (&acc)[NG][A_CELLS]) {
    constexpr bool KT_Q8 = std::is_same_v<T, block_q8_0>;
    const int k1 = a.p.k1, qstride = a_qs_stride(k1);
    const int64_t n_kv = a.n_kv;
    const bool vec = KT_Q8 ? j0 < n_kv : a.vec_kt && j0 + A_CELLS <= n_kv;
    constexpr int A_UNROLL = a_unroll<T, NG>();
#pragma unroll 1
    for (int i = 0; i < k1; i += A_UNROLL) {
        raw8<T> x[A_UNROLL];
        if (vec) {
            const uint64_t pol = l2_evict_first();  // one instruction: cheaper than a register pair in the loop
#pragma unroll
            for (int uu = 0; uu < A_UNROLL; ++uu) {
                load_kt8(kt_row(ktb, i1_buf[min(i + uu, k1 - 1)], a), j0, x[uu], pol);
            }
        }
#pragma unroll
        for (int uu = 0; uu < A_UNROLL; ++uu) {
            if (i + uu >= k1) {
                continue;
            }
            float xf[A_CELLS];
            float xscale = 1.0f;  // a q8_0 block's scale, folded into the query coefficient below
            if constexpr (KT_Q8) {
                xscale = vec ? __half2float(x[uu].d) : 0.0f;
            }
            if (vec) {
#pragma unroll
                for (int u = 0; u < A_CELLS; ++u) {
                    xf[u] = raw8_at(x[uu], u);
                }
            } else if constexpr (KT_Q8) {
#pragma unroll
                for (int u = 0; u < A_CELLS; ++u) {
                    xf[u] = 0.0f;  // none of the thread's cells exists
                }
            } else {
                const T * row = (const T *) kt_row(ktb, i1_buf[i + uu], a);
#pragma unroll
                for (int u = 0; u < A_CELLS; ++u) {
                    xf[u] = j0 + u < n_kv ? to_f32(row[j0 + u]) : 0.0f;
                }
            }
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                const float qv = KT_Q8 ? __fmul_rn(qs[g*qstride + i + uu], xscale) : qs[g*qstride + i + uu];
#pragma unroll
                for (int u = 0; u < A_CELLS; ++u) {
                    acc[g][u] += qv * xf[u];
                }
            }
        }
    }
}

// ---- kernel A: the q4 index ----------------------------------------------------------------------------
// ggml-sparq.h, "The q4 index". A warp's 256 cells are 8 of its blocks of 32 cells, 4 threads a block (a thread's 8
// cells, as everywhere in kernel A). Per head of the pass, the block's 4 threads make its int8 query coefficients, a
// quarter of the components each (the products with the scales, their max over the 4 lanes, the rounding), into the
// warp's area of shared memory; then each thread reads its cells' nibble words, 8 cells of one word row in two 16-byte
// loads, and takes two dp4a per cell, word and head. The same float operations as the CPU's, unfused, so the same
// coefficients, integer sums and logits.
constexpr int Q4_CELLS    = GGML_SPARQ_Q4_CELLS;
constexpr int Q4_THREADS  = Q4_CELLS / A_CELLS;              // threads of a block
constexpr int Q4_WARP_BLK = WARP_SIZE / Q4_THREADS;          // blocks of a warp
constexpr int Q4_MAX_HEAD_DIM = 256;                         // a thread's quarter of the scales stays in registers
static_assert(Q4_CELLS % A_CELLS == 0 && WARP_SIZE % Q4_THREADS == 0, "a thread's cells lie in one block");
// The warp's coefficients: per block, head and word a pair of int8x4 (components 8w..8w+3 and 8w+4..8w+7), a block's
// stride padded by one pair so that the 8 blocks' reads of one word fall in different banks
__host__ __device__ constexpr int q4_blk_stride(int ng, int64_t d) { return ng*(int) (d/8) + 1; }
__host__ __device__ constexpr size_t q4_coef_bytes(int ng, int64_t d) {
    return size_t(A_WARPS)*Q4_WARP_BLK*q4_blk_stride(ng, d)*sizeof(int2);
}

// x rounded to the nearest integer, ties to even (as the CPU's lrintf), exact for |x| < 2^22: the float sum with
// 1.5 * 2^23 holds the integer in its low mantissa bits; its low byte is the int8 two's complement of it.
__device__ __forceinline__ uint32_t q4_rint_bits(float x) { return __float_as_uint(__fadd_rn(x, 12582912.0f)); }

// The int8 coefficients of the thread's quarter of the components for NG heads (query rows in qs [NG][d]) of the block
// at blk (nullptr: past the row's blocks, coefficients 0), into coef; each head's unit m/127 and sum of coefficients.
template <int NG>
__device__ void q4_coefficients(const sparq_args & a, const float * qs, const uint8_t * blk, int2 * coef,
                                float (&unit)[NG], int (&a_sum)[NG]) {
    const int d = (int) a.d, quarter = d / Q4_THREADS, p = threadIdx.x % Q4_THREADS;
    uint4 sraw[Q4_MAX_HEAD_DIM / Q4_THREADS / 8];  // the quarter's f16 scales, 8 a load
#pragma unroll
    for (int l = 0; l < Q4_MAX_HEAD_DIM / Q4_THREADS / 8; ++l) {
        sraw[l] = blk && 8*l < quarter ? ((const uint4 *) (blk + 16*d + 2*p*quarter))[l] : make_uint4(0, 0, 0, 0);
    }
    const half * sc = (const half *) sraw;
#pragma unroll
    for (int g = 0; g < NG; ++g) {
        const float * qg = qs + g*d + p*quarter;
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < Q4_MAX_HEAD_DIM / Q4_THREADS; ++i) {
            if (i < quarter) {
                m = fmaxf(m, fabsf(__fmul_rn(qg[i], __half2float(sc[i]))));
            }
        }
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFF, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFF, m, 2));
        static_assert(Q4_THREADS == 4, "two butterfly steps");
        const float inv = m > 0.0f ? __fdiv_rn(127.0f, m) : 0.0f;  // m = 0: every coefficient 0, every logit +0
        unit[g] = m > 0.0f ? __fdiv_rn(m, 127.0f) : 0.0f;
        int sum = 0;
#pragma unroll
        for (int w = 0; w < Q4_MAX_HEAD_DIM / Q4_THREADS / 8; ++w) {
            if (8*w >= quarter) {
                continue;
            }
            uint32_t half_word[2];
#pragma unroll
            for (int hw = 0; hw < 2; ++hw) {
                uint32_t b[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int i = 8*w + 4*hw + j;
                    b[j] = q4_rint_bits(__fmul_rn(__fmul_rn(qg[i], __half2float(sc[i])), inv));
                }
                half_word[hw] = __byte_perm(__byte_perm(b[0], b[1], 0x0040), __byte_perm(b[2], b[3], 0x0040), 0x5410);
                sum = __dp4a((int) half_word[hw], 0x01010101, sum);
            }
            coef[g*(d/8) + p*quarter/8 + w] = make_int2((int) half_word[0], (int) half_word[1]);
        }
        sum += __shfl_xor_sync(0xFFFFFFFF, sum, 1);
        sum += __shfl_xor_sync(0xFFFFFFFF, sum, 2);
        a_sum[g] = sum;
    }
}

// A thread's 8 cells of R word rows from w0 (rows past nw, or no block: zero), as 16-byte streaming loads
template <int R>
__device__ __forceinline__ void q4_load_rows(const uint4 * words, int w0, int nw, uint64_t pol, uint4 (&x)[R][2]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const bool in = words && w0 + r < nw;
        x[r][0] = in ? load16_stream(words + 8*(w0 + r), pol) : make_uint4(0, 0, 0, 0);
        x[r][1] = in ? load16_stream(words + 8*(w0 + r) + 1, pol) : make_uint4(0, 0, 0, 0);
    }
}

// dot += the R word rows' products with the coefficients (two dp4a per cell, word row and head)
template <int NG, int R>
__device__ __forceinline__ void q4_dot_rows(const int2 * coef, int nw_head, int w0, int nw, const uint4 (&x)[R][2],
                                            int (&dot)[NG][A_CELLS]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (w0 + r >= nw) {
            continue;
        }
        const uint32_t xw[A_CELLS] = { x[r][0].x, x[r][0].y, x[r][0].z, x[r][0].w,
                                       x[r][1].x, x[r][1].y, x[r][1].z, x[r][1].w };
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            const int2 cf = coef[g*nw_head + w0 + r];
#pragma unroll
            for (int u = 0; u < A_CELLS; ++u) {
                dot[g][u] = __dp4a(cf.x, (int) (xw[u] & 0x0F0F0F0Fu), dot[g][u]);
                dot[g][u] = __dp4a(cf.y, (int) ((xw[u] >> 4) & 0x0F0F0F0Fu), dot[g][u]);
            }
        }
    }
}

// The logits scale * s_hat of a thread's cells [j0, j0 + A_CELLS) for NG heads into acc (q4 index rows at ktb, the
// row's KV head and stream). coef: the warp's coefficient area. The first R word rows are requested before the
// coefficients are made, and from then on the next R rows fly while the current ones are used (two register buffers):
// made first and then read row group by row group, the loads waited a round trip per group and kernel A took the q8
// index's time for about half its bytes (H200, Llama-2 heads at 32k: 40.1 against 39.5 us).
template <int NG>
__device__ void q4_scores_thread(const sparq_args & a, const char * ktb, const float * qs, int64_t j0, int2 * coef_warp,
                                 float (&acc)[NG][A_CELLS]) {
    constexpr int R = NG >= 4 ? 2 : 4;  // word rows a group: two groups' loads and the sums fit the registers
    const int d = (int) a.d, nw = d/8, lane = threadIdx.x % WARP_SIZE, bb = lane / Q4_THREADS;
    const int64_t b = j0 / Q4_CELLS, n_blk = (a.n_kv + Q4_CELLS - 1) / Q4_CELLS;
    const uint8_t * blk = b < n_blk ? (const uint8_t *) kt_row(ktb, (uint32_t) b, a) : nullptr;
    // word row w of cell c at u32 32*w + c: the thread's 8 cells of a row are two 16-byte pieces
    const uint4 * words = blk ? (const uint4 *) blk + (j0 % Q4_CELLS) / 4 : nullptr;
    const uint64_t pol = l2_evict_first();
    uint4 x0[R][2], x1[R][2];
    q4_load_rows<R>(words, 0, nw, pol, x0);
    int2 * coef = coef_warp + bb*q4_blk_stride(NG, d);
    float unit[NG];
    int a_sum[NG];
    q4_coefficients<NG>(a, qs, blk, coef, unit, a_sum);
    __syncwarp();
    int dot[NG][A_CELLS];
#pragma unroll
    for (int g = 0; g < NG; ++g) {
#pragma unroll
        for (int u = 0; u < A_CELLS; ++u) {
            dot[g][u] = 0;
        }
    }
#pragma unroll 1
    for (int w0 = 0; w0 < nw; w0 += 2*R) {
        q4_load_rows<R>(words, w0 + R, nw, pol, x1);
        q4_dot_rows<NG, R>(coef, nw, w0, nw, x0, dot);
        q4_load_rows<R>(words, w0 + 2*R, nw, pol, x0);
        q4_dot_rows<NG, R>(coef, nw, w0 + R, nw, x1, dot);
    }
#pragma unroll
    for (int g = 0; g < NG; ++g) {
#pragma unroll
        for (int u = 0; u < A_CELLS; ++u) {
            acc[g][u] = __fmul_rn(a.p.scale, __fmul_rn(unit[g], (float) (dot[g][u] - 8*a_sum[g])));
        }
    }
    __syncwarp();  // the coefficients are rewritten by the next pass
}

// Kernel A: the mask and positions of a thread's cells [j0, j0 + A_CELLS), loaded as they are (16-byte loads
// where a.vec_mask / a.vec_pos allow and the 8 cells exist) before the block's first barrier and used after
// it, so that they, I1 and the query components take one round trip (rather than the positions waiting for the
// mask and the query for both). Elsewhere cells_use reads them one by one.
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

// ---- kernel A: scores ------------------------------------------------------------------------------

// Heads g0 .. g0+NG of the row into shared memory (heads from h_hi on: zero): scaled components at I1 (SparQ) or
// whole rows (exact).
template <int POL, int NG>
__device__ void load_query_pass(const sparq_args & a, const sparq_scratch & s, int64_t w, const row_coords & c,
                                int64_t g0, int64_t h_hi, bool first, float * qs) {
    const int64_t G = a.group, d = a.d;
    const int k1 = a.p.k1;
    if (!first) {
        __syncthreads();  // qs of the previous pass is no longer read (none before the first: its loads go out with I1's)
    }
    if (POL == SC_KT || POL == SC_GATHER) {
        const int qstride = a_qs_stride(k1);
        for (int idx = threadIdx.x; idx < NG*qstride; idx += blockDim.x) {
            const int gg = idx / qstride, i = idx % qstride;
            qs[idx] = g0 + gg >= h_hi || i >= k1 ? 0.0f : s.qs[(w*G + g0 + gg)*k1 + i];
        }
    } else if (POL == SC_EXACT || POL == SC_Q4) {
        for (int64_t idx = threadIdx.x; idx < NG*d; idx += blockDim.x) {
            const int64_t gg = idx / d, i = idx % d;
            qs[idx] = g0 + gg < h_hi ? q_row(a, c.h*G + g0 + gg, c)[i] : 0.0f;
        }
    }
    __syncthreads();
}

// Kernel A (grid: chunks of A_CHUNK cells times a.a_head_groups x rows; A_THREADS threads, A_CELLS cells each).
// Block x is chunk x / a_head_groups and does the heads of group x % a_head_groups (G / a_head_groups heads; the
// chunk's visible count and position range come from group 0). Per pass of NG heads:
// the approximate logits of the chunk's cells, -inf for hidden cells, and the chunk's max and sum of exponentials
// per head (where kernel BS selects, also each thread's max per head); once per block the chunk's visible count and
// position range. Phases, each chosen so that a block spends its life with K^T loads in flight:
//   prologue: I1, the first pass's query components, the mask and the positions in one round trip (one barrier);
//   K^T rows a_unroll at a time (evict-first, no L1);
//   epilogue: one barrier for every head's block max, one for the sums; the visible count and position range
//   ride along (their warp results are in shared memory since the prologue). The reduction trees are
//   block_reduce's (warp butterfly, then the A_WARPS warp results in lanes 0 .. A_WARPS-1 of one butterfly), so
//   the statistics are bit for bit those of one block_reduce per value (rather than 5 block reductions per head and
//   pass, 3 barriers each).
template <typename T, int POL, int NG>
__global__ void __launch_bounds__(A_THREADS, a_min_blocks<T, POL, NG>()) sparq_scores(const sparq_args a, const sparq_scratch s, int64_t r0) {
    constexpr bool WARP_Q8 = std::is_same_v<T, q8_warp>;
    static_assert(!WARP_Q8 || POL == SC_KT, "the q8_0 index's warp copies are K^T scores");
    extern __shared__ float qs[];  // [NG][a_qs_stride(k1)] scaled components, or [NG][d] query rows
    __shared__ float red_max[NG][A_WARPS], red_sum[NG][A_WARPS];
    __shared__ int   red_cells[3][A_WARPS];  // visible count, smallest and largest position per warp
    pdl_wait();
    // I1; with K^T up to a_qs_stride(k1), row k1 - 1 past k1 (see there). The q8_warp instance's in its dynamic shared
    // memory (a_warp_smem), so that 6 blocks fit an SM (1-2 heads a pass).
    __shared__ uint32_t i1_static[WARP_Q8 ? 1 : MAX_HEAD_DIM];
    uint32_t * i1_buf = WARP_Q8 ? (uint32_t *) ((uint8_t *) qs + a_warp_qs_bytes(NG, a.p.k1)) : i1_static;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t w = blockIdx.y, chunk = blockIdx.x / a.a_head_groups;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, d = a.d, n_kv = a.n_kv;
    const int64_t h_lo = (blockIdx.x % a.a_head_groups)*(G / a.a_head_groups), h_hi = h_lo + G / a.a_head_groups;
    const int k1 = a.p.k1, qstride = a_qs_stride(k1);
    if (POL == SC_KT) {
        for (int i = threadIdx.x; i < qstride; i += blockDim.x) {
            i1_buf[i] = s.i1[w*k1 + min(i, k1 - 1)];
        }
    } else if (POL == SC_GATHER) {
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
    load_query_pass<POL, NG>(a, s, w, c, h_lo, h_hi, true, qs);
    cells_use(a, m, pr, j0, cr, vis, n_vis, p_min, p_max);
    n_vis = warp_reduce(n_vis, op_add());
    p_min = warp_reduce(p_min, op_min());
    p_max = warp_reduce(p_max, op_max());
    if (lane == 0) {
        red_cells[0][warp] = n_vis; red_cells[1][warp] = p_min; red_cells[2][warp] = p_max;
    }
    for (int64_t g0 = h_lo; g0 < h_hi; g0 += NG) {
        if (g0 > h_lo) {
            load_query_pass<POL, NG>(a, s, w, c, g0, h_hi, false, qs);
        }
        float acc[NG][A_CELLS];
#pragma unroll
        for (int g = 0; g < NG; ++g) {
#pragma unroll
            for (int u = 0; u < A_CELLS; ++u) {
                acc[g][u] = 0.0f;
            }
        }
        if constexpr (POL == SC_Q4) {
            int2 * coef = (int2 *) ((uint8_t *) qs + a_qs_bytes(NG, k1, d)) + warp*Q4_WARP_BLK*q4_blk_stride(NG, d);
            q4_scores_thread<NG>(a, a.kt + c.h*a.kt_nb2 + c.st*a.kt_nb3, qs, j0, coef, acc);
        } else if constexpr (POL == SC_KT) {
            // k1 rows of K^T: a q8_0 index copied by warps where it is aligned for that, else each thread reads 8
            // consecutive cells of a row with one 16-byte load (two for f32; a q8_0 index: its block's scale and 8
            // values), a_unroll rows in flight. A q8_0 row is padded to whole blocks, so a thread's 8 cells are there
            // wherever the first one exists (those past n_kv are hidden).
            const char * ktb = a.kt + c.h*a.kt_nb2 + c.st*a.kt_nb3;
            if constexpr (WARP_Q8) {
                uint8_t * stage = (uint8_t *) qs + a_warp_qs_bytes(NG, k1) + a_warp_i1_bytes(k1) +
                                  (size_t) warp*(a_stage_bytes()/A_WARPS);
                q8_scores_warp<NG>(a, ktb, i1_buf, qs, j0 - (int64_t) lane*A_CELLS, stage, acc);
            } else {
                kt_scores_thread<T, NG>(a, ktb, i1_buf, qs, j0, acc);
            }
        } else {
            // default layout (gather k1 components of each row-major K row) or exact scores; K of a quantized type
            // (T = kv_any): each component dequantized from its block
            const auto k_at = [&](const char * krow, int64_t i) {
                if constexpr (std::is_same_v<T, kv_any>) {
                    return dequant1(krow, a.k_type, i);
                } else {
                    return to_f32(((const T *) krow)[i]);
                }
            };
#pragma unroll
            for (int u = 0; u < A_CELLS; ++u) {
                const int64_t j = j0 + u;
                if (j >= n_kv) {
                    continue;
                }
                const char * krow = a.k + j*a.k_nb1 + c.h*a.k_nb2 + c.st*a.k_nb3;
                if constexpr (POL == SC_GATHER) {
                    for (int i = 0; i < k1; ++i) {
                        const float x = k_at(krow, i1_buf[i]);
#pragma unroll
                        for (int g = 0; g < NG; ++g) {
                            acc[g][u] += qs[g*qstride + i] * x;
                        }
                    }
                } else {
                    for (int64_t i = 0; i < d; ++i) {
                        const float x = k_at(krow, i);
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
        // reductions run side by side (warp_reduce_n: one after another, this epilogue took ~3.6 us per block);
        // a pass's heads past the group (g0 + g >= h_hi) are reduced too and not written.
        float mx[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            mx[g] = -INFINITY;
#pragma unroll
            for (int u = 0; u < A_CELLS; ++u) {
                acc[g][u] = (vis >> u) & 1 ? acc[g][u] : -INFINITY;
                mx[g] = fmaxf(mx[g], acc[g][u]);
            }
            if (g0 + g >= h_hi) {
                continue;
            }
            if (a.write_bmax) {  // this thread's cells are kernel BS's block j0 / A_CELLS
                s.bmax[(w*G + g0 + g)*a.n_chunks_a*A_THREADS + chunk*A_THREADS + threadIdx.x] = mx[g];
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
                    if (g0 + g < h_hi) {
                        s.cmax[(w*G + g0 + g)*a.n_chunks_a + chunk] = mx[g];
                        s.csum[(w*G + g0 + g)*a.n_chunks_a + chunk] = sum[g];
                    }
                }
            }
            if (g0 == 0) {  // group 0, its first pass
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

}  // namespace
