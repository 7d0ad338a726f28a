// CUDA kernel of ggml_sparq_index_write. Semantics: ggml_ops/include/ggml-sparq.h; the CPU kernel
// (ggml_ops/src/cpu/sparq-index-cpu.cpp) is the reference.
//
// Grid: written index blocks (block b of stream j) x chunks of IW_THREADS key components; thread e takes component e:
// it gathers the B cells' values of component e from K, dequantized as ggml-cuda's get_rows dequantizes them (the
// same device functions), times the mask, and writes them to row e of K^T converted as ggml-cuda's set_rows converts
// (q8_0: its block quantizer). K rows are read by consecutive threads (coalesced along the components); the writes of
// one thread are one index block. A decode step writes one index block a layer, so the components are what spreads
// it over the GPU (one thread block per index block would leave one SM looping over every component). It replaces
// four kernels: get_rows, the mask product, the permuted copy and set_rows.
#include "sparq-index.cuh"
#include "attn-cuda-common.cuh"
#include "convert.cuh"
#include "cpy-utils.cuh"
#include "dequantize.cuh"

#include "ggml-sparq.h"

#include <cstdint>

namespace {

using namespace attn_cuda;  // pdl_wait

constexpr int IW_THREADS = 128;
constexpr int IW_MAX_B   = QK8_0;  // the largest index block

struct index_args {
    char * kt; const char * k; const int32_t * cells; const int64_t * blk; const float * mask;
    int64_t n_embd, n_blk, row_len;
    size_t kt_nb1, kt_nb2, k_nb1;
    int32_t s0;
};

// Component e of a K row of type K_TYPE, as ggml-cuda's get_rows gives it (its dequantize functions: pairs of values,
// qr = 1 at adjacent positions, qr = 2 at j and j + qk/2).
template <ggml_type K_TYPE>
__device__ __forceinline__ float key_value(const char * row, int64_t e) {
    if constexpr (K_TYPE == GGML_TYPE_F32) {
        return ((const float *) row)[e];
    } else if constexpr (K_TYPE == GGML_TYPE_F16) {
        return ggml_cuda_cast<float>(((const half *) row)[e]);
    } else if constexpr (K_TYPE == GGML_TYPE_BF16) {
        return ggml_cuda_cast<float>(((const nv_bfloat16 *) row)[e]);
    } else {
        constexpr int qk = ggml_cuda_type_traits<K_TYPE>::qk, qr = ggml_cuda_type_traits<K_TYPE>::qr;
        const int64_t ib = e / qk;
        const int j = (int) (e % qk);
        const int iqs = qr == 1 ? (j & ~1) : (j < qk/2 ? j : j - qk/2);
        const bool second = qr == 1 ? (j & 1) : j >= qk/2;
        float2 v;
        if constexpr (K_TYPE == GGML_TYPE_Q8_0) {
            dequantize_q8_0(row, ib, iqs, v);
        } else if constexpr (K_TYPE == GGML_TYPE_Q4_0) {
            dequantize_q4_0(row, ib, iqs, v);
        } else if constexpr (K_TYPE == GGML_TYPE_Q4_1) {
            dequantize_q4_1(row, ib, iqs, v);
        } else if constexpr (K_TYPE == GGML_TYPE_Q5_0) {
            dequantize_q5_0(row, ib, iqs, v);
        } else {
            static_assert(K_TYPE == GGML_TYPE_Q5_1, "a KV cache type");
            dequantize_q5_1(row, ib, iqs, v);
        }
        return second ? v.y : v.x;
    }
}

template <ggml_type K_TYPE, ggml_type KT_TYPE>
__global__ void __launch_bounds__(IW_THREADS) index_write_kernel(const index_args a) {
    constexpr int B = KT_TYPE == GGML_TYPE_Q8_0 ? QK8_0 : 1;
    static_assert(B <= IW_MAX_B, "an index block fits the thread's values");
    pdl_wait();
    const int64_t t = blockIdx.x;  // block b of stream j: t = j*n_blk + b
    const int64_t j = t / a.n_blk;
    const int64_t first = t*B;     // this index block's cells in cells and mask
    const int64_t blk = a.blk[t];
    char * kt_s = a.kt + (a.s0 + j)*a.kt_nb2;
    const int64_t e = (int64_t) blockIdx.y*IW_THREADS + threadIdx.x;
    if (e < a.n_embd) {
        float x[B];
#pragma unroll
        for (int u = 0; u < B; ++u) {
            const float val = key_value<K_TYPE>(a.k + (int64_t) a.cells[first + u]*a.k_nb1, e);
            x[u] = a.mask ? val * a.mask[first + u] : val;
        }
        char * row = kt_s + e*a.kt_nb1;
        if constexpr (KT_TYPE == GGML_TYPE_Q8_0) {
            quantize_f32_q8_0_block(x, (block_q8_0 *) row + blk);
        } else if constexpr (KT_TYPE == GGML_TYPE_F16) {
            ((half *) row)[blk] = ggml_cuda_cast<half>(x[0]);
        } else if constexpr (KT_TYPE == GGML_TYPE_BF16) {
            ((nv_bfloat16 *) row)[blk] = ggml_cuda_cast<nv_bfloat16>(x[0]);
        } else {
            ((float *) row)[blk] = x[0];
        }
    }
}

template <ggml_type K_TYPE>
void launch_for_index(ggml_type kt_type, const dim3 & grid, cudaStream_t stream, const index_args & a) {
    const ggml_cuda_kernel_launch_params lp(grid, IW_THREADS, 0, stream);
    switch (kt_type) {
        case GGML_TYPE_Q8_0: ggml_cuda_kernel_launch(index_write_kernel<K_TYPE, GGML_TYPE_Q8_0>, lp, a); break;
        case GGML_TYPE_F16:  ggml_cuda_kernel_launch(index_write_kernel<K_TYPE, GGML_TYPE_F16>,  lp, a); break;
        case GGML_TYPE_BF16: ggml_cuda_kernel_launch(index_write_kernel<K_TYPE, GGML_TYPE_BF16>, lp, a); break;
        default:             ggml_cuda_kernel_launch(index_write_kernel<K_TYPE, GGML_TYPE_F32>,  lp, a); break;
    }
}

bool kt_type_ok(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || t == GGML_TYPE_Q8_0;
}
bool k_type_ok(ggml_type t) {
    return kt_type_ok(t) || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
}

}  // namespace

bool ggml_cuda_sparq_index_write_supported(int device, const ggml_tensor * op) {
    GGML_UNUSED(device);
    const ggml_tensor * kt = op->src[0], * k = op->src[1], * blk = op->src[3];
    return kt_type_ok(kt->type) && k_type_ok(k->type) && blk->ne[0]*blk->ne[2] <= INT32_MAX &&
           (kt->ne[1] + IW_THREADS - 1) / IW_THREADS <= 65535;
}

void ggml_cuda_sparq_index_write(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * kt = dst->src[0], * k = dst->src[1], * cells = dst->src[2], * blk = dst->src[3];
    const ggml_tensor * mask = dst->src[4];
    GGML_ASSERT(ggml_cuda_sparq_index_write_supported(ctx.device, dst));
    GGML_ASSERT(dst->data == kt->data);  // the result is kt, written in place
    index_args a = {};
    a.kt = (char *) kt->data; a.k = (const char *) k->data; a.cells = (const int32_t *) cells->data;
    a.blk = (const int64_t *) blk->data; a.mask = mask ? (const float *) mask->data : nullptr;
    a.n_embd = kt->ne[1]; a.n_blk = blk->ne[0]; a.row_len = kt->ne[0];
    a.kt_nb1 = kt->nb[1]; a.kt_nb2 = kt->nb[2]; a.k_nb1 = k->nb[1];
    a.s0 = ggml_get_op_params_i32(dst, 0);
    if (a.n_blk == 0 || blk->ne[2] == 0) {
        return;
    }
    const dim3 grid((unsigned) (a.n_blk*blk->ne[2]), (unsigned) ((a.n_embd + IW_THREADS - 1) / IW_THREADS));
    cudaStream_t stream = ctx.stream();
    switch (k->type) {
        case GGML_TYPE_F32:  launch_for_index<GGML_TYPE_F32> (kt->type, grid, stream, a); break;
        case GGML_TYPE_F16:  launch_for_index<GGML_TYPE_F16> (kt->type, grid, stream, a); break;
        case GGML_TYPE_BF16: launch_for_index<GGML_TYPE_BF16>(kt->type, grid, stream, a); break;
        case GGML_TYPE_Q8_0: launch_for_index<GGML_TYPE_Q8_0>(kt->type, grid, stream, a); break;
        case GGML_TYPE_Q4_0: launch_for_index<GGML_TYPE_Q4_0>(kt->type, grid, stream, a); break;
        case GGML_TYPE_Q4_1: launch_for_index<GGML_TYPE_Q4_1>(kt->type, grid, stream, a); break;
        case GGML_TYPE_Q5_0: launch_for_index<GGML_TYPE_Q5_0>(kt->type, grid, stream, a); break;
        default:             launch_for_index<GGML_TYPE_Q5_1>(kt->type, grid, stream, a); break;
    }
}
