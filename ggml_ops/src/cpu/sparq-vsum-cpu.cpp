// CPU kernel of ggml_sparq_decode_upkeep (and so of ggml_sparq_vsum_rows and ggml_sparq_kstat_rows, its one-table
// forms). Semantics: ggml_ops/include/ggml-sparq.h; float64 reference: sparq_llama.ops.vsum_rows_reference.
// Tasks take whole tokens (result columns and, the rows being distinct, their table rows), so no two write one
// element; the index part is ggml_sparq_index_write's tasks. The rounding uses ggml's own conversions (round to
// nearest even), the ones ggml_cast to the cache type runs.
#include "sparq-vsum-cpu.h"
#include "sparq-index-cpu.h"

#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"

#include <algorithm>
#include <cstdint>

namespace {

// ggml's f32 has no to_float (get_rows copies f32 rows): the same here
void copy_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    std::copy_n((const float *) x, n, y);
}

float round_to(float x, ggml_type t) {
    switch (t) {
        case GGML_TYPE_F16:  return ggml_fp16_to_fp32(ggml_fp32_to_fp16(x));
        case GGML_TYPE_BF16: return ggml_bf16_to_fp32(ggml_fp32_to_bf16(x));
        default:             return x;
    }
}

// One token's V sums: out = row + per head [round(v), 1], written to both.
void add_values(float * tab, float * out, const ggml_tensor * v, int64_t t, ggml_type type) {
    const int64_t d = v->ne[0], n_head_kv = v->ne[1], width = d + 1;  // per head
    for (int64_t h = 0; h < n_head_kv; ++h) {
        const float * vh = (const float *) ((const char *) v->data + h*v->nb[1] + t*v->nb[2]);
        float * o = out + h*width, * r = tab + h*width;
        for (int64_t i = 0; i < d; ++i) {
            o[i] = r[i] + round_to(vh[i], type);
        }
        o[d] = r[d] + 1.0f;
        std::copy_n(o, width, r);
    }
}

// One token's key statistics from the cache's row `row` of k: out = tab + per head [r, r*r, 1], written to both. The
// keys are dequantized SEG components at a time (k's type's to_float, what get_rows runs).
void add_keys(float * tab, float * out, const ggml_tensor * k, int64_t row, int64_t n_head_kv) {
    constexpr int64_t SEG = 32;  // one block of any quantized KV type
    const int64_t d = k->ne[0] / n_head_kv, width = 2*d + 1;
    ggml_to_float_t const to_float = k->type == GGML_TYPE_F32 ? copy_f32 : ggml_get_type_traits(k->type)->to_float;
    GGML_ASSERT(to_float && d % ggml_blck_size(k->type) == 0 && SEG % ggml_blck_size(k->type) == 0);
    const char * kr = (const char *) k->data + (row / k->ne[1])*k->nb[2] + (row % k->ne[1])*k->nb[1];
    float r[SEG];
    for (int64_t h = 0; h < n_head_kv; ++h) {
        float * o = out + h*width, * s = tab + h*width;
        for (int64_t e0 = 0; e0 < d; e0 += SEG) {
            const int64_t n = std::min(SEG, d - e0);
            to_float(kr + ggml_row_size(k->type, h*d + e0), r, n);
            for (int64_t i = 0; i < n; ++i) {
                o[e0 + i]     = s[e0 + i] + r[i];
                o[d + e0 + i] = s[d + e0 + i] + r[i]*r[i];
            }
        }
        o[2*d] = s[2*d] + 1.0f;
        std::copy_n(o, width, s);
    }
}

}  // namespace

void ggml_compute_forward_sparq_vsum_rows(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * idx = dst->src[0], * vsum = dst->src[1], * v = dst->src[2], * kstat = dst->src[3];
    const ggml_tensor * k_cells = dst->src[4], * kt = dst->src[5], * k = dst->src[6];
    const auto v_type = (ggml_type) ggml_get_op_params_i32(dst, 0);
    const int64_t n_tokens = idx->ne[0], n_v = vsum ? vsum->ne[0] : 0, n_k = kstat ? kstat->ne[0] : 0;
    GGML_ASSERT(idx->type == GGML_TYPE_I32 && dst->type == GGML_TYPE_F32 && dst->nb[0] == sizeof(float));
    GGML_ASSERT(dst->ne[0] == n_v + n_k && dst->ne[1] == n_tokens && (vsum || kstat));
    for (const ggml_tensor * tab : { vsum, kstat }) {
        GGML_ASSERT(!tab || (tab->type == GGML_TYPE_F32 && tab->nb[0] == sizeof(float)));
    }
    GGML_ASSERT(!kstat || (k && k_cells && k_cells->type == GGML_TYPE_I32 && k_cells->ne[0] == n_tokens));
    if (kt) {
        sparq_index_write_tasks(params, kt, k, dst->src[7], dst->src[8], dst->src[9], ggml_get_op_params_i32(dst, 1));
    }
    const auto i32_at = [](const ggml_tensor * x, int64_t t) {
        return *(const int32_t *) ((const char *) x->data + t*x->nb[0]);
    };
    for (int64_t t = params->ith; t < n_tokens; t += params->nth) {
        const int32_t row = i32_at(idx, t);
        for (int64_t u = 0; u < t; ++u) {
            GGML_ASSERT(i32_at(idx, u) != row);  // two tokens of one sequence would both write its row
        }
        float * out = (float *) ((char *) dst->data + t*dst->nb[1]);
        if (vsum) {
            GGML_ASSERT(row >= 0 && row < vsum->ne[1]);  // as ggml_get_rows: an index outside the table is a caller's bug
            add_values((float *) ((char *) vsum->data + row*vsum->nb[1]), out, v, t, v_type);
        }
        if (kstat) {
            const int32_t cell = i32_at(k_cells, t);
            GGML_ASSERT(row >= 0 && row < kstat->ne[1]);
            GGML_ASSERT(cell >= 0 && cell < k->ne[1]*k->ne[2]);
            add_keys((float *) ((char *) kstat->data + row*kstat->nb[1]), out + n_v, k, cell, n_k - 2*k->ne[0]);
        }
    }
}
