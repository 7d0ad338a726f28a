// CUDA kernel of ggml_sparq_vsum_rows and ggml_sparq_kstat_rows (op parameter 1: the squares too). Semantics: ggml_ops/include/ggml-sparq.h; the CPU kernel
// (ggml_ops/src/cpu/sparq-vsum-cpu.cpp) is the reference.
//
// One block per (token, KV head): thread i adds component i of the token's rounded value to its sequence's
// table row (and its square where SQUARES), and one thread adds the count. It replaces the six small kernels a decode step's V-sum upkeep took
// (two casts, a concat, get_rows, add and the copy) with one; the rounding is CUDA's round-to-nearest-even
// conversion, as ggml-cuda's own cast to the cache type.
#include "sparq-vsum.cuh"
#include "attn-cuda-common.cuh"

#include "ggml-sparq.h"

#include <cstdint>

namespace {

using namespace attn_cuda;  // pdl_wait

constexpr int VS_THREADS = 128;

struct vsum_args {
    const char * table; const char * v; const char * idx;
    char * dst;
    int64_t d_v, n_seq;
    size_t t_nb1, v_nb1, v_nb2, i_nb0, o_nb1;
};

template <ggml_type V_TYPE>
__device__ __forceinline__ float round_to_cache(float x) {
    if constexpr (V_TYPE == GGML_TYPE_F16) {
        return __half2float(__float2half_rn(x));
    } else if constexpr (V_TYPE == GGML_TYPE_BF16) {
        return __bfloat162float(__float2bfloat16_rn(x));
    } else {
        return x;
    }
}

template <ggml_type V_TYPE, bool SQUARES>
__global__ void __launch_bounds__(VS_THREADS) vsum_rows_kernel(const vsum_args a) {
    constexpr int W = SQUARES ? 2 : 1;  // per head: W*d_v sums and the count
    pdl_wait();
    const int64_t t = blockIdx.x, h = blockIdx.y;
    const int32_t row = *(const int32_t *) (a.idx + t*a.i_nb0);
    if (row < 0 || row >= a.n_seq) {  // a caller's bug (the CPU asserts); leave the column unwritten
        return;
    }
    const float * tab = (const float *) (a.table + row*a.t_nb1) + h*(W*a.d_v + 1);
    const float * vh  = (const float *) (a.v + h*a.v_nb1 + t*a.v_nb2);
    float * out = (float *) (a.dst + t*a.o_nb1) + h*(W*a.d_v + 1);
    for (int64_t i = threadIdx.x; i < a.d_v; i += VS_THREADS) {
        const float r = round_to_cache<V_TYPE>(vh[i]);
        out[i] = tab[i] + r;
        if constexpr (SQUARES) {
            out[a.d_v + i] = __fadd_rn(tab[a.d_v + i], __fmul_rn(r, r));  // no contraction: the CPU's two roundings
        }
    }
    if (threadIdx.x == 0) {
        out[W*a.d_v] = tab[W*a.d_v] + 1.0f;
    }
}

template <ggml_type V_TYPE>
void launch_of(bool squares, const ggml_cuda_kernel_launch_params & lp, const vsum_args & a) {
    if (squares) {
        ggml_cuda_kernel_launch(vsum_rows_kernel<V_TYPE, true>, lp, a);
    } else {
        ggml_cuda_kernel_launch(vsum_rows_kernel<V_TYPE, false>, lp, a);
    }
}

}  // namespace

bool ggml_cuda_sparq_vsum_rows_supported(int device, const ggml_tensor * op) {
    GGML_UNUSED(device);
    const ggml_tensor * table = op->src[0], * v = op->src[1], * idx = op->src[2];
    const auto v_type = (ggml_type) ggml_get_op_params_i32(op, 0);
    return table->type == GGML_TYPE_F32 && v->type == GGML_TYPE_F32 && idx->type == GGML_TYPE_I32 &&
           op->type == GGML_TYPE_F32 && table->nb[0] == sizeof(float) && v->nb[0] == sizeof(float) &&
           op->nb[0] == sizeof(float) && v->ne[1] <= 65535 && v->ne[2] <= INT32_MAX &&
           (v_type == GGML_TYPE_F32 || v_type == GGML_TYPE_F16 || v_type == GGML_TYPE_BF16);
}

void ggml_cuda_sparq_vsum_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * table = dst->src[0], * v = dst->src[1], * idx = dst->src[2];
    GGML_ASSERT(ggml_cuda_sparq_vsum_rows_supported(ctx.device, dst));
    const bool squares = ggml_get_op_params_i32(dst, 1) != 0;
    GGML_ASSERT(table->ne[0] == ((squares ? 2 : 1)*v->ne[0] + 1)*v->ne[1] && dst->ne[0] == table->ne[0] &&
                dst->ne[1] == v->ne[2]);
    vsum_args a = {};
    a.table = (const char *) table->data; a.v = (const char *) v->data; a.idx = (const char *) idx->data;
    a.dst = (char *) dst->data;
    a.d_v = v->ne[0]; a.n_seq = table->ne[1];
    a.t_nb1 = table->nb[1]; a.v_nb1 = v->nb[1]; a.v_nb2 = v->nb[2]; a.i_nb0 = idx->nb[0]; a.o_nb1 = dst->nb[1];
    if (v->ne[2] == 0) {
        return;
    }
    const dim3 grid((unsigned) v->ne[2], (unsigned) v->ne[1]);
    const ggml_cuda_kernel_launch_params lp(grid, VS_THREADS, 0, ctx.stream());
    switch ((ggml_type) ggml_get_op_params_i32(dst, 0)) {
        case GGML_TYPE_F16:  launch_of<GGML_TYPE_F16>(squares, lp, a);  break;
        case GGML_TYPE_BF16: launch_of<GGML_TYPE_BF16>(squares, lp, a); break;
        default:             launch_of<GGML_TYPE_F32>(squares, lp, a);  break;
    }
}
