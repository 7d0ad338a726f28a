// CPU kernel of ggml_sparq_index_write. Semantics: ggml_ops/include/ggml-sparq.h. Tasks take one index block's
// (block b of stream j) components in segments of SEG, so no two write one element and a decode step's one block a
// layer still spreads over the threads. K is dequantized with its type's to_float (what get_rows runs)
// and K^T written with the index type's from_float (what set_rows runs), so the index equals what those ops gave.
#include "sparq-index-cpu.h"

#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t SEG = 32;    // key components dequantized at a time: one block of any quantized KV type
constexpr int64_t MAX_B = 32;  // the largest index block (q8_0)

// ggml's f32 has no to_float (get_rows copies f32 rows): the same here
void copy_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    std::copy_n((const float *) x, n, y);
}

}  // namespace

void ggml_compute_forward_sparq_index_write(const ggml_compute_params * params, ggml_tensor * dst) {
    GGML_ASSERT(dst->data == dst->src[0]->data);  // the result is kt, written in place
    sparq_index_write_tasks(params, dst->src[0], dst->src[1], dst->src[2], dst->src[3], dst->src[4],
                            ggml_get_op_params_i32(dst, 0));
}

void sparq_index_write_tasks(const ggml_compute_params * params, const ggml_tensor * kt, const ggml_tensor * k,
                             const ggml_tensor * cells, const ggml_tensor * blk, const ggml_tensor * mask, int32_t s0) {
    const int64_t B = ggml_blck_size(kt->type), n_embd = kt->ne[1], row_len = kt->ne[0], n_stream = kt->ne[2];
    const int64_t kv_size = k->ne[1], n_blk = blk->ne[0], ns = blk->ne[2];
    GGML_ASSERT(B <= MAX_B && k->ne[0] == n_embd && s0 >= 0 && s0 + ns <= n_stream);
    GGML_ASSERT(n_embd % ggml_blck_size(k->type) == 0 && SEG % ggml_blck_size(k->type) == 0);
    ggml_to_float_t const to_float = k->type == GGML_TYPE_F32 ? copy_f32 : ggml_get_type_traits(k->type)->to_float;
    ggml_from_float_t const from_float = ggml_get_type_traits_cpu(kt->type)->from_float;
    GGML_ASSERT(to_float && from_float);
    const int32_t * cell = (const int32_t *) cells->data;
    const int64_t * blks = (const int64_t *) blk->data;
    const float   * mk   = mask ? (const float *) mask->data : nullptr;

    float vals[MAX_B][SEG];  // the block's cells' components [e0, e0 + SEG)
    float x[MAX_B];
    const int64_t n_seg = (n_embd + SEG - 1) / SEG;
    for (int64_t task = params->ith; task < n_blk*ns*n_seg; task += params->nth) {
        const int64_t t = task / n_seg, e0 = (task % n_seg)*SEG;
        const int64_t j = t / n_blk, first = t*B;
        const int64_t bn = blks[t];
        GGML_ASSERT(bn >= 0 && (bn + 1)*B <= row_len);  // as ggml_set_rows: a block outside the row is a caller's bug
        char * kt_s = (char *) kt->data + (s0 + j)*kt->nb[2];
        const int64_t n = std::min(SEG, n_embd - e0);
        for (int64_t u = 0; u < B; ++u) {
            const int64_t c = cell[first + u];
            GGML_ASSERT(c >= 0 && c < kv_size*n_stream);
            const char * row = (const char *) k->data + (c / kv_size)*k->nb[2] + (c % kv_size)*k->nb[1];
            to_float(row + ggml_row_size(k->type, e0), vals[u], n);
        }
        for (int64_t e = 0; e < n; ++e) {
            for (int64_t u = 0; u < B; ++u) {
                x[u] = mk ? vals[u][e] * mk[first + u] : vals[u][e];
            }
            char * row = kt_s + (e0 + e)*kt->nb[1];
            from_float(x, row + ggml_row_size(kt->type, bn*B), B);
        }
    }
}
