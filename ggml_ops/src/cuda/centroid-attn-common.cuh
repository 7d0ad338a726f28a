// Shared device code of the CUDA centroid op (ggml_centroid_attn): the kernels' sizes, the op's arguments and scratch,
// row addressing, reductions, keys and group scores. The op's files:
//   centroid-attn.cu             dispatch: host code, launches
//   centroid-attn-common.cuh     this file
//   centroid-attn-select.cuh     kernels S1 (level-1 scores) and S2 (kept clusters)
//   centroid-attn-attend.cuh     kernels A (attention over a chunk's selected cells) and M (the chunks' merge)
// The headers are included by centroid-attn.cu only (one translation unit; the anonymous namespace is its own).
// Structure: centroid-attn.cu's header and docs/design.md, "CUDA kernels".
#pragma once

#include "attn-cuda-common.cuh"

#include "ggml-centroid.h"

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

}  // namespace
