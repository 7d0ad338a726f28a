// Kernels A and M of the CUDA centroid op (included by centroid-attn.cu only; the op's files:
// centroid-attn-common.cuh): attention over each chunk's selected cells, then the chunks' partials into the output.
#pragma once

#include "centroid-attn-common.cuh"

namespace {

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

}  // namespace
