// Kernel LV of the CUDA SparQ op: exact logits over I2, softmax, the Sparse-V cut, the weighted sum of V and the
// mean-value mix (included by sparq-attn.cu only; the op's files: sparq-attn-common.cuh). docs/design.md,
// "CUDA kernels".
#pragma once

#include "sparq-attn-common.cuh"

namespace {

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

// Kernel LV (grid: (slices of SLICE output components) x heads, rows): the exact logits of one head over I2
// into shared memory, then its softmax over I2 (recomputed by each block of the row, in a fixed order), the
// Sparse-V threshold, and the weighted sum of the V rows' slice: 8 components per thread, SLICE/8 threads per
// cell, the cell groups reduced through shared memory; then the mean-value mix.
// SLICE: 32 when the rows are few (one decode step of one sequence: more blocks per row shorten the row's chain);
// 128 when the 32-slices would fill more than a wave (batched decode: every block of a head recomputes the
// head's logits over I2, so wide slices do that work once instead of d_v/32 times). lv_slice() picks.
// T: the float type of K and V, or kv_any (quantized or mixed types: each row's 8-value pieces dequantized from their
// block as they are loaded).
constexpr int V_THREADS = 256;
constexpr int V_SLICE_NARROW = 32;
constexpr int V_SLICE_WIDE   = 128;
template <int SLICE> __host__ __device__ constexpr int v_tpc()    { return SLICE / 8; }                 // threads per cell
template <int SLICE> __host__ __device__ constexpr int v_groups() { return V_THREADS / v_tpc<SLICE>(); } // cells in flight per round

// The logits: a group of tpr threads per cell (8 components per thread and vector), CIF cells in flight per group,
// the V rows' first slice loaded together with the K rows. Each block of the head reads the K rows over I2 (from L2
// after the first); one kernel, as separate logits and values kernels measured slower.
template <typename T, int VPT, int SLICE>
__global__ void __launch_bounds__(V_THREADS, 2) sparq_logits_values(const sparq_args a, const sparq_scratch s, int64_t r0) {
    constexpr int V_SLICE = SLICE, V_TPC = v_tpc<SLICE>(), V_GROUPS = v_groups<SLICE>();
    extern __shared__ __align__(16) unsigned char smlv[];  // [k2] I2, [k2] logits of head g
    __shared__ float red[32];
    __shared__ float part[V_GROUPS][V_SLICE];
    SPARQ_TIMING_MARKS(6);
    SPARQ_TL_SCOPE(TL_LV);
    pdl_wait();
    SPARQ_TL_WAITED();
    SPARQ_TIMING_MARK(0);
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
    // I2 loaded with the row's kind and size (its entries past n_sel are not read), and the mean-value mix's inputs
    // with them: one round trip before the K rows
    for (int64_t i = tid; i < k2; i += blockDim.x) {
        i2[i] = s.i2[w*k2 + i];
    }
    const bool mix = a.p.mean_on && tid < V_SLICE && dim0 + tid < d_v;
    float mix_alpha = 0.0f, mix_vsum = 0.0f, mix_n = 0.0f;
    if (mix) {
        mix_alpha = s.alpha[w*G + g];  // written by the selection for sparse rows only, used for those only
        if (a.vsum) {
            const float * vs = (const float *) (a.vsum + c.h*a.vs_nb1 + c.t*a.vs_nb2 + c.st*a.vs_nb3);
            mix_vsum = vs[dim0 + tid];
            mix_n = vs[d_v];
        }
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
    SPARQ_TIMING_MARK(1);
    // this thread's V components of the first round of cells (grp, grp + V_GROUPS), loaded with the K rows
    const char * vb = a.v + c.h*a.v_nb2 + c.st*a.v_nb3;
    const int64_t e0v = dim0 + lv*8;
    float xv[2][8];
    auto load_v = [&](int64_t i0) {
#pragma unroll
        for (int uu = 0; uu < 2; ++uu) {
            const int64_t i = i0 + uu*V_GROUPS;
            if (i < n_sel) {
                const char * vrow = vb + (int64_t) i2[i]*a.v_nb1;
                if constexpr (std::is_same_v<T, kv_any>) {
                    dequant8(vrow, a.v_type, e0v, d_v, xv[uu]);
                } else {
                    load8_row((const T *) vrow, e0v, d_v, a.vec_kv, xv[uu]);
                }
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
    constexpr int CIF = (sizeof(raw8<T>) > 16 ? 4 : 8) / VPT;  // 8 values in 32 bytes (f32, dequantized): half as many
    const char * kb = a.k + c.h*a.k_nb2 + c.st*a.k_nb3;
    for (int64_t ib = 0; ib < n_sel; ib += CIF*slots) {
        raw8<T> x[CIF][VPT];
#pragma unroll
        for (int uu = 0; uu < CIF; ++uu) {
            const int64_t i = ib + uu*slots + slot;
            const char * row = kb + (int64_t) (i < n_sel ? i2[i] : 0)*a.k_nb1;
#pragma unroll
            for (int vi = 0; vi < VPT; ++vi) {
                const int64_t e0 = (int64_t) (lr + vi*tpr)*8;
                if (i < n_sel && e0 < d) {
                    if constexpr (std::is_same_v<T, kv_any>) {
                        dequant8(row, a.k_type, e0, d, x[uu][vi].f);
                    } else {
                        load_raw8_row((const T *) row, e0, d, a.vec_kv, x[uu][vi]);
                    }
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
    SPARQ_TIMING_MARK(2);
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
    SPARQ_TIMING_MARK(3);
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
    SPARQ_TIMING_MARK(4);
    if (tid < V_SLICE && dim0 + tid < d_v) {
        float y = 0.0f;
        for (int q = 0; q < V_GROUPS; ++q) {
            y += part[q][tid];
        }
        if (kind == ROW_SPARSE && mix) {
            const int64_t dim = dim0 + tid;
            float vmean;
            if (a.vsum) {
                vmean = mix_n > 0.0f ? mix_vsum / mix_n : 0.0f;
            } else {
                const uint16_t * m = mask_row(a, c);
                float vsum = 0.0f;
                for (int64_t j = 0; j < a.n_kv; ++j) {
                    if (visible(m, j)) {
                        if constexpr (std::is_same_v<T, kv_any>) {
                            vsum += dequant1(vb + j*a.v_nb1, a.v_type, dim);
                        } else {
                            vsum += to_f32(((const T *) (vb + j*a.v_nb1))[dim]);
                        }
                    }
                }
                vmean = vsum / (float) ri[RI_N_VIS];
            }
            y = mix_alpha*y + (1.0f - mix_alpha)*vmean;
        }
        out[dim0 + tid] = y;
    }
    SPARQ_TIMING_MARK(5);
    SPARQ_TIMING_PRINT("LV: ri+i2, logits, softmax, values, mean+write", w + blockIdx.x, 6);
}

}  // namespace
