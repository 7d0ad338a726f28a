// CPU kernel of ggml_sparq_vsum_rows and ggml_sparq_kstat_rows (op parameter 1: the squares too). Semantics: ggml_ops/include/ggml-sparq.h; float64 reference:
// sparq_llama.ops.vsum_rows_reference. Tasks take whole tokens (result columns), so no two write one element.
// The rounding uses ggml's own conversions (round to nearest even), the ones ggml_cast to the cache type runs.
#include "sparq-vsum-cpu.h"

#include "ggml-cpu-impl.h"

#include <cstdint>

namespace {

float round_to(float x, ggml_type t) {
    switch (t) {
        case GGML_TYPE_F16:  return ggml_fp16_to_fp32(ggml_fp32_to_fp16(x));
        case GGML_TYPE_BF16: return ggml_bf16_to_fp32(ggml_fp32_to_bf16(x));
        default:             return x;
    }
}

}  // namespace

void ggml_compute_forward_sparq_vsum_rows(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * table = dst->src[0], * v = dst->src[1], * idx = dst->src[2];
    GGML_ASSERT(table->type == GGML_TYPE_F32 && v->type == GGML_TYPE_F32 && idx->type == GGML_TYPE_I32);
    GGML_ASSERT(table->nb[0] == sizeof(float) && v->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float));
    const int64_t d_v = v->ne[0], n_head_kv = v->ne[1], n_tokens = v->ne[2], n_seq = table->ne[1];
    const auto v_type = (ggml_type) ggml_get_op_params_i32(dst, 0);
    const bool squares = ggml_get_op_params_i32(dst, 1) != 0;
    const int64_t width = (squares ? 2 : 1)*d_v + 1;  // per head
    GGML_ASSERT(table->ne[0] == width*n_head_kv && dst->ne[0] == table->ne[0] && dst->ne[1] == n_tokens);

    for (int64_t t = params->ith; t < n_tokens; t += params->nth) {
        const int32_t row = *(const int32_t *) ((const char *) idx->data + t*idx->nb[0]);
        GGML_ASSERT(row >= 0 && row < n_seq);  // as ggml_get_rows: an index outside the table is a caller's bug
        const float * tab = (const float *) ((const char *) table->data + row*table->nb[1]);
        float * out = (float *) ((char *) dst->data + t*dst->nb[1]);
        for (int64_t h = 0; h < n_head_kv; ++h) {
            const float * vh = (const float *) ((const char *) v->data + h*v->nb[1] + t*v->nb[2]);
            const int64_t o = h*width;
            for (int64_t i = 0; i < d_v; ++i) {
                out[o + i] = tab[o + i] + round_to(vh[i], v_type);
            }
            if (squares) {
                for (int64_t i = 0; i < d_v; ++i) {
                    const float r = round_to(vh[i], v_type);
                    out[o + d_v + i] = tab[o + d_v + i] + r*r;
                }
            }
            out[o + width - 1] = tab[o + width - 1] + 1.0f;
        }
    }
}
