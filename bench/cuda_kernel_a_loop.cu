// Kernel A's score loop over the q8 index alone, in a harness of its own (bench/cuda_kernel_a_loop.py builds and runs
// it): the float loop of sparq-attn-score.cuh (int8 values converted to float, the block's scale folded into the query
// coefficient, one FMA a value and head) against an alternative compiled in:
//   -DCOPY_ONLY absent: integer dot products (per head and 32-cell block the coefficients q_i * s_i,b rounded to int8
//     with one scale, as the q4 index does; each thread's 4 component rows x 8 cells transposed by byte permutes into
//     8 words of 4 components, one dp4a a word and head; every row's block scale read first);
//   -DCOPY_ONLY: the ring's copies alone (one word of each stage read): the loop's memory floor; with -DCOPY_CONTIG
//     each warp's rows taken from one contiguous share of the index's bytes instead of the gathered K^T rows (the
//     copies' form, not their pattern), with -DCOPY_LDG the same pieces read by 16-byte loads into registers, 16 rows
//     a lane in flight, instead of the asynchronous copies (their pattern, not their form);
//   -DSTREAM=1: the same bytes read as one contiguous stream by plain 16-byte loads (16 a lane in flight), a warp's
//     share (64 rows x 272 bytes) on the kernel's grid: the card's read rate for these bytes with the kernel's blocks;
//   -DSTREAM=2: the same stream on one wave of blocks (16 warps an SM) that loop over the warps' shares: without the
//     kernel's waves of short-lived blocks.
// -DEVICT_FIRST_N=1 / 0: the index read with / without L2's evict-first policy, the float loop's copies too (default
// -1: the stream's loads only); -DSTREAM_OCC_N=N: the stream's blocks an SM held to N by shared memory.
// RING_N stages of ROWS_N rows a warp (default 4 x 8, the kernel's), WARPS_N warps a block (default 4, the kernel's;
// a block's chunk is 256 cells a warp, 16 warps an SM's register budget), SM_BLOCKS_N the float loop's and the
// alternative's launch bound, blocks an SM (default 16 / WARPS_N: the registers of 4 blocks of 4 warps; 8 asks for
// 64 registers, so that the grid of Llama-2 heads at 33024 cells, 1056 blocks, is one wave of 132 SMs where the
// ring's shared memory allows it: 3 x 8 rows). Same grid, warps, cells per thread and
// asynchronous-copy ring as the real kernel; each writes the logits and each 8-cell block's maximum, nothing else.
// Checks the float and integer results against a host reference, then times both, interleaved, with the caches warm
// (back to back) and cold (a 256 MiB memset before each launch). One JSON line per case on stdout, with both kernels'
// blocks an SM.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -cudart static [-DCOPY_ONLY [-DCOPY_CONTIG] [-DCOPY_LDG] | -DSTREAM=1 | -DSTREAM=2]
//       [-DEVICT_FIRST_N=1] [-DRING_N=4 -DROWS_N=8 -DWARPS_N=4 -DTILES_N=1 -DSM_BLOCKS_N=4] -o loop \
//       cuda_kernel_a_loop.cu
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

#ifndef WARPS_N
#define WARPS_N 4
#endif
constexpr int QK = 32, BLK = 34, CELLS = 8, WARPS = WARPS_N, THREADS = 32*WARPS, CHUNK = THREADS*CELLS;
static_assert(16 % WARPS == 0, "16 warps an SM are whole blocks");
#ifndef SM_BLOCKS_N
#define SM_BLOCKS_N (16 / WARPS_N)
#endif
constexpr int SM_BLOCKS = SM_BLOCKS_N;
static_assert(SM_BLOCKS >= 1 && SM_BLOCKS*WARPS <= 64, "a launch bound an SM can hold (64 warps)");
#ifndef ROWS_N
#define ROWS_N 8
#endif
#ifndef RING_N
#define RING_N 4
#endif
constexpr int ROWS = ROWS_N, RING = RING_N;  // a warp's ring: RING stages of ROWS K^T rows
#ifndef TILES_N
#define TILES_N 1
#endif
// A warp's tiles of 256 cells, one chunk apart (a block takes TILES whole chunks of a row, the grid TILES times fewer
// blocks), its ring running on from one tile's last rows into the next tile's first: the float loop and the copies
constexpr int TILES = TILES_N;
static_assert(TILES >= 1, "at least one tile a warp");
#ifdef COPY_LDG
constexpr bool COPY_LDG_ON = true;
#else
constexpr bool COPY_LDG_ON = false;
#endif
#ifdef COPY_CONTIG
constexpr bool COPY_CONTIG_ON = true;
#else
constexpr bool COPY_CONTIG_ON = false;
#endif
constexpr int WARP_BLOCKS = 32*CELLS/QK, WARP_BYTES = WARP_BLOCKS*BLK, PIECES = WARP_BYTES/16;
constexpr int STAGE_ROW = WARP_BYTES + 16, D = 128;
static_assert(WARP_BYTES % 16 == 0 && PIECES <= 32, "a warp's blocks are whole 16-byte pieces");

struct Args {
    const uint8_t * kt;   // [R][D][row_bytes]: per component row nb q8_0 blocks
    int64_t row_bytes;
    const uint32_t * i1;  // [R][k1]
    const float * q;      // [R][G][k1]
    float * logits;       // [R][G][n_kv]
    float * bmax;         // [R][G][n_kv/8]
    int n_kv, nb, k1;
};

// The L2 policy of the index's reads: EVICT_FIRST_N 1 evict-first (the copies' .L2::cache_hint with a policy made in
// the same statement, the loads' .cs), 0 none (the loads' .cg); -1 (default) each alternative's own: none for the
// ring's copies and the loads into registers, evict-first for the stream
#ifndef EVICT_FIRST_N
#define EVICT_FIRST_N -1
#endif
constexpr int EVICT_FIRST = EVICT_FIRST_N;
static_assert(EVICT_FIRST >= -1 && EVICT_FIRST <= 1, "-1, 0 or 1");
__device__ __forceinline__ void copy16(void * dst, const void * src, int n) {
    const unsigned s = (unsigned) __cvta_generic_to_shared(dst);
    if constexpr (EVICT_FIRST == 1) {
        asm volatile("{\n\t.reg .b64 pol;\n\tcreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n\t"
                     "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, pol;\n\t}"
                     :: "r"(s), "l"(src), "r"(n) : "memory");
    } else {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(src), "r"(n) : "memory");
    }
}
// a 16-byte load of the index for the loads and the stream: evict-first where asked (by default for the stream only)
template <bool EF_DEFAULT>
__device__ __forceinline__ uint4 load16(const uint4 * p) {
    return (EVICT_FIRST == -1 ? EF_DEFAULT : EVICT_FIRST == 1) ? __ldcs(p) : __ldcg(p);
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ float i8f(uint32_t biased, int e) {
    return __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7440u | (uint32_t) e)) - 8388736.0f;
}

// Whether an instance holds the integer loop's coefficients in shared memory (the float loop, the copies and the
// streams do not: their blocks per SM as the op's kernel A)
__host__ __device__ constexpr bool uses_coef(bool integer) {
#if defined(COPY_ONLY) || defined(STREAM)
    static_cast<void>(integer);
    return false;
#else
    return integer;
#endif
}

// The ring of stages: stage t holds K^T rows i1[(t % per_tile)*ROWS ..] of the 8 blocks of the warp's tile
// t / per_tile (the tile's blocks past the row's end zero-filled).
struct Ring {
    const uint8_t * rowbase; const uint32_t * i1; int64_t row_bytes, first_block, nb; int lane, n_stages, per_tile;
    uint8_t * stage;
    const uint8_t * contig;  // COPY_CONTIG: the warp's share
    // the lane's piece of row st*ROWS + u of tile k (its valid bytes in piece)
    __device__ const uint8_t * row_piece(int k, int st, int u, int & piece) const {
        const int64_t fb = first_block + (int64_t) k*(CHUNK/QK);
        const int n_valid = (int) (nb - fb < WARP_BLOCKS ? nb - fb : WARP_BLOCKS);
        piece = min(max(n_valid*BLK - 16*lane, 0), 16);
        if constexpr (COPY_CONTIG_ON) {
            return contig + (int64_t) (st*ROWS + u)*WARP_BYTES + 16*lane;
        }
        const uint8_t * src = piece > 0 ? rowbase + fb*BLK + 16*lane : rowbase;
        return src + (uint64_t) i1[st*ROWS + u]*(uint32_t) row_bytes;
    }
    __device__ void issue(int t) const {
        if (t < n_stages && lane < PIECES) {
            const int k = TILES > 1 ? t / per_tile : 0, st = TILES > 1 ? t % per_tile : t;
#pragma unroll
            for (int u = 0; u < ROWS; ++u) {
                int piece;
                const uint8_t * row = row_piece(k, st, u, piece);
                copy16(stage + ((t % RING)*ROWS + u)*STAGE_ROW + 16*lane, row, piece);
            }
        }
        commit();
    }
};

// A tile's outputs: the logits of the thread's 8 cells from j0 and their maximum, per head
template <int G>
__device__ __forceinline__ void write_tile(const Args & a, int r, int64_t j0, const float (&out)[G][CELLS]) {
    if (j0 >= a.n_kv) return;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < CELLS; ++c) mx = fmaxf(mx, out[g][c]);
        float * lrow = a.logits + ((int64_t) r*G + g)*a.n_kv + j0;
        ((float4 *) lrow)[0] = make_float4(out[g][0], out[g][1], out[g][2], out[g][3]);
        ((float4 *) lrow)[1] = make_float4(out[g][4], out[g][5], out[g][6], out[g][7]);
        a.bmax[((int64_t) r*G + g)*(a.n_kv/CELLS) + j0/CELLS] = mx;
    }
}

template <int G, bool INT>
__global__ void __launch_bounds__(THREADS, SM_BLOCKS) scores(Args a) {
    extern __shared__ uint8_t smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = blockIdx.y, k1 = a.k1;
    float * qs = (float *) smem;                                     // [G][k1]
    uint32_t * i1s = (uint32_t *) (qs + G*k1);                        // [k1]
    uint32_t * coef = i1s + k1;                                       // [WARPS][WARP_BLOCKS][G][k1/4] int8 x 4
    uint8_t * stage = (uint8_t *) (coef + (uses_coef(INT) ? WARPS*WARP_BLOCKS*G*(k1/4) : 0)) + warp*RING*ROWS*STAGE_ROW;
    for (int i = threadIdx.x; i < G*k1; i += THREADS) qs[i] = a.q[(int64_t) r*G*k1 + i];
    for (int i = threadIdx.x; i < k1; i += THREADS) i1s[i] = a.i1[(int64_t) r*k1 + i];
    __syncthreads();
    const int64_t first_cell = (int64_t) blockIdx.x*CHUNK*TILES + warp*32*CELLS;
    if (first_cell >= a.n_kv) return;
    int n_tiles = 1;  // the warp's tiles with cells in the row
    while (n_tiles < TILES && first_cell + (int64_t) n_tiles*CHUNK < a.n_kv) ++n_tiles;
    const int64_t first_block = first_cell / QK;
    const int n_valid = (int) (a.nb - first_block < WARP_BLOCKS ? a.nb - first_block : WARP_BLOCKS);
    const uint8_t * rowbase = a.kt + (int64_t) r*D*a.row_bytes;
    const int per_tile = k1/ROWS, n_t = n_tiles*per_tile;
    const int64_t share = ((int64_t) blockIdx.y*gridDim.x + blockIdx.x)*WARPS + warp;  // COPY_CONTIG
    const Ring ring{rowbase, i1s, a.row_bytes, first_block, a.nb, lane, n_t, per_tile, stage,
                    a.kt + share*k1*WARP_BYTES};
    const int64_t j0 = first_cell + lane*CELLS;
    const int bl = lane / (QK/CELLS);
    const int blk = BLK*bl, val = blk + 2 + CELLS*(lane % (QK/CELLS)), shift = 8*(val % 4);
    if (!(INT && COPY_LDG_ON)) for (int t = 0; t < RING - 1; ++t) ring.issue(t);  // the loads have no ring

    float out[G][CELLS];
    float cscale[G];
    if constexpr (INT) {
#ifdef COPY_ONLY
        uint32_t sink = 0;
        auto fill = [&] {  // the outputs hold the sink, so that no load is dropped
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int c = 0; c < CELLS; ++c) out[g][c] = (float) sink;
        };
        static_assert(!COPY_LDG_ON || TILES == 1, "the loads take one tile a warp");
        if constexpr (COPY_LDG_ON) {
            constexpr int LDG_ROWS = 16;
            for (int r0 = 0; r0 < k1; r0 += LDG_ROWS) {
                uint4 v[LDG_ROWS];
#pragma unroll
                for (int u = 0; u < LDG_ROWS; ++u) {
                    int piece;
                    const uint8_t * row = ring.row_piece(0, 0, r0 + u, piece);
                    v[u] = lane < PIECES && piece > 0 ? load16<false>((const uint4 *) row) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < LDG_ROWS; ++u) sink += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
            }
        } else {
#pragma unroll 1
            for (int t = 0; t < n_t; ++t) {
                ring.issue(t + RING - 1);
                wait_groups<RING - 1>();
                __syncwarp();
                sink += *(const uint32_t *) (stage + ((t % RING)*ROWS)*STAGE_ROW + (val & ~3));
                __syncwarp();
                if (TILES > 1 && t % per_tile == per_tile - 1 && t < n_t - 1) {
                    fill();
                    write_tile<G>(a, r, j0 + (int64_t) (t / per_tile)*CHUNK, out);
                }
            }
        }
        fill();
        cscale[0] = 0.0f;
    } else if constexpr (false) {
#endif
        static_assert(TILES == 1 || !INT, "the integer loop takes one tile a warp");
        // the coefficients of the thread's block: the block's 4 threads a quarter of the components each
        const int part = lane % 4, per = k1/4;
        float w[G][16];
        float m[G];
#pragma unroll
        for (int g = 0; g < G; ++g) m[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int i = part*per + j;
            float s = 0.0f;
            if (j < per && bl < n_valid) {
                const uint8_t * row = rowbase + (uint64_t) i1s[i]*(uint32_t) a.row_bytes;
                s = __half2float(*(const half *) (row + (first_block + bl)*BLK));
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                w[g][j] = j < per ? __fmul_rn(qs[g*k1 + i], s) : 0.0f;
                m[g] = fmaxf(m[g], fabsf(w[g][j]));
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            m[g] = fmaxf(m[g], __shfl_xor_sync(0xffffffffu, m[g], 1));
            m[g] = fmaxf(m[g], __shfl_xor_sync(0xffffffffu, m[g], 2));
            const float inv = m[g] > 0.0f ? __fdiv_rn(127.0f, m[g]) : 0.0f;
            cscale[g] = __fdiv_rn(m[g], 127.0f);
            uint32_t * dst = coef + ((warp*WARP_BLOCKS + bl)*G + g)*(k1/4) + part*per/4;
#pragma unroll
            for (int j = 0; j < 16; j += 4) {
                if (j < per) {
                    uint32_t word = 0;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        word |= (uint32_t) (uint8_t) (int8_t) __float2int_rn(__fmul_rn(w[g][j + e], inv)) << (8*e);
                    }
                    dst[j/4] = word;
                }
            }
        }
        __syncwarp();
        int acc[G][CELLS] = {};
        const uint32_t * cw = coef + (warp*WARP_BLOCKS + bl)*G*(k1/4);
#pragma unroll 1
        for (int t = 0; t < k1/ROWS; ++t) {
            ring.issue(t + RING - 1);
            wait_groups<RING - 1>();
            __syncwarp();
#pragma unroll
            for (int h = 0; h < ROWS/4; ++h) {
                uint32_t lo[4], hi[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const uint8_t * row = stage + ((t % RING)*ROWS + 4*h + u)*STAGE_ROW;
                    const uint32_t * wp = (const uint32_t *) (row + (val & ~3));
                    lo[u] = __funnelshift_r(wp[0], wp[1], shift);
                    hi[u] = __funnelshift_r(wp[1], wp[2], shift);
                }
                uint32_t x[CELLS];
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const uint32_t * v = p ? hi : lo;
                    const uint32_t t0 = __byte_perm(v[0], v[1], 0x5140), t1 = __byte_perm(v[0], v[1], 0x7362);
                    const uint32_t t2 = __byte_perm(v[2], v[3], 0x5140), t3 = __byte_perm(v[2], v[3], 0x7362);
                    x[4*p + 0] = __byte_perm(t0, t2, 0x5410);
                    x[4*p + 1] = __byte_perm(t0, t2, 0x7632);
                    x[4*p + 2] = __byte_perm(t1, t3, 0x5410);
                    x[4*p + 3] = __byte_perm(t1, t3, 0x7632);
                }
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const int c4 = (int) cw[g*(k1/4) + t*(ROWS/4) + h];
#pragma unroll
                    for (int c = 0; c < CELLS; ++c) acc[g][c] = __dp4a((int) x[c], c4, acc[g][c]);
                }
            }
            __syncwarp();
        }
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int c = 0; c < CELLS; ++c) out[g][c] = __fmul_rn(cscale[g], (float) acc[g][c]);
    } else {
        float acc[G][CELLS] = {};
#pragma unroll 1
        for (int t = 0; t < n_t; ++t) {
            ring.issue(t + RING - 1);
            wait_groups<RING - 1>();
            __syncwarp();
            const int st = TILES > 1 ? t % per_tile : t;
#pragma unroll
            for (int u = 0; u < ROWS; ++u) {
                const uint8_t * row = stage + ((t % RING)*ROWS + u)*STAGE_ROW;
                const float xs = __half2float(*(const half *) (row + blk));
                const uint32_t * wp = (const uint32_t *) (row + (val & ~3));
                const uint32_t lo = __funnelshift_r(wp[0], wp[1], shift) ^ 0x80808080u;
                const uint32_t hi = __funnelshift_r(wp[1], wp[2], shift) ^ 0x80808080u;
                float xf[CELLS];
#pragma unroll
                for (int e = 0; e < 4; ++e) { xf[e] = i8f(lo, e); xf[4 + e] = i8f(hi, e); }
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float qv = __fmul_rn(qs[g*k1 + st*ROWS + u], xs);
#pragma unroll
                    for (int c = 0; c < CELLS; ++c) acc[g][c] += qv*xf[c];
                }
            }
            __syncwarp();
            if (TILES > 1 && st == per_tile - 1 && t < n_t - 1) {
                write_tile<G>(a, r, j0 + (int64_t) (t / per_tile)*CHUNK, acc);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int c = 0; c < CELLS; ++c) acc[g][c] = 0.0f;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int c = 0; c < CELLS; ++c) out[g][c] = acc[g][c];
    }
    write_tile<G>(a, r, j0 + (int64_t) (n_tiles - 1)*CHUNK, out);
}

#ifdef STREAM
// The index's bytes as n_shares contiguous shares of a warp's bytes (WARP_BYTES per row, k1 rows), each read by one
// warp with 16-byte loads, STREAM_LOADS a lane in flight; one word a thread written so that the loads are not dropped.
#ifndef STREAM_LOADS_N
#define STREAM_LOADS_N 16
#endif
constexpr int STREAM_LOADS = STREAM_LOADS_N;
// lanes a load (each load of the warp STREAM_LANES*16 contiguous bytes), and the stream's start in 16-byte words
#ifndef STREAM_LANES_N
#define STREAM_LANES_N 32
#endif
#ifndef STREAM_SKEW_N
#define STREAM_SKEW_N 0
#endif
// the stream's blocks an SM held to STREAM_OCC_N by its shared memory (0: as many as its registers allow)
#ifndef STREAM_OCC_N
#define STREAM_OCC_N 0
#endif
constexpr int STREAM_LANES = STREAM_LANES_N, STREAM_SKEW = STREAM_SKEW_N, STREAM_OCC = STREAM_OCC_N;
static_assert(STREAM_OCC >= 0, "blocks an SM");
static_assert(STREAM_LANES >= 1 && STREAM_LANES <= 32 && STREAM_SKEW >= 0, "lanes of a warp, a forward skew");
__global__ void __launch_bounds__(THREADS) stream_read(const uint4 * src, int64_t n_shares, int64_t share_words,
                                                       uint32_t * sink) {
    const int lane = threadIdx.x % 32;
    const int64_t n_warps = (int64_t) gridDim.x*WARPS;
    uint32_t acc = 0;
    for (int64_t sh = (int64_t) blockIdx.x*WARPS + threadIdx.x/32; sh < n_shares; sh += n_warps) {
        const uint4 * p = src + STREAM_SKEW + sh*share_words;
        for (int64_t w0 = 0; w0 < share_words; w0 += STREAM_LANES*STREAM_LOADS) {
            uint4 v[STREAM_LOADS];
#pragma unroll
            for (int u = 0; u < STREAM_LOADS; ++u) {
                const int64_t i = w0 + u*STREAM_LANES + lane;
                v[u] = lane < STREAM_LANES && i < share_words ? load16<true>(p + i) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < STREAM_LOADS; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    sink[(int64_t) blockIdx.x*THREADS + threadIdx.x] = acc;
}
#endif

static size_t smem_bytes(int G, int k1, bool integer) {
    return (size_t) G*k1*4 + k1*4 + (uses_coef(integer) ? (size_t) WARPS*WARP_BLOCKS*G*(k1/4)*4 : 0) +
           (size_t) WARPS*RING*ROWS*STAGE_ROW;
}

#ifdef STREAM
// dynamic shared memory that lets STREAM_OCC blocks of the stream on an SM and not one more (1 KiB a block reserved)
static size_t stream_smem() {
    constexpr int occ = STREAM_OCC > 0 ? STREAM_OCC : 1;
    if constexpr (STREAM_OCC == 0) return 0;
    static int sm_bytes = 0;
    if (sm_bytes == 0) {
        CK(cudaDeviceGetAttribute(&sm_bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
        CK(cudaFuncSetAttribute(stream_read, cudaFuncAttributeMaxDynamicSharedMemorySize, sm_bytes/occ - 1024));
    }
    return (size_t) (sm_bytes/occ - 1024);
}
#endif

// blocks an SM of the float loop (INT false) or of the alternative
template <int G, bool INT>
static int blocks_per_sm(int k1) {
    int n = 0;
#ifdef STREAM
    if constexpr (INT) {
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, stream_read, THREADS, stream_smem()));
    } else
#endif
    {
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, scores<G, INT>, THREADS, smem_bytes(G, k1, INT)));
    }
    return n;
}

template <int G, bool INT>
static void launch(const Args & a, int R, cudaStream_t st) {
    dim3 grid((a.n_kv + CHUNK*TILES - 1)/(CHUNK*TILES), R);
#ifdef STREAM
    if (INT) {  // the alternative: the stream (its sink is the integer loop's logits, unread)
        static int n_sm = 0;
        if (n_sm == 0) CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
        const int64_t n_shares = (int64_t) R*((a.n_kv + 32*CELLS - 1)/(32*CELLS)), share_words = WARP_BYTES*a.k1/16;
        const int wave_per_sm = STREAM_OCC > 0 ? STREAM_OCC : 16/WARPS;  // stream_wave: one wave of its blocks
        const int64_t blocks = STREAM == 1 ? (int64_t) grid.x*grid.y : std::min<int64_t>((n_shares + WARPS - 1)/WARPS,
                                                                                         (int64_t) n_sm*wave_per_sm);
        stream_read<<<(unsigned) blocks, THREADS, stream_smem(), st>>>((const uint4 *) a.kt, n_shares, share_words,
                                                                     (uint32_t *) a.logits);
        return;
    }
#endif
    scores<G, INT><<<grid, THREADS, smem_bytes(G, a.k1, INT), st>>>(a);
}

static float h2f(uint16_t h) { __half x; memcpy(&x, &h, 2); return __half2float(x); }
static uint16_t f2h(float f) { __half x = __float2half_rn(f); uint16_t h; memcpy(&h, &x, 2); return h; }

template <int G>
static void run(const char * name, int R, int n_kv, int runs) {
    const int k1 = 64, nb = (n_kv + QK - 1)/QK;
    const int64_t row_bytes = ((int64_t) nb*BLK + 15)/16*16;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<uint8_t> kt((size_t) R*D*row_bytes, 0);
    // values: heavy-ish tails per component (spreads 0.2..3), quantized per block as q8_0
    for (int r = 0; r < R; ++r) for (int i = 0; i < D; ++i) {
        const float spread = 0.2f + 2.8f*(float) ((i*37) % D)/D;
        for (int b = 0; b < nb; ++b) {
            float v[QK], amax = 0.0f;
            for (int c = 0; c < QK; ++c) {
                v[c] = b*QK + c < n_kv ? spread*nd(rng) : 0.0f;
                amax = std::max(amax, std::fabs(v[c]));
            }
            const float dsc = amax/127.0f, inv = dsc > 0 ? 1.0f/dsc : 0.0f;
            uint8_t * blkp = &kt[((size_t) r*D + i)*row_bytes + (size_t) b*BLK];
            const uint16_t hs = f2h(dsc); memcpy(blkp, &hs, 2);
            for (int c = 0; c < QK; ++c) blkp[2 + c] = (uint8_t) (int8_t) std::lround(v[c]*inv);
        }
    }
    std::vector<uint32_t> i1((size_t) R*k1);
    for (int r = 0; r < R; ++r) {
        std::vector<uint32_t> p(D); for (int i = 0; i < D; ++i) p[i] = i;
        std::shuffle(p.begin(), p.end(), rng);
        std::sort(p.begin(), p.begin() + k1);
        for (int i = 0; i < k1; ++i) i1[(size_t) r*k1 + i] = p[i];
    }
    std::vector<float> q((size_t) R*G*k1);
    for (auto & x : q) x = nd(rng)*(nd(rng) > 1.5f ? 4.0f : 1.0f);
    uint8_t * d_kt; uint32_t * d_i1; float * d_q, * d_lf, * d_li, * d_bm; void * d_flush;
    const size_t n_log = (size_t) R*G*n_kv, flush_bytes = 256u << 20;
    CK(cudaMalloc(&d_kt, kt.size())); CK(cudaMalloc(&d_i1, i1.size()*4)); CK(cudaMalloc(&d_q, q.size()*4));
    CK(cudaMalloc(&d_lf, n_log*4)); CK(cudaMalloc(&d_li, n_log*4)); CK(cudaMalloc(&d_bm, n_log/CELLS*4 + 64));
    CK(cudaMalloc(&d_flush, flush_bytes));
    CK(cudaMemcpy(d_kt, kt.data(), kt.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_i1, i1.data(), i1.size()*4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_q, q.data(), q.size()*4, cudaMemcpyHostToDevice));
    const auto smem_attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
    CK(cudaFuncSetAttribute(scores<G, false>, smem_attr, (int) smem_bytes(G, k1, false)));
    CK(cudaFuncSetAttribute(scores<G, true>, smem_attr, (int) smem_bytes(G, k1, true)));
    Args af{d_kt, row_bytes, d_i1, d_q, d_lf, d_bm, n_kv, nb, k1};
    Args ai = af; ai.logits = d_li;
    launch<G, false>(af, R, 0); launch<G, true>(ai, R, 0);
    CK(cudaDeviceSynchronize());
    std::vector<float> lf(n_log), li(n_log);
    CK(cudaMemcpy(lf.data(), d_lf, n_log*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(li.data(), d_li, n_log*4, cudaMemcpyDeviceToHost));
    // host references: the float products (tolerance) and the integer scores (exact)
    double max_rel_f = 0.0; int64_t int_mismatch = 0, checked = 0;
    for (int r = 0; r < R; r += std::max(1, R/4)) for (int g = 0; g < G; ++g) for (int b = 0; b < nb; b += 37) {
        float w[64], m = 0.0f;
        for (int i = 0; i < k1; ++i) {
            const size_t row = (size_t) r*D + i1[(size_t) r*k1 + i];
            const float s = h2f(*(const uint16_t *) &kt[row*row_bytes + (size_t) b*BLK]);
            w[i] = q[((size_t) r*G + g)*k1 + i]*s; m = std::max(m, std::fabs(w[i]));
        }
        const float inv = m > 0 ? 127.0f/m : 0.0f, C = m/127.0f;
        for (int c = 0; c < QK && b*QK + c < n_kv; ++c) {
            double fref = 0.0, scale = 0.0; int64_t dot = 0;
            for (int i = 0; i < k1; ++i) {
                const int8_t x = (int8_t) kt[((size_t) r*D + i1[(size_t) r*k1 + i])*row_bytes + (size_t) b*BLK + 2 + c];
                fref += (double) w[i]*x; scale += std::fabs((double) w[i]*x);
                dot += (int64_t) std::lrint(w[i]*inv)*x;
            }
            const size_t at = ((size_t) r*G + g)*n_kv + (size_t) b*QK + c;
            max_rel_f = std::max(max_rel_f, std::fabs(lf[at] - fref)/(scale + 1e-30));
            const float iref = C*(float) dot;
            int_mismatch += memcmp(&iref, &li[at], 4) != 0;
            ++checked;
        }
    }
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    auto time_one = [&](bool integer, bool cold) {
        if (cold) CK(cudaMemsetAsync(d_flush, runs & 0xff, flush_bytes, 0));
        CK(cudaEventRecord(e0, 0));
        if (integer) launch<G, true>(ai, R, 0); else launch<G, false>(af, R, 0);
        CK(cudaEventRecord(e1, 0)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); return ms*1000.0f;
    };
    std::vector<float> tf_w, ti_w, tf_c, ti_c;
    for (int k = 0; k < runs; ++k) {
        tf_w.push_back(time_one(false, false)); ti_w.push_back(time_one(true, false));
        tf_c.push_back(time_one(false, true)); ti_c.push_back(time_one(true, true));
    }
    auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size()/2]; };
    const double bytes = (double) R*nb*BLK*k1;
#if defined(COPY_ONLY)
    const char * alt = COPY_LDG_ON ? (COPY_CONTIG_ON ? "ldg_contig" : "ldg")
                                   : (COPY_CONTIG_ON ? "copy_contig" : "copy");
#elif defined(STREAM)
    char alt[64];  // the stream's form: grid, loads a lane in flight, lanes a load, skew in 16-byte words
    snprintf(alt, sizeof alt, "%s_loads%d_lanes%d_skew%d_occ%d", STREAM == 1 ? "stream" : "stream_wave",
             STREAM_LOADS, STREAM_LANES, STREAM_SKEW, STREAM_OCC);
#else
    const char * alt = "int";
#endif
    printf("{\"heads\": \"%s\", \"rows\": %d, \"group\": %d, \"n_kv\": %d, \"k1\": %d, \"ring\": %d, "
           "\"rows_per_stage\": %d, \"warps\": %d, \"tiles\": %d, \"alt\": \"%s\", \"float_warm_us\": %.2f, "
           "\"float_cold_us\": %.2f, \"alt_warm_us\": %.2f, \"alt_cold_us\": %.2f, \"index_bytes\": %.0f, "
           "\"float_max_rel_err\": %.2e, "
           "\"int_mismatches\": %lld, \"checked\": %lld, \"runs\": %d, \"evict_first\": %d, "
           "\"sm_blocks\": %d, \"float_blocks_per_sm\": %d, \"alt_blocks_per_sm\": %d}\n",
           name, R, G, n_kv, k1, RING, ROWS, WARPS, TILES, alt, med(tf_w), med(tf_c), med(ti_w), med(ti_c), bytes,
           max_rel_f, (long long) int_mismatch, (long long) checked, runs, EVICT_FIRST, SM_BLOCKS,
           blocks_per_sm<G, false>(k1), blocks_per_sm<G, true>(k1));
    fflush(stdout);
    for (void * p : {(void *) d_kt, (void *) d_i1, (void *) d_q, (void *) d_lf, (void *) d_li, (void *) d_bm}) {
        CK(cudaFree(p));
    }
    CK(cudaFree(d_flush));
}

// argv: runs per timing (default 30), then the cells per row (default 33024 and 131072)
int main(int argc, char ** argv) {
    const int runs = argc > 1 ? atoi(argv[1]) : 30;
    std::vector<int> seqs;
    for (int i = 2; i < argc; ++i) seqs.push_back(atoi(argv[i]));
    if (seqs.empty()) seqs = {33024, 131072};
    if (runs < 1) { fprintf(stderr, "runs must be >= 1\n"); return 2; }
    for (int n : seqs) {
        if (n < 1) { fprintf(stderr, "cells must be >= 1\n"); return 2; }
        run<1>("llama2-7b", 32, n, runs);  // 32 KV heads, B = 1
        run<4>("llama3-8b", 8, n, runs);   // 8 KV heads of 4 query heads
    }
    return 0;
}
