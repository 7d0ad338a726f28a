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
#include "centroid-attn-common.cuh"
#include "centroid-attn-select.cuh"
#include "centroid-attn-attend.cuh"

#include <algorithm>
#include <cstdint>

namespace {

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
