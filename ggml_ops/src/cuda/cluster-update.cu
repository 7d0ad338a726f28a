// CUDA kernel of ggml_cluster_update. Semantics: ggml_ops/include/ggml-centroid.h; the CPU kernel
// (ggml_ops/src/cpu/cluster-update-cpu.cpp) is the reference.
//
// Deterministic by construction, with the CPU's summation order: one warp per (cluster i, problem h). The warp
// scans problem h's assignments in row order, 32 rows a step (a ballot marks the rows of cluster i), and adds
// the members' rows in increasing row index, lane l holding components l, l + 32, ... So every component's sum
// is the same sequence of float additions as the CPU's (rows in order), with no atomics and no sort.
// Cost: every warp reads its problem's P assignments (n_clusters x P x 4 bytes per problem, served by L1/L2:
// the warps of one block and their neighbours read the same array), the same order of work as the
// similarity matrix the k-means iteration's ggml_mul_mat / ggml_argmax already produce and read; each member
// row is read once. The spherical norm is summed in double, as on the CPU (a warp tree instead of a loop: the
// normalised rows can differ from the CPU's in the last bit). The variances (GGML_CLUSTER_TABLE_VAR) come from the
// same scan as shifted sums (see the kernel), where the CPU takes a second pass about the mean: the same quantity
// to float32 rounding, not bit for bit.
#include "cluster-update.cuh"
#include "attn-cuda-common.cuh"

#include "ggml-centroid.h"

#include <cstdint>

namespace {

using namespace attn_cuda;  // pdl_wait, warp_sum

constexpr int CU_WARPS     = 4;                     // clusters per block
constexpr int CU_MAX_DIM   = 1024;
constexpr int CU_SCAN      = 4;                     // assignment loads in flight per lane (rows p + 32 k)
constexpr int CU_BATCH     = 4;                     // member rows loaded together

struct cluster_args {
    const char * x; const char * assign; const char * prev;
    char * dst;
    int64_t d, P, H, n;
    size_t x_nb1, x_nb2, a_nb1, p_nb1, p_nb2, o_nb1, o_nb2;
    bool table;  // the table modes
    bool var;    // GGML_CLUSTER_TABLE_VAR: the variances after the table
};

// Calls add(xv, nb) for the rows of problem h assigned to cluster i, in increasing row index, CU_BATCH member
// rows loaded at once: xv[m][e] = component lane + 32 e of the m-th row (0 past d), m < nb. Returns the count.
template <int REGS, typename AddFn>
__device__ __forceinline__ int64_t scan_members(const cluster_args & a, int64_t i, int64_t h, AddFn add) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int32_t * as = (const int32_t *) (a.assign + h*a.a_nb1);
    const char * xh = a.x + h*a.x_nb2;
    int64_t count = 0;
    for (int64_t p0 = 0; p0 < a.P; p0 += CU_SCAN*WARP_SIZE) {
        int32_t av[CU_SCAN];
#pragma unroll
        for (int k = 0; k < CU_SCAN; ++k) {
            const int64_t p = p0 + k*WARP_SIZE + lane;
            av[k] = p < a.P ? __ldg(as + p) : -1;
        }
#pragma unroll
        for (int k = 0; k < CU_SCAN; ++k) {
            uint32_t b = __ballot_sync(0xFFFFFFFF, av[k] == (int32_t) i);
            count += __popc(b);
            while (b) {  // the members of these 32 rows, CU_BATCH rows loaded at once, added in row order
                int64_t rows[CU_BATCH];
                int nb = 0;
#pragma unroll
                for (int m = 0; m < CU_BATCH; ++m) {
                    rows[m] = -1;
                    if (b) {
                        rows[m] = p0 + k*WARP_SIZE + __ffs(b) - 1;
                        b &= b - 1;
                        nb = m + 1;
                    }
                }
                float xv[CU_BATCH][REGS];
#pragma unroll
                for (int m = 0; m < CU_BATCH; ++m) {
                    const float * xr = (const float *) (xh + (m < nb ? rows[m] : 0)*a.x_nb1);
#pragma unroll
                    for (int e = 0; e < REGS; ++e) {
                        const int64_t c = lane + WARP_SIZE*e;
                        xv[m][e] = m < nb && c < a.d ? xr[c] : 0.0f;
                    }
                }
                add(xv, nb);
            }
        }
    }
    return count;
}

// REGS components per lane: d <= 32 REGS. VAR (GGML_CLUSTER_TABLE_VAR): the members' variances too, in the same
// scan, from their deviations from the first member (shifted sums: var = (S2 - S1^2 / N) / N, which stays exact for
// identical members and has no cancellation for a tight cluster far from the origin). A second scan about the mean,
// as the CPU kernel does, cost the k-means of a 7B layer ~35 ms (one scan of the assignments per cluster).
template <int REGS, bool VAR>
__global__ void __launch_bounds__(CU_WARPS*WARP_SIZE) cluster_update_kernel(const cluster_args a) {
    pdl_wait();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t i = (int64_t) blockIdx.x*CU_WARPS + warp, h = blockIdx.y;
    if (i >= a.n) {  // warp-uniform; no block barrier below
        return;
    }
    float acc[REGS], k0[VAR ? REGS : 1], s1[VAR ? REGS : 1], s2[VAR ? REGS : 1];
#pragma unroll
    for (int e = 0; e < REGS; ++e) {
        acc[e] = 0.0f;
        if constexpr (VAR) {
            k0[e] = 0.0f; s1[e] = 0.0f; s2[e] = 0.0f;
        }
    }
    bool first = true;  // warp-uniform: no member seen yet
    const int64_t count = scan_members<REGS>(a, i, h, [&](const float (&xv)[CU_BATCH][REGS], int nb) {
        if constexpr (VAR) {
            if (first) {
#pragma unroll
                for (int e = 0; e < REGS; ++e) {
                    k0[e] = xv[0][e];
                }
                first = false;
            }
        }
#pragma unroll
        for (int m = 0; m < CU_BATCH; ++m) {
            if (m < nb) {
#pragma unroll
                for (int e = 0; e < REGS; ++e) {
                    acc[e] += xv[m][e];
                    if constexpr (VAR) {
                        const float dev = xv[m][e] - k0[e];
                        s1[e] += dev;
                        s2[e] += dev * dev;
                    }
                }
            }
        }
    });
    float * out = (float *) (a.dst + i*a.o_nb1 + h*a.o_nb2);
    if (a.table) {  // the mean of the members, then the size (zeros for an empty cluster); VAR: then the variances
        const float inv = count > 0 ? __frcp_rn((float) count) : 0.0f;  // IEEE, as the CPU (fast math would approximate)
#pragma unroll
        for (int e = 0; e < REGS; ++e) {
            const int64_t c = lane + WARP_SIZE*e;
            if (c < a.d) {
                out[c] = acc[e] * inv;
                if constexpr (VAR) {
                    out[a.d + 1 + c] = fmaxf(0.0f, s2[e] - s1[e] * s1[e] * inv) * inv;
                }
            }
        }
        if (lane == 0) {
            out[a.d] = (float) count;
        }
        return;
    }
    if (count == 0) {  // spherical, no member: the previous centroid
        const float * pr = (const float *) (a.prev + i*a.p_nb1 + h*a.p_nb2);
        for (int64_t c = lane; c < a.d; c += WARP_SIZE) {
            out[c] = pr[c];
        }
        return;
    }
    double ss = 0.0;
#pragma unroll
    for (int e = 0; e < REGS; ++e) {
        ss += (double) acc[e] * acc[e];  // components past d hold 0
    }
    ss = warp_sum(ss);
    const float inv = ss > 0.0 ? (float) (1.0 / sqrt(ss)) : 0.0f;
#pragma unroll
    for (int e = 0; e < REGS; ++e) {
        const int64_t c = lane + WARP_SIZE*e;
        if (c < a.d) {
            out[c] = acc[e] * inv;
        }
    }
}

// GGML_CLUSTER_ASSIGN (ggml_cluster_assign): one warp per row of sim, the lanes over the clusters (coalesced loads,
// several in flight), each lane keeping its last largest value; the warp's tree then keeps the larger value, and
// the higher index among equal ones: ties go to the higher cluster, as on the CPU.
constexpr int CA_WARPS = 8;  // rows per block

__global__ void __launch_bounds__(CA_WARPS*WARP_SIZE) cluster_assign_kernel(const char * sim, size_t s_nb1, size_t s_nb2,
                                                                             char * dst, size_t o_nb1, int64_t n,
                                                                             int64_t P, int64_t n_rows) {
    pdl_wait();
    const int lane = threadIdx.x % WARP_SIZE;
    const int64_t r = (int64_t) blockIdx.x * CA_WARPS + threadIdx.x / WARP_SIZE;
    if (r >= n_rows) {
        return;
    }
    const int64_t p = r % P, h = r / P;
    const float * s = (const float *) (sim + p*s_nb1 + h*s_nb2);
    float best = -INFINITY;
    int32_t idx = -1;
#pragma unroll 8
    for (int64_t i = lane; i < n; i += WARP_SIZE) {
        const float v = s[i];
        if (v >= best) {
            best = v;
            idx = (int32_t) i;
        }
    }
#pragma unroll
    for (int off = WARP_SIZE/2; off > 0; off >>= 1) {
        const float   ov = __shfl_xor_sync(0xFFFFFFFF, best, off);
        const int32_t oi = __shfl_xor_sync(0xFFFFFFFF, idx, off);
        if (ov > best || (ov == best && oi > idx)) {
            best = ov;
            idx = oi;
        }
    }
    if (lane == 0) {
        ((int32_t *) (dst + h*o_nb1))[p] = idx;
    }
}

void cluster_assign(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * sim = dst->src[0];
    const int64_t n_rows = sim->ne[1] * sim->ne[2];
    const dim3 grid((unsigned) ((n_rows + CA_WARPS - 1) / CA_WARPS));
    const ggml_cuda_kernel_launch_params lp(grid, CA_WARPS*WARP_SIZE, 0, ctx.stream());
    ggml_cuda_kernel_launch(cluster_assign_kernel, lp, (const char *) sim->data, sim->nb[1], sim->nb[2], (char *) dst->data,
                            dst->nb[1], sim->ne[0], sim->ne[1], n_rows);
}

}  // namespace

bool ggml_cuda_cluster_update_supported(int device, const ggml_tensor * op) {
    GGML_UNUSED(device);
    if (ggml_get_op_params_i32(op, 0) == GGML_CLUSTER_ASSIGN) {
        const ggml_tensor * sim = op->src[0];
        return sim->type == GGML_TYPE_F32 && sim->nb[0] == sizeof(float) && op->type == GGML_TYPE_I32 &&
               op->nb[0] == sizeof(int32_t) && (sim->ne[1] * sim->ne[2] + CA_WARPS - 1) / CA_WARPS <= INT32_MAX;
    }
    const ggml_tensor * x = op->src[0], * assign = op->src[1], * prev = op->src[2];
    return x->type == GGML_TYPE_F32 && assign->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32 &&
           (!prev || prev->type == GGML_TYPE_F32) && x->nb[0] == sizeof(float) && assign->nb[0] == sizeof(int32_t) &&
           (!prev || prev->nb[0] == sizeof(float)) && op->nb[0] == sizeof(float) && x->ne[0] <= CU_MAX_DIM &&
           x->ne[2] <= 65535;
}

template <bool VAR>
static void launch_update(const cluster_args & a, const ggml_cuda_kernel_launch_params & lp) {
    if (a.d <= 4*WARP_SIZE) {
        ggml_cuda_kernel_launch(cluster_update_kernel<4, VAR>, lp, a);
    } else if (a.d <= 8*WARP_SIZE) {
        ggml_cuda_kernel_launch(cluster_update_kernel<8, VAR>, lp, a);
    } else {
        ggml_cuda_kernel_launch(cluster_update_kernel<CU_MAX_DIM/WARP_SIZE, VAR>, lp, a);
    }
}

void ggml_cuda_cluster_update(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_cluster_update_supported(ctx.device, dst));
    if (ggml_get_op_params_i32(dst, 0) == GGML_CLUSTER_ASSIGN) {
        cluster_assign(ctx, dst);
        return;
    }
    const ggml_tensor * x = dst->src[0], * assign = dst->src[1], * prev = dst->src[2];
    cluster_args a = {};
    a.x = (const char *) x->data; a.assign = (const char *) assign->data;
    a.prev = prev ? (const char *) prev->data : nullptr;
    a.dst = (char *) dst->data;
    a.d = x->ne[0]; a.P = x->ne[1]; a.H = x->ne[2]; a.n = dst->ne[1];
    a.x_nb1 = x->nb[1]; a.x_nb2 = x->nb[2]; a.a_nb1 = assign->nb[1];
    if (prev) {
        a.p_nb1 = prev->nb[1]; a.p_nb2 = prev->nb[2];
    }
    a.o_nb1 = dst->nb[1]; a.o_nb2 = dst->nb[2];
    const int32_t mode = ggml_get_op_params_i32(dst, 0);
    a.table = mode == GGML_CLUSTER_TABLE || mode == GGML_CLUSTER_TABLE_VAR;
    a.var = mode == GGML_CLUSTER_TABLE_VAR;
    GGML_ASSERT(a.table || prev);
    const dim3 grid((unsigned) ((a.n + CU_WARPS - 1) / CU_WARPS), (unsigned) a.H);
    const ggml_cuda_kernel_launch_params lp(grid, CU_WARPS*WARP_SIZE, 0, ctx.stream());
    if (a.var) {
        launch_update<true>(a, lp);
    } else {
        launch_update<false>(a, lp);
    }
}
