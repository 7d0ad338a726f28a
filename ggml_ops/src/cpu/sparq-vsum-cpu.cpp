// CPU kernel of ggml_sparq_decode_upkeep (and so of ggml_sparq_vsum_rows and ggml_sparq_kstat_rows, its one-table
// forms). Semantics: ggml_ops/include/ggml-sparq.h; float64 reference: sparq_llama.ops.vsum_rows_reference.
// Tasks take whole tokens (result columns and, the rows being distinct, their table rows), so no two write one
// element; the index part is ggml_sparq_index_write's tasks. The rounding uses ggml's own conversions (round to
// nearest even), the ones ggml_cast to the cache type runs.
#include "sparq-vsum-cpu.h"
#include "sparq-index-cpu.h"

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

// One token's part of one table (squares: the key statistics' [r, r*r, 1] per head, else [r, 1]): out = row + the
// token's values, written to both.
void add_token(float * tab, float * out, const ggml_tensor * x, int64_t t, ggml_type type, bool squares) {
    const int64_t d = x->ne[0], n_head_kv = x->ne[1], width = (squares ? 2 : 1)*d + 1;  // per head
    for (int64_t h = 0; h < n_head_kv; ++h) {
        const float * xh = (const float *) ((const char *) x->data + h*x->nb[1] + t*x->nb[2]);
        const int64_t o = h*width;
        for (int64_t i = 0; i < d; ++i) {
            out[o + i] = tab[o + i] + round_to(xh[i], type);
        }
        if (squares) {
            for (int64_t i = 0; i < d; ++i) {
                const float r = round_to(xh[i], type);
                out[o + d + i] = tab[o + d + i] + r*r;
            }
        }
        out[o + width - 1] = tab[o + width - 1] + 1.0f;
        for (int64_t i = 0; i < width; ++i) {
            tab[o + i] = out[o + i];
        }
    }
}

}  // namespace

void ggml_compute_forward_sparq_vsum_rows(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * idx = dst->src[0], * vsum = dst->src[1], * v = dst->src[2], * kstat = dst->src[3];
    const ggml_tensor * k_new = dst->src[4], * kt = dst->src[5];
    const auto v_type = (ggml_type) ggml_get_op_params_i32(dst, 0), k_type = (ggml_type) ggml_get_op_params_i32(dst, 1);
    const int64_t n_tokens = idx->ne[0], n_v = vsum ? vsum->ne[0] : 0, n_k = kstat ? kstat->ne[0] : 0;
    GGML_ASSERT(idx->type == GGML_TYPE_I32 && dst->type == GGML_TYPE_F32 && dst->nb[0] == sizeof(float));
    GGML_ASSERT(dst->ne[0] == n_v + n_k && dst->ne[1] == n_tokens && (vsum || kstat));
    for (const ggml_tensor * tab : { vsum, kstat }) {
        GGML_ASSERT(!tab || (tab->type == GGML_TYPE_F32 && tab->nb[0] == sizeof(float)));
    }
    if (kt) {
        sparq_index_write_tasks(params, kt, dst->src[6], dst->src[7], dst->src[8], dst->src[9],
                                ggml_get_op_params_i32(dst, 2));
    }
    const auto row_of = [&](int64_t t) { return *(const int32_t *) ((const char *) idx->data + t*idx->nb[0]); };
    for (int64_t t = params->ith; t < n_tokens; t += params->nth) {
        const int32_t row = row_of(t);
        for (int64_t u = 0; u < t; ++u) {
            GGML_ASSERT(row_of(u) != row);  // two tokens of one sequence would both write its row
        }
        float * out = (float *) ((char *) dst->data + t*dst->nb[1]);
        if (vsum) {
            GGML_ASSERT(row >= 0 && row < vsum->ne[1]);  // as ggml_get_rows: an index outside the table is a caller's bug
            add_token((float *) ((char *) vsum->data + row*vsum->nb[1]), out, v, t, v_type, false);
        }
        if (kstat) {
            GGML_ASSERT(row >= 0 && row < kstat->ne[1]);
            add_token((float *) ((char *) kstat->data + row*kstat->nb[1]), out + n_v, k_new, t, k_type, true);
        }
    }
}
