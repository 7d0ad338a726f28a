// CUDA kernel of ggml_centroid_attn. Semantics: ggml_ops/include/ggml-centroid.h and docs/design.md,
// "Centroid-sparse: op semantics"; the kernels' structure: docs/design.md, "CUDA kernels". The CPU kernel
// (ggml_ops/src/cpu/centroid-attn-cpu.cpp) is the reference for every detail (tie rules, which normaliser, the
// double-precision parts of the scores).
//
// A row is (KV head h, query row t, stream s), heads fastest, as on the CPU; the query heads of h's group share
// the row's selection. Rows go in waves (bounded scratch for long prefill batches); per wave, four kernels,
// chained by programmatic dependent launch (each waits on the device for its predecessor):
//   S1. level-1 scores (grid: blocks of S_CLUSTERS clusters x rows): z_g[i] = scale q_g . C_i of every head of
//       the group (a warp per cluster) and each block's softmax statistics (max, sum N exp(z - max)) per head;
//       the stored logits then get the variance term (var_weight > 0), which the statistics leave out.
//       Level 1 is the coarse table with two levels, else the fine one.
//   S2. select (one block per row): the normaliser log Z_g from the block statistics and the level-1 group scores.
//       One level: those are the fine scores. Two levels: the coarse clusters >= threshold_coarse are kept (the
//       best always: ties to the lower index), then the fine clusters under kept parents are scored against the
//       coarse normaliser (a warp per cluster). The fine level is kept by the budget rule: an exact radix select
//       over the (score, index) keys weighted by the cluster sizes finds the boundary cluster. Output: one byte
//       per fine cluster.
//   A.  attend (grid: chunks of cells x rows x passes over the group's heads): the chunk's selected cells
//       (visible, and unclustered or in a kept cluster) compacted in cell order into shared memory; groups of
//       LPC lanes each run an online softmax over every N_GRP-th selected cell (16-byte K/V loads, two cells in
//       flight); the groups' partials merge in the block, in a fixed order, into the chunk's (max, sum, acc).
//   M.  merge (grid: heads x rows): the chunks' partials into the output, as the CPU's phase C.
// Launch sizes depend on shapes only (CUDA graphs stay on); no host round trip. Every reduction runs in a fixed
// order: repeated runs give identical bits.
#include "centroid-attn.cuh"
#include "attn-cuda-common.cuh"

#include "ggml-centroid.h"

#include <algorithm>
#include <cstdint>

namespace {

using namespace attn_cuda;  // pdl_wait, to_f32, load8, load8_row, warp_sum, warp_max

constexpr int      S_THREADS    = 256;   // kernels S1 and S2
constexpr int      S_WARPS      = S_THREADS / WARP_SIZE;
constexpr int      S_CLUSTERS   = 64;    // level-1 clusters per block of kernel S1
constexpr int      A_THREADS    = 256;   // kernel A
constexpr int      A_WARPS      = A_THREADS / WARP_SIZE;
constexpr int      A_MAX_TILES  = 32;    // kernel A: tiles of A_THREADS cells per chunk (a flag bit per tile)
constexpr int      A_ACC_MAX    = 1024;  // kernel A: heads per pass x components per cell group (merge floats per warp)
constexpr int      A_BLOCKS_SM  = 3;     // kernel A: blocks resident per SM (~78 registers a thread: 3 x 256 threads)
constexpr int      A_CNT_LANE   = (A_MAX_TILES*A_WARPS + WARP_SIZE - 1) / WARP_SIZE;  // scan: counts per lane
constexpr int      M_THREADS    = 128;   // kernel M
constexpr int      MAX_HEAD_DIM = 512;
constexpr int      MAX_G        = 128;
constexpr int      TABLE_REGS   = MAX_HEAD_DIM / WARP_SIZE;  // a table row held by a warp
constexpr uint16_t F16_NEG_INF  = 0xFC00;
constexpr int64_t  WAVE_BYTES   = int64_t(256) << 20;  // scratch budget of one wave of rows

struct centroid_args {
    const char * q; const char * k; const char * v; const char * mask;
    const char * cent; const char * cell; const char * coarse; const char * parent;
    char * dst;
    int64_t d, d_v, n_q, n_head, n_head_kv, ns, n_kv, group, n_cent, n_coarse;
    int64_t n1;                     // level-1 clusters: n_coarse with two levels, else n_cent
    size_t q_nb1, q_nb2, q_nb3;
    size_t k_nb1, k_nb2, k_nb3;
    size_t v_nb1, v_nb2, v_nb3;
    size_t m_nb1, m_nb3;  int64_t m_ns;
    size_t c_nb1, c_nb2, c_nb3;     // cent
    size_t cc_nb1, cc_nb2, cc_nb3;  // coarse
    size_t cl_nb1, cl_nb2;          // cell
    size_t pa_nb1, pa_nb2;          // parent
    size_t o_nb1, o_nb2, o_nb3;
    ggml_centroid_op_params p;
    int32_t n_chunks1;              // kernel S1: blocks per row
    int32_t chunk, n_chunks;        // kernel A: cells per block, blocks per row and pass
    int32_t n_pass;                 // kernel A: passes over the group's heads
    bool vec_kv;                    // K and V rows allow 16-byte loads
};

struct centroid_scratch {
    float   * z1;      // [W][G][n1]: level-1 rule logits (dot products, variance term), -inf: empty (kernel S1)
    double  * part1;   // [W][n_chunks1][G][2]: block max and sum N exp(z - max) (kernel S1)
    uint8_t * kept;    // [W][n_cent]: kept fine clusters (kernel S2)
    uint8_t * kept_c;  // [W][n_coarse]: kept coarse clusters (kernel S2, two levels)
    float   * fscore;  // [W][n_cent]: fine group scores, -1 for unscored (kernel S2)
    float   * part;    // [W][n_chunks][G][2 + d_v]: chunk max, sum and weighted sum of V (kernel A)
};

// ---- row addressing --------------------------------------------------------------------------------

struct row_coords {
    int64_t h, t, st;
};
__device__ __forceinline__ row_coords coords_of(const centroid_args & a, int64_t r) {
    return { r % a.n_head_kv, (r / a.n_head_kv) % a.n_q, r / (a.n_head_kv * a.n_q) };
}
__device__ __forceinline__ const float * q_row(const centroid_args & a, int64_t hq, const row_coords & c) {
    return (const float *) (a.q + c.t*a.q_nb1 + hq*a.q_nb2 + c.st*a.q_nb3);
}
__device__ __forceinline__ const uint16_t * mask_row(const centroid_args & a, const row_coords & c) {
    return a.mask ? (const uint16_t *) (a.mask + c.t*a.m_nb1 + (c.st % a.m_ns)*a.m_nb3) : nullptr;
}
__device__ __forceinline__ const int32_t * cell_row(const centroid_args & a, const row_coords & c) {
    return (const int32_t *) (a.cell + c.h*a.cl_nb1 + c.st*a.cl_nb2);
}
__device__ __forceinline__ const int32_t * parent_row(const centroid_args & a, const row_coords & c) {
    return (const int32_t *) (a.parent + c.h*a.pa_nb1 + c.st*a.pa_nb2);
}
__device__ __forceinline__ const float * cent_row(const centroid_args & a, int64_t i, const row_coords & c) {
    return (const float *) (a.cent + i*a.c_nb1 + c.h*a.c_nb2 + c.st*a.c_nb3);
}
__device__ __forceinline__ const float * coarse_row(const centroid_args & a, int64_t i, const row_coords & c) {
    return (const float *) (a.coarse + i*a.cc_nb1 + c.h*a.cc_nb2 + c.st*a.cc_nb3);
}

// The softcap's tanh in double: ggml-cuda builds with fast math, whose tanhf is the hardware approximation
// (relative error ~5e-4, far above the f32 reference tolerance).
__device__ __forceinline__ float logit_of(const centroid_args & a, float dot) {
    float l = a.p.scale * dot;
    if (a.p.softcap > 0.0f) {
        l = a.p.softcap * (float) tanh((double) l / (double) a.p.softcap);
    }
    return l;
}

// ---- reductions ------------------------------------------------------------------------------------

// Maximum over the block (every thread gets it). red: S_WARPS shared slots.
static __device__ uint64_t block_max_u64(uint64_t v, uint64_t * red) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) {
        red[warp] = v;
    }
    __syncthreads();
    uint64_t m = 0;
    for (int i = 0; i < (int) (blockDim.x / WARP_SIZE); ++i) {
        m = red[i] > m ? red[i] : m;
    }
    return m;
}

// Sum over the block (every thread gets it), of integers held in doubles: exact, so the order does not matter.
// red: S_WARPS shared slots.
static __device__ double block_sum_f64(double v, double * red) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        red[warp] = v;
    }
    __syncthreads();
    double s = 0.0;
    for (int i = 0; i < (int) (blockDim.x / WARP_SIZE); ++i) {
        s += red[i];
    }
    return s;
}

// Key of the cluster order (the best-cluster rule and the budget rule): larger score first, then the lower index;
// 0 for an unscored cluster (< 0). Scores are >= 0, so their float bits order them.
__device__ __forceinline__ uint64_t best_key(float score, int64_t i) {
    if (!(score >= 0.0f)) {
        return 0;
    }
    return (uint64_t(__float_as_uint(score) & 0x7FFFFFFFu) << 32) | uint64_t(0xFFFFFFFFu - (uint32_t) i);
}
__device__ __forceinline__ int64_t best_index(uint64_t key) {
    return key ? (int64_t) (0xFFFFFFFFu - (uint32_t) (key & 0xFFFFFFFFu)) : -1;
}

// Group score from the heads' scaled dot products: max or mean over g of exp(z_g - log Z_g), in double as the
// CPU kernel. z_of(g) returns head g's dot product.
template <typename ZFn>
__device__ __forceinline__ float group_score(const centroid_args & a, const double * log_z, ZFn z_of) {
    double agg = 0.0;
    for (int64_t g = 0; g < a.group; ++g) {
        const double sg = exp((double) z_of(g) - log_z[g]);
        agg = a.p.group == GGML_CENTROID_GROUP_MAX ? fmax(agg, sg) : agg + sg / (double) a.group;
    }
    return (float) agg;
}

// A table row (d components) in a warp's registers: lane l holds components l, l + 32, ...
__device__ __forceinline__ void load_table_row(const float * row, int64_t d, float (&ce)[TABLE_REGS]) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int e = 0; e < TABLE_REGS; ++e) {
        const int64_t i = lane + WARP_SIZE*e;
        ce[e] = i < d ? row[i] : 0.0f;
    }
}
__device__ __forceinline__ float warp_dot(const float * qg, int64_t d, const float (&ce)[TABLE_REGS]) {
    const int lane = threadIdx.x % WARP_SIZE;
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < TABLE_REGS; ++e) {
        const int64_t i = lane + WARP_SIZE*e;
        if (i < d) {
            dot += qg[i] * ce[e];
        }
    }
    return warp_sum(dot);
}

// The variance term's factor var_weight scale^2 / 2 (ggml-centroid.h).
__device__ __forceinline__ float variance_coef(const centroid_args & a) {
    return 0.5f * a.p.var_weight * a.p.scale * a.p.scale;
}

// The variance term of a cluster for head g: variance_coef * sum_d q_gd^2 D_d, D in a warp's registers.
__device__ __forceinline__ float warp_variance_term(const centroid_args & a, const float * qg,
                                                    const float (&var)[TABLE_REGS]) {
    const int lane = threadIdx.x % WARP_SIZE;
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < TABLE_REGS; ++e) {
        const int64_t i = lane + WARP_SIZE*e;
        if (i < a.d) {
            dot += qg[i] * qg[i] * var[e];
        }
    }
    return variance_coef(a) * warp_sum(dot);
}

// ---- S1: level-1 scaled dot products and block statistics --------------------------------------------

// TR components per lane (d <= 32 TR); each warp holds S1_ROWS table rows in flight.
constexpr int S1_ROWS = 4;
static_assert(S_CLUSTERS % (S_WARPS * S1_ROWS) == 0, "kernel S1: whole steps of rows");
template <int TR>
__global__ void __launch_bounds__(S_THREADS) centroid_level1(const centroid_args a, const centroid_scratch s,
                                                             const int64_t r0) {
    pdl_wait();
    extern __shared__ float s1_smem[];  // [G][S_CLUSTERS] dot products, then [S_CLUSTERS] sizes
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t w = blockIdx.y, G = a.group, n1 = a.n1, d = a.d, i0 = (int64_t) blockIdx.x * S_CLUSTERS;
    const row_coords c = coords_of(a, r0 + w);
    float * zs = s1_smem, * sz = s1_smem + G*S_CLUSTERS;
    float * z1 = s.z1 + w*G*n1;

    for (int k0 = warp*S1_ROWS; k0 < S_CLUSTERS; k0 += S_WARPS*S1_ROWS) {
        float ce[S1_ROWS][TR], size[S1_ROWS];
#pragma unroll
        for (int u = 0; u < S1_ROWS; ++u) {  // clusters past the table count as empty
            const int64_t i = i0 + k0 + u;
            const float * row = i < n1 ? (a.coarse ? coarse_row(a, i, c) : cent_row(a, i, c)) : nullptr;
#pragma unroll
            for (int e = 0; e < TR; ++e) {
                const int64_t x = lane + WARP_SIZE*e;
                ce[u][e] = row && x < d ? row[x] : 0.0f;
            }
            size[u] = row ? row[d] : 0.0f;
        }
        for (int64_t g = 0; g < G; ++g) {
            const float * qg = q_row(a, c.h*G + g, c);
            float qv[TR];
#pragma unroll
            for (int e = 0; e < TR; ++e) {
                const int64_t x = lane + WARP_SIZE*e;
                qv[e] = x < d ? qg[x] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < S1_ROWS; ++u) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < TR; ++e) {
                    dot += qv[e] * ce[u][e];
                }
                dot = warp_sum(dot);
                const float z = size[u] > 0.0f ? a.p.scale * dot : -INFINITY;
                const int64_t i = i0 + k0 + u;
                if (lane == 0) {
                    zs[g*S_CLUSTERS + k0 + u] = z;
                    if (i < n1) {
                        z1[g*n1 + i] = z;
                    }
                }
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int u = 0; u < S1_ROWS; ++u) {
                sz[k0 + u] = size[u];
            }
        }
    }
    if (a.p.var_weight > 0.0f) {
        // the stored rule logits get the variance term (the block statistics above are the normaliser's: means
        // only); the same warps and lanes as above, so each lane 0 adds to the values it wrote
        for (int k0 = warp*S1_ROWS; k0 < S_CLUSTERS; k0 += S_WARPS*S1_ROWS) {
            float va[S1_ROWS][TR];
            bool live[S1_ROWS];
#pragma unroll
            for (int u = 0; u < S1_ROWS; ++u) {
                const int64_t i = i0 + k0 + u;
                const float * row = i < n1 ? (a.coarse ? coarse_row(a, i, c) : cent_row(a, i, c)) : nullptr;
                live[u] = row && row[d] > 0.0f;
#pragma unroll
                for (int e = 0; e < TR; ++e) {
                    const int64_t x = lane + WARP_SIZE*e;
                    va[u][e] = live[u] && x < d ? row[d + 1 + x] : 0.0f;
                }
            }
            const float coef = variance_coef(a);
            for (int64_t g = 0; g < G; ++g) {
                const float * qg = q_row(a, c.h*G + g, c);
                float qq[TR];
#pragma unroll
                for (int e = 0; e < TR; ++e) {
                    const int64_t x = lane + WARP_SIZE*e;
                    qq[e] = x < d ? qg[x] * qg[x] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < S1_ROWS; ++u) {
                    float dot = 0.0f;
#pragma unroll
                    for (int e = 0; e < TR; ++e) {
                        dot += qq[e] * va[u][e];
                    }
                    dot = warp_sum(dot);
                    if (lane == 0 && live[u]) {
                        z1[g*n1 + i0 + k0 + u] += coef * dot;
                    }
                }
            }
        }
    }
    __syncthreads();
    double * out = s.part1 + ((w*a.n_chunks1 + blockIdx.x)*G)*2;
    for (int64_t g = warp; g < G; g += S_WARPS) {
        float m = -INFINITY;
        for (int k = lane; k < S_CLUSTERS; k += WARP_SIZE) {
            m = fmaxf(m, zs[g*S_CLUSTERS + k]);
        }
        m = warp_max(m);
        double sum = 0.0;
        for (int k = lane; k < S_CLUSTERS; k += WARP_SIZE) {
            const float z = zs[g*S_CLUSTERS + k];
            if (z != -INFINITY) {
                sum += (double) sz[k] * exp((double) (z - m));
            }
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            out[2*g]     = (double) m;
            out[2*g + 1] = sum;
        }
    }
}

// ---- S2: normaliser, group scores, kept clusters -------------------------------------------------------

constexpr int RADIX_BINS = 256;  // the budget select: 8 bits of the 64-bit keys a pass
static_assert(S_THREADS == RADIX_BINS, "kernel S2: a thread per radix bin");
static_assert(RADIX_BINS == 8*WARP_SIZE, "kernel S2: eight radix bins per lane of the scanning warp");

struct budget_smem {
    uint32_t weight[RADIX_BINS];  // the sizes of the pass's candidates per bin
    uint32_t count[RADIX_BINS];   // the candidates per bin
    double   red[S_WARPS];
    uint64_t remaining;           // the budget left for the candidates of the chosen bin
    uint32_t bin, bin_count;      // the chosen bin and its candidates
    bool     all;                 // the scored clusters' sizes do not reach the budget: all are kept
};

// The budget rule (ggml-centroid.h, step 3) for one row over its fine scores fscore [n_cent] (< 0: unscored): with
// clusters ordered by key (best_key), the boundary cluster b is the first whose size, with those of the clusters
// before it, reaches B = max(1, ceil(keep * N)); kept: b and the clusters before it (every scored one when their
// sizes sum to less than B). Found as the largest key K with sum{size_i : key_i >= K} >= B by a radix select from
// the top byte of the keys down: a pass histograms the sizes of the candidates (keys with the chosen prefix) over
// the next 8 bits, the scanning warp finds the bin where the sum from the top crosses the budget left, and the
// pass ends the search once that bin holds one cluster (keys are distinct: at most 8 passes). Integer sizes and
// shared-memory atomics: the same bits on every run. Then kept[i] = key_i >= K.
static __device__ void keep_by_budget(const centroid_args & a, const row_coords & c, const float * fscore,
                                      uint8_t * kept, budget_smem & sm) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t n = a.n_cent;

    // N: the clustered cells (the fine table's sizes); B computed as the CPU kernel does (a float32 product)
    double n_sum = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += S_THREADS) {
        n_sum += (double) cent_row(a, i, c)[a.d];
    }
    n_sum = block_sum_f64(n_sum, sm.red);
    const double budget = fmax(1.0, (double) ceilf(__fmul_rn(a.p.keep, (float) n_sum)));

    uint64_t prefix = 0, mask = 0;   // the boundary key's bits chosen so far
    uint64_t remaining = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        sm.weight[threadIdx.x] = 0;
        sm.count[threadIdx.x]  = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < n; i += S_THREADS) {
            const uint64_t key = best_key(fscore[i], i);
            if (key != 0 && (key & mask) == prefix) {
                const uint32_t bin = (uint32_t) (key >> shift) & (RADIX_BINS - 1);
                atomicAdd(&sm.weight[bin], (uint32_t) cent_row(a, i, c)[a.d]);
                atomicAdd(&sm.count[bin], 1u);
            }
        }
        __syncthreads();
        if (warp == 0) {
            // lane l scans bins 255 - 8l down to 248 - 8l: the lanes in order cover the bins from the top
            uint32_t w[8];
            uint64_t local = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                w[j] = sm.weight[RADIX_BINS - 1 - 8*lane - j];
                local += w[j];
            }
            uint64_t incl = local;
#pragma unroll
            for (int off = 1; off < WARP_SIZE; off <<= 1) {
                const uint64_t o = __shfl_up_sync(0xFFFFFFFF, incl, off);
                incl += lane >= off ? o : 0;
            }
            const uint64_t excl = incl - local;
            if (shift == 56) {
                const uint64_t total = __shfl_sync(0xFFFFFFFF, incl, WARP_SIZE - 1);
                remaining = (double) total < budget ? 0 : (uint64_t) budget;
                if (lane == 0) {
                    sm.all = remaining == 0;
                }
            }
            if (remaining != 0 && excl < remaining && incl >= remaining) {  // one lane: the crossing
                uint64_t cum = excl;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (cum + w[j] >= remaining) {
                        const uint32_t bin = RADIX_BINS - 1 - 8*lane - j;
                        sm.bin = bin;
                        sm.bin_count = sm.count[bin];
                        sm.remaining = remaining - cum;
                        break;
                    }
                    cum += w[j];
                }
            }
        }
        __syncthreads();
        if (sm.all) {
            break;
        }
        prefix |= (uint64_t) sm.bin << shift;
        mask   |= (uint64_t) (RADIX_BINS - 1) << shift;
        remaining = sm.remaining;
        if (sm.bin_count == 1) {
            break;  // the bin's one cluster is the boundary: prefix (lower bits 0) separates it from those after it
        }
    }
    const uint64_t boundary = sm.all ? 1 : prefix;
    for (int64_t i = threadIdx.x; i < n; i += S_THREADS) {
        kept[i] = best_key(fscore[i], i) >= boundary;
    }
}

__global__ void __launch_bounds__(S_THREADS) centroid_select(const centroid_args a, const centroid_scratch s,
                                                             const int64_t r0) {
    pdl_wait();
    extern __shared__ double log_z[];  // [G]
    __shared__ uint64_t red[S_WARPS];
    __shared__ budget_smem sm;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t w = blockIdx.x, G = a.group, n1 = a.n1;
    const row_coords c = coords_of(a, r0 + w);

    // log Z_g = M + log sum_b S_b exp(M_b - M) over S1's blocks (the CPU's normaliser, summed in double)
    const double * part1 = s.part1 + w*a.n_chunks1*G*2;
    for (int64_t g = warp; g < G; g += S_WARPS) {
        double m = -INFINITY;
        for (int64_t b = lane; b < a.n_chunks1; b += WARP_SIZE) {
            m = fmax(m, part1[(b*G + g)*2]);
        }
        m = warp_max(m);
        double sum = 0.0;
        for (int64_t b = lane; b < a.n_chunks1; b += WARP_SIZE) {
            const double mb = part1[(b*G + g)*2];
            if (mb != -INFINITY) {
                sum += part1[(b*G + g)*2 + 1] * exp(mb - m);
            }
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            log_z[g] = sum > 0.0 ? m + log(sum) : 0.0;
        }
    }
    __syncthreads();

    // level 1: scores of the live clusters; with two levels the coarse ones >= threshold_coarse, and the best one
    const bool two = a.coarse != nullptr;
    uint8_t * kept = s.kept + w*a.n_cent;
    float * fscore = s.fscore + w*a.n_cent;
    const float * z1 = s.z1 + w*G*n1;
    if (!two) {
        for (int64_t i = threadIdx.x; i < n1; i += S_THREADS) {
            float score = -1.0f;
            if (z1[i] != -INFINITY) {  // head 0's -inf marks an empty cluster
                score = group_score(a, log_z, [&](int64_t g) { return z1[g*n1 + i]; });
            }
            fscore[i] = score;
        }
        __syncthreads();
        keep_by_budget(a, c, fscore, kept, sm);
        return;
    }
    uint8_t * kept1 = s.kept_c + w*a.n_coarse;
    uint64_t best = 0;
    for (int64_t i = threadIdx.x; i < n1; i += S_THREADS) {
        float score = -1.0f;
        if (z1[i] != -INFINITY) {
            score = group_score(a, log_z, [&](int64_t g) { return z1[g*n1 + i]; });
        }
        kept1[i] = score >= 0.0f && score >= a.p.threshold_coarse;
        const uint64_t key = best_key(score, i);
        best = key > best ? key : best;
    }
    best = block_max_u64(best, red);
    if (threadIdx.x == 0 && best) {
        kept1[best_index(best)] = 1;
    }
    __syncthreads();

    // level 2: the fine clusters under kept parents, against the coarse normaliser (a warp per cluster)
    const int32_t * parent = parent_row(a, c);
    for (int64_t i = warp; i < a.n_cent; i += S_WARPS) {
        const float * row = cent_row(a, i, c);
        const int32_t pi = parent[i];
        float score = -1.0f;
        if (row[a.d] > 0.0f && pi >= 0 && pi < n1 && kept1[pi]) {  // warp-uniform
            float ce[TABLE_REGS], va[TABLE_REGS];
            load_table_row(row, a.d, ce);
            if (a.p.var_weight > 0.0f) {
                load_table_row(row + a.d + 1, a.d, va);
            }
            score = group_score(a, log_z, [&](int64_t g) {
                const float * qg = q_row(a, c.h*G + g, c);
                const float z = a.p.scale * warp_dot(qg, a.d, ce);
                return a.p.var_weight > 0.0f ? z + warp_variance_term(a, qg, va) : z;
            });
        }
        if (lane == 0) {
            fscore[i] = score;
        }
    }
    __syncthreads();
    keep_by_budget(a, c, fscore, kept, sm);
}

// ---- A: attention over one chunk's selected cells ------------------------------------------------------

// LPC lanes share a cell (VPT vectors of 8 components each per lane); NG heads per pass over the group.
template <typename T, int LPC, int VPT, int NG>
__global__ void __launch_bounds__(A_THREADS) centroid_attend(const centroid_args a, const centroid_scratch s,
                                                             const int64_t r0) {
    pdl_wait();
    constexpr int N_GRP = A_THREADS / LPC;
    constexpr int WIDTH = LPC * VPT * 8;
    static_assert(NG * WIDTH <= A_ACC_MAX, "merge buffer");
    extern __shared__ int32_t a_smem[];  // [chunk] selected cells; then [A_WARPS][NG][WIDTH] the warps' partials
    __shared__ int32_t cnt[A_MAX_TILES*A_WARPS + 1];
    __shared__ float wm[A_WARPS][NG], ws[A_WARPS][NG];

    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int64_t w = blockIdx.y / a.n_pass, g0 = (int64_t) (blockIdx.y % a.n_pass) * NG;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, d = a.d, d_v = a.d_v;
    const int64_t lo = (int64_t) blockIdx.x * a.chunk, hi = lo + a.chunk < a.n_kv ? lo + a.chunk : a.n_kv;
    const int n_tiles = (int) ((hi - lo + A_THREADS - 1) / A_THREADS);

    // 1. the chunk's selected cells in cell order: flags per tile, counts per (tile, warp), a scan, a scatter
    const uint16_t * m = mask_row(a, c);
    const int32_t * cl = cell_row(a, c);
    const uint8_t * kept = s.kept + w*a.n_cent;
    uint32_t flags = 0;
#pragma unroll
    for (int u = 0; u < A_MAX_TILES; ++u) {
        if (u < n_tiles) {  // block-uniform
            const int64_t j = lo + (int64_t) u*A_THREADS + tid;
            bool take = false;
            if (j < hi) {
                const int32_t x = cl[j];
                take = (!m || m[j] != F16_NEG_INF) && (x < 0 || (x < a.n_cent && kept[x]));
            }
            const uint32_t b = __ballot_sync(0xFFFFFFFF, take);
            if (lane == 0) {
                cnt[u*A_WARPS + warp] = __popc(b);
            }
            flags |= uint32_t(take) << u;
        }
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the <= A_MAX_TILES*A_WARPS counts, A_CNT_LANE per lane; the total after them
        const int n_cnt = n_tiles*A_WARPS;
        int v[A_CNT_LANE], sum = 0;
#pragma unroll
        for (int k = 0; k < A_CNT_LANE; ++k) {
            const int idx = lane*A_CNT_LANE + k;
            v[k] = idx < n_cnt ? cnt[idx] : 0;
            sum += v[k];
        }
        int incl = sum;
#pragma unroll
        for (int off = 1; off < WARP_SIZE; off <<= 1) {
            const int y = __shfl_up_sync(0xFFFFFFFF, incl, off);
            if (lane >= off) {
                incl += y;
            }
        }
        int run = incl - sum;
#pragma unroll
        for (int k = 0; k < A_CNT_LANE; ++k) {
            const int idx = lane*A_CNT_LANE + k;
            if (idx < n_cnt) {
                cnt[idx] = run;
            }
            run += v[k];
        }
        if (lane == WARP_SIZE - 1) {
            cnt[A_MAX_TILES*A_WARPS] = incl;
        }
    }
    __syncthreads();
    int32_t * sel = a_smem;
    const uint32_t lt = (1u << lane) - 1;
#pragma unroll
    for (int u = 0; u < A_MAX_TILES; ++u) {
        if (u < n_tiles) {
            const bool take = (flags >> u) & 1;
            const uint32_t b = __ballot_sync(0xFFFFFFFF, take);
            if (take) {
                sel[cnt[u*A_WARPS + warp] + __popc(b & lt)] = (int32_t) (lo + u*A_THREADS + tid);
            }
        }
    }
    const int n_sel = cnt[A_MAX_TILES*A_WARPS];
    __syncthreads();

    // 2. each group of LPC lanes: online softmax over the selected cells grp, grp + N_GRP, ... (two at a time)
    const int grp = tid / LPC, lc = tid % LPC;
    float qr[NG][VPT][8];
#pragma unroll
    for (int g = 0; g < NG; ++g) {
        const bool ok = g0 + g < G;
        const float * qg = q_row(a, c.h*G + (ok ? g0 + g : 0), c);
#pragma unroll
        for (int vv = 0; vv < VPT; ++vv) {
            const int64_t e0 = (int64_t) (lc + LPC*vv)*8;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                qr[g][vv][e] = ok && e0 + e < d ? qg[e0 + e] : 0.0f;
            }
        }
    }
    float mx[NG], sm[NG], acc[NG][VPT][8];
#pragma unroll
    for (int g = 0; g < NG; ++g) {
        mx[g] = -INFINITY;
        sm[g] = 0.0f;
#pragma unroll
        for (int vv = 0; vv < VPT; ++vv) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                acc[g][vv][e] = 0.0f;
            }
        }
    }
    const char * kbase = a.k + c.h*a.k_nb2 + c.st*a.k_nb3;
    const char * vbase = a.v + c.h*a.v_nb2 + c.st*a.v_nb3;
    for (int base = 0; base < n_sel; base += 2*N_GRP) {  // block-uniform trip count: the shuffles below
        const int i0 = base + grp, i1 = base + N_GRP + grp;
        const bool ok0 = i0 < n_sel, ok1 = i1 < n_sel;
        float k0[VPT][8], k1[VPT][8], v0[VPT][8], v1[VPT][8];
        const int64_t j0 = ok0 ? sel[i0] : 0, j1 = ok1 ? sel[i1] : 0;
        const T * kr0 = (const T *) (kbase + j0*a.k_nb1), * kr1 = (const T *) (kbase + j1*a.k_nb1);
        const T * vr0 = (const T *) (vbase + j0*a.v_nb1), * vr1 = (const T *) (vbase + j1*a.v_nb1);
#pragma unroll
        for (int vv = 0; vv < VPT; ++vv) {
            const int64_t e0 = (int64_t) (lc + LPC*vv)*8;
            load8_row(kr0, e0, ok0 ? d : 0, a.vec_kv, k0[vv]);
            load8_row(kr1, e0, ok1 ? d : 0, a.vec_kv, k1[vv]);
            load8_row(vr0, e0, ok0 ? d_v : 0, a.vec_kv, v0[vv]);
            load8_row(vr1, e0, ok1 ? d_v : 0, a.vec_kv, v1[vv]);
        }
        float dt0[NG], dt1[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            dt0[g] = 0.0f;
            dt1[g] = 0.0f;
#pragma unroll
            for (int vv = 0; vv < VPT; ++vv) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    dt0[g] += qr[g][vv][e] * k0[vv][e];
                    dt1[g] += qr[g][vv][e] * k1[vv][e];
                }
            }
#pragma unroll
            for (int off = LPC/2; off > 0; off >>= 1) {
                dt0[g] += __shfl_xor_sync(0xFFFFFFFF, dt0[g], off);
                dt1[g] += __shfl_xor_sync(0xFFFFFFFF, dt1[g], off);
            }
        }
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            const float l0 = ok0 ? logit_of(a, dt0[g]) : -INFINITY;
            const float l1 = ok1 ? logit_of(a, dt1[g]) : -INFINITY;
            const float mn = fmaxf(mx[g], fmaxf(l0, l1));
            if (mn == -INFINITY) {
                continue;
            }
            const float f = __expf(mx[g] - mn), p0 = __expf(l0 - mn), p1 = __expf(l1 - mn);
            sm[g] = sm[g]*f + p0 + p1;
#pragma unroll
            for (int vv = 0; vv < VPT; ++vv) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    acc[g][vv][e] = acc[g][vv][e]*f + p0*v0[vv][e] + p1*v1[vv][e];
                }
            }
            mx[g] = mn;
        }
    }

    // 3. merge the groups: within the warp by shuffles, then across the warps in shared memory, in warp order
#pragma unroll
    for (int off = LPC; off < WARP_SIZE; off <<= 1) {
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            const float m2 = __shfl_xor_sync(0xFFFFFFFF, mx[g], off), s2 = __shfl_xor_sync(0xFFFFFFFF, sm[g], off);
            const float mn = fmaxf(mx[g], m2);
            const float f1 = mn == -INFINITY ? 0.0f : __expf(mx[g] - mn);
            const float f2 = mn == -INFINITY ? 0.0f : __expf(m2 - mn);
            sm[g] = sm[g]*f1 + s2*f2;
#pragma unroll
            for (int vv = 0; vv < VPT; ++vv) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float a2 = __shfl_xor_sync(0xFFFFFFFF, acc[g][vv][e], off);
                    acc[g][vv][e] = acc[g][vv][e]*f1 + a2*f2;
                }
            }
            mx[g] = mn;
        }
    }
    float * wacc = (float *) a_smem;  // the selected cells are no longer read (barrier above)
    __syncthreads();
    if (lane < LPC) {
#pragma unroll
        for (int g = 0; g < NG; ++g) {
#pragma unroll
            for (int vv = 0; vv < VPT; ++vv) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    wacc[(warp*NG + g)*WIDTH + (lc + LPC*vv)*8 + e] = acc[g][vv][e];
                }
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                wm[warp][g] = mx[g];
                ws[warp][g] = sm[g];
            }
        }
    }
    __syncthreads();
    float * part = s.part + (w*a.n_chunks + blockIdx.x)*G*(2 + d_v);
    for (int64_t idx = tid; idx < NG*d_v; idx += A_THREADS) {
        const int g = (int) (idx / d_v);
        const int64_t comp = idx % d_v;
        if (g0 + g >= G) {
            continue;
        }
        float M = -INFINITY;
        for (int wp = 0; wp < A_WARPS; ++wp) {
            M = fmaxf(M, wm[wp][g]);
        }
        float S = 0.0f, acc_c = 0.0f;
        if (M != -INFINITY) {
            for (int wp = 0; wp < A_WARPS; ++wp) {
                const float f = __expf(wm[wp][g] - M);
                S += ws[wp][g]*f;
                acc_c += wacc[(wp*NG + g)*WIDTH + comp]*f;
            }
        }
        float * pg = part + (g0 + g)*(2 + d_v);
        pg[2 + comp] = acc_c;
        if (comp == 0) {
            pg[0] = M;
            pg[1] = S;
        }
    }
}

// ---- M: the chunks' partials into the output (the CPU's phase C) ------------------------------------------

__global__ void __launch_bounds__(M_THREADS) centroid_merge(const centroid_args a, const centroid_scratch s,
                                                            const int64_t r0) {
    pdl_wait();
    const int64_t g = blockIdx.x, w = blockIdx.y, G = a.group, d_v = a.d_v;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t stride = G*(2 + d_v);
    const float * p0 = s.part + (w*a.n_chunks*G + g)*(2 + d_v);
    float * out = (float *) (a.dst + (c.h*G + g)*a.o_nb1 + c.t*a.o_nb2 + c.st*a.o_nb3);
    float mx = -INFINITY;
    for (int64_t ch = 0; ch < a.n_chunks; ++ch) {
        mx = fmaxf(mx, p0[ch*stride]);
    }
    if (mx == -INFINITY) {  // no visible cell selected
        for (int64_t comp = threadIdx.x; comp < d_v; comp += M_THREADS) {
            out[comp] = 0.0f;
        }
        return;
    }
    double sum = 0.0;
    for (int64_t ch = 0; ch < a.n_chunks; ++ch) {
        const float pm = p0[ch*stride];
        if (pm != -INFINITY) {
            sum += (double) p0[ch*stride + 1] * (double) __expf(pm - mx);
        }
    }
    const float inv = (float) (1.0 / sum);
    for (int64_t comp = threadIdx.x; comp < d_v; comp += M_THREADS) {
        float o = 0.0f;
        for (int64_t ch = 0; ch < a.n_chunks; ++ch) {
            const float pm = p0[ch*stride];
            if (pm != -INFINITY) {
                o += __expf(pm - mx) * p0[ch*stride + 2 + comp];
            }
        }
        out[comp] = o * inv;
    }
}

// ---- host ------------------------------------------------------------------------------------------

template <typename T, int LPC, int VPT, int NG>
void launch_attend(dim3 grid, size_t smem, cudaStream_t stream, const centroid_args & a, const centroid_scratch & s,
                   int64_t r0) {
    if constexpr (NG * LPC * VPT * 8 <= A_ACC_MAX) {
        ggml_cuda_kernel_launch(centroid_attend<T, LPC, VPT, NG>, ggml_cuda_kernel_launch_params(grid, A_THREADS, smem, stream),
                                a, s, r0);
    } else {
        GGML_ABORT("centroid_attn: no kernel for %d heads per pass at %d components", NG, LPC * VPT * 8);
    }
}

template <typename T, int LPC, int VPT>
void launch_attend_ng(int ng, dim3 grid, size_t smem, cudaStream_t stream, const centroid_args & a,
                      const centroid_scratch & s, int64_t r0) {
    switch (ng) {
        case 1:  launch_attend<T, LPC, VPT, 1>(grid, smem, stream, a, s, r0); break;
        case 2:  launch_attend<T, LPC, VPT, 2>(grid, smem, stream, a, s, r0); break;
        case 4:  launch_attend<T, LPC, VPT, 4>(grid, smem, stream, a, s, r0); break;
        default: launch_attend<T, LPC, VPT, 8>(grid, smem, stream, a, s, r0); break;
    }
}

template <typename T>
void launch_attend_shape(int lpc, int vpt, int ng, dim3 grid, size_t smem, cudaStream_t stream,
                         const centroid_args & a, const centroid_scratch & s, int64_t r0) {
    switch (lpc * vpt) {
        case 4:  launch_attend_ng<T, 4, 1> (ng, grid, smem, stream, a, s, r0); break;
        case 8:  launch_attend_ng<T, 8, 1> (ng, grid, smem, stream, a, s, r0); break;
        case 16: launch_attend_ng<T, 16, 1>(ng, grid, smem, stream, a, s, r0); break;
        case 32: launch_attend_ng<T, 32, 1>(ng, grid, smem, stream, a, s, r0); break;
        default: launch_attend_ng<T, 32, 2>(ng, grid, smem, stream, a, s, r0); break;
    }
}

static bool aligned16(const void * p) { return ((uintptr_t) p & 15) == 0; }
static bool strides16(const ggml_tensor * t) { return t->nb[1] % 16 == 0 && t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0; }

// Scratch of one wave: each array 256-byte aligned.
struct scratch_plan {
    size_t z1, part1, kept, kept_c, fscore, part, total;
};
static scratch_plan plan_scratch(const centroid_args & a, int64_t W) {
    const int64_t G = a.group;
    scratch_plan p;
    size_t o = 0;
    auto take = [&](size_t bytes) { const size_t at = o; o += (bytes + 255) & ~size_t(255); return at; };
    p.z1     = take(sizeof(float) * W*G*a.n1);
    p.part1  = take(sizeof(double) * W*a.n_chunks1*G*2);
    p.kept   = take(W*a.n_cent);
    p.kept_c = take(W*a.n_coarse);
    p.fscore = take(sizeof(float) * W*a.n_cent);
    p.part   = take(sizeof(float) * W*a.n_chunks*G*(2 + a.d_v));
    p.total  = o;
    return p;
}

}  // namespace

bool ggml_cuda_centroid_attn_supported(int device, const ggml_tensor * op) {
    GGML_UNUSED(device);
    const ggml_tensor * q = op->src[0], * k = op->src[1], * v = op->src[2], * mask = op->src[3];
    const ggml_tensor * cent = op->src[4], * cell = op->src[5], * coarse = op->src[6], * parent = op->src[7];
    const bool kv_type_ok = k->type == GGML_TYPE_F32 || k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_BF16;
    if (q->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32 || !kv_type_ok || v->type != k->type ||
        (mask && mask->type != GGML_TYPE_F16) || cent->type != GGML_TYPE_F32 || cell->type != GGML_TYPE_I32 ||
        (coarse && coarse->type != GGML_TYPE_F32) || (parent && parent->type != GGML_TYPE_I32) ||
        (coarse == nullptr) != (parent == nullptr)) {
        return false;
    }
    for (const ggml_tensor * t : { q, k, v, mask, cent, cell, coarse, parent, (const ggml_tensor *) op }) {
        if (t && t->nb[0] != ggml_type_size(t->type)) {
            return false;
        }
    }
    const int64_t G = q->ne[2] / k->ne[2];
    return q->ne[0] <= MAX_HEAD_DIM && v->ne[0] <= MAX_HEAD_DIM && G <= MAX_G && k->ne[1] <= INT32_MAX &&
           cent->ne[1] <= INT32_MAX && (!coarse || coarse->ne[1] <= INT32_MAX);
}

void ggml_cuda_centroid_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * mask = dst->src[3];
    const ggml_tensor * cent = dst->src[4], * cell = dst->src[5], * coarse = dst->src[6], * parent = dst->src[7];
    GGML_ASSERT(ggml_cuda_centroid_attn_supported(ctx.device, dst));

    centroid_args a = {};
    a.q = (const char *) q->data; a.k = (const char *) k->data; a.v = (const char *) v->data;
    a.mask = mask ? (const char *) mask->data : nullptr;
    a.cent = (const char *) cent->data; a.cell = (const char *) cell->data;
    a.coarse = coarse ? (const char *) coarse->data : nullptr;
    a.parent = parent ? (const char *) parent->data : nullptr;
    a.dst = (char *) dst->data;
    a.d = q->ne[0]; a.n_q = q->ne[1]; a.n_head = q->ne[2]; a.ns = q->ne[3];
    a.n_kv = k->ne[1]; a.n_head_kv = k->ne[2]; a.d_v = v->ne[0]; a.group = a.n_head / a.n_head_kv;
    a.n_cent = cent->ne[1]; a.n_coarse = coarse ? coarse->ne[1] : 0;
    a.n1 = coarse ? a.n_coarse : a.n_cent;
    a.q_nb1 = q->nb[1]; a.q_nb2 = q->nb[2]; a.q_nb3 = q->nb[3];
    a.k_nb1 = k->nb[1]; a.k_nb2 = k->nb[2]; a.k_nb3 = k->nb[3];
    a.v_nb1 = v->nb[1]; a.v_nb2 = v->nb[2]; a.v_nb3 = v->nb[3];
    if (mask) {
        a.m_nb1 = mask->nb[1]; a.m_nb3 = mask->nb[3]; a.m_ns = mask->ne[3];
    }
    a.c_nb1 = cent->nb[1]; a.c_nb2 = cent->nb[2]; a.c_nb3 = cent->nb[3];
    if (coarse) {
        a.cc_nb1 = coarse->nb[1]; a.cc_nb2 = coarse->nb[2]; a.cc_nb3 = coarse->nb[3];
        a.pa_nb1 = parent->nb[1]; a.pa_nb2 = parent->nb[2];
    }
    a.cl_nb1 = cell->nb[1]; a.cl_nb2 = cell->nb[2];
    a.o_nb1 = dst->nb[1]; a.o_nb2 = dst->nb[2]; a.o_nb3 = dst->nb[3];
    a.p = ggml_centroid_get_op_params(dst);
    a.vec_kv = aligned16(k->data) && strides16(k) && aligned16(v->data) && strides16(v);

    // kernel A's shape: LPC lanes x VPT vectors of 8 cover a K and a V row; NG heads per pass
    const int64_t G = a.group;
    const int64_t n_vec = (std::max(a.d, a.d_v) + 7) / 8;
    const int lpc = n_vec <= 4 ? 4 : n_vec <= 8 ? 8 : n_vec <= 16 ? 16 : 32;
    const int vpt = n_vec <= 32 ? 1 : 2;
    const int width = lpc * vpt * 8;
    int ng = G >= 5 ? 8 : G >= 3 ? 4 : G == 2 ? 2 : 1;
    while (ng * width > A_ACC_MAX) {
        ng /= 2;
    }
    a.n_pass = (int32_t) ((G + ng - 1) / ng);

    const int64_t n_rows = a.n_head_kv * a.n_q * a.ns;
    const int64_t W0 = std::max<int64_t>(1, std::min<int64_t>({ n_rows, 65535 / a.n_pass, 8192 }));
    // cells per block of kernel A: the wave's blocks fill the resident slots (A_BLOCKS_SM per SM) once, without a
    // second, partial wave (whole tiles, at most A_MAX_TILES: long rows may still take more blocks)
    const int64_t n_sm = ggml_cuda_info().devices[ctx.device].nsm;
    const int64_t max_chunks = (a.n_kv + A_THREADS - 1) / A_THREADS;
    const int64_t want = std::max<int64_t>(1, std::min<int64_t>(max_chunks, A_BLOCKS_SM*n_sm / (W0*a.n_pass)));
    int64_t chunk = (a.n_kv + want - 1) / want;
    chunk = std::min<int64_t>((chunk + A_THREADS - 1) / A_THREADS * A_THREADS, A_MAX_TILES*A_THREADS);
    a.chunk = (int32_t) chunk;
    a.n_chunks = (int32_t) ((a.n_kv + chunk - 1) / chunk);
    a.n_chunks1 = (int32_t) ((a.n1 + S_CLUSTERS - 1) / S_CLUSTERS);

    const int64_t row_bytes = plan_scratch(a, 1).total;
    const int64_t W = std::max<int64_t>(1, std::min<int64_t>(W0, WAVE_BYTES / row_bytes));
    const scratch_plan plan = plan_scratch(a, W);
    ggml_cuda_pool_alloc<char> buf(ctx.pool(), plan.total);
    char * base = buf.get();
    centroid_scratch s;
    s.z1     = (float *)   (base + plan.z1);
    s.part1  = (double *)  (base + plan.part1);
    s.kept   = (uint8_t *) (base + plan.kept);
    s.kept_c = (uint8_t *) (base + plan.kept_c);
    s.fscore = (float *)   (base + plan.fscore);
    s.part   = (float *)   (base + plan.part);

    const size_t smem_s1 = sizeof(float) * (G + 1)*S_CLUSTERS;
    const size_t smem_s2 = sizeof(double) * G;
    const size_t smem_a  = std::max(sizeof(int32_t) * chunk, sizeof(float) * A_WARPS*ng*width);
    cudaStream_t stream = ctx.stream();
    for (int64_t r0 = 0; r0 < n_rows; r0 += W) {
        const int64_t nw = std::min(W, n_rows - r0);
        const ggml_cuda_kernel_launch_params lp1(dim3((unsigned) a.n_chunks1, (unsigned) nw), S_THREADS, smem_s1, stream);
        if (a.d <= 4*WARP_SIZE) {
            ggml_cuda_kernel_launch(centroid_level1<4>, lp1, a, s, r0);
        } else if (a.d <= 8*WARP_SIZE) {
            ggml_cuda_kernel_launch(centroid_level1<8>, lp1, a, s, r0);
        } else {
            ggml_cuda_kernel_launch(centroid_level1<TABLE_REGS>, lp1, a, s, r0);
        }
        ggml_cuda_kernel_launch(centroid_select, ggml_cuda_kernel_launch_params(dim3((unsigned) nw), S_THREADS, smem_s2, stream),
                                a, s, r0);
        const dim3 grid_a((unsigned) a.n_chunks, (unsigned) (nw*a.n_pass));
        switch (k->type) {
            case GGML_TYPE_F32:  launch_attend_shape<float>      (lpc, vpt, ng, grid_a, smem_a, stream, a, s, r0); break;
            case GGML_TYPE_F16:  launch_attend_shape<half>       (lpc, vpt, ng, grid_a, smem_a, stream, a, s, r0); break;
            default:             launch_attend_shape<nv_bfloat16>(lpc, vpt, ng, grid_a, smem_a, stream, a, s, r0); break;
        }
        ggml_cuda_kernel_launch(centroid_merge, ggml_cuda_kernel_launch_params(dim3((unsigned) G, (unsigned) nw),
                                M_THREADS, 0, stream), a, s, r0);
        CUDA_CHECK(cudaGetLastError());
    }
}
