// SparQ in llama.cpp's attention graph: llm_graph_context::build_attn_sparq, called by both build_attn
// variants (plain and sliding-window caches) after the new K and V rows are stored.
//   - every ubatch: write the new keys into K^T and add the new values into the per-sequence V sums;
//   - decode ubatches (one token per sequence), or every ubatch with --sparq-prefill, once the cache view
//     holds at least min_n_kv cells: ggml_sparq_attn instead of flash attention.
//   - a prepared prefix (sparq-squeeze-state.cpp): ggml_centroid_attn for every ubatch, before SparQ.
// Anything the op cannot honour for a layer falls back to dense with one log line.
#include "sparq-llama-internal.h"

#include "ggml-sparq.h"

#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"

#include <algorithm>
#include <map>

namespace {

// Per-graph inputs shared by all layers, created on first use and filled from the ubatch.
class sparq_graph_input : public llm_graph_input_i {
public:
    sparq_graph_input(int64_t n_tokens, uint32_t n_seq_max, bool one_seq_each) :
        n_tokens(n_tokens), n_seq_max(n_seq_max), one_seq_each(one_seq_each) {}

    const int64_t  n_tokens;
    const uint32_t n_seq_max;
    const bool     one_seq_each; // every token belongs to one sequence, no two to the same (a decode step)

    // whether a ubatch is a decode step in the sense of one_seq_each
    static bool one_seq_per_token(const llama_ubatch & ub) {
        if (ub.n_tokens != ub.n_seqs_unq) {
            return false;
        }
        for (uint32_t t = 0; t < ub.n_tokens; ++t) {
            if (ub.n_seq_id[t] != 1) {
                return false;
            }
        }
        return true;
    }

    // K^T scatter indices, one set per (cache, key width): derived from the cache's own k_idxs input, which
    // is set before this input (inputs are set in the order they were added)
    struct kt_entry {
        ggml_tensor * k_idxs;   // [n_tokens] I64: stream*kv_size + cell
        int64_t       n_embd;   // n_embd_k_gqa
        int64_t       kv_size;
        ggml_tensor * kt_idxs;  // [n_tokens*n_embd] I64
    };
    std::vector<kt_entry> kt;

    // cell positions for the op's window and sinks, one per cache: [n_kv, 1, 1, ns] I32
    struct pos_entry {
        const llama_kv_cache * kv;
        uint32_t      s0;
        ggml_tensor * pos;
    };
    std::vector<pos_entry> pos;

    ggml_tensor * seq_idx = nullptr;            // [n_tokens] I32: the token's (first) sequence
    ggml_tensor * onehot  = nullptr;            // [n_tokens, n_seq_max] f32: token t belongs to sequence s
    ggml_tensor * future  = nullptr;            // [n_tokens, n_tokens] f32: t2 is a later token of t's sequence
    std::map<int64_t, ggml_tensor *> ones;      // n_head_kv -> [1, n_head_kv, n_tokens] f32 of 1

    ggml_tensor * get_kt_idxs(ggml_context * ctx, ggml_tensor * k_idxs, int64_t n_embd, int64_t kv_size) {
        for (const auto & e : kt) {
            if (e.k_idxs == k_idxs && e.n_embd == n_embd) {
                return e.kt_idxs;
            }
        }
        ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens*n_embd);
        ggml_set_input(t);
        ggml_set_name(t, "sparq_inp_kt_idxs");
        kt.push_back({ k_idxs, n_embd, kv_size, t });
        return t;
    }

    ggml_tensor * get_pos(ggml_context * ctx, const llama_kv_cache * kv, uint32_t s0, int64_t n_kv, int64_t ns) {
        for (const auto & e : pos) {
            if (e.kv == kv) {
                return e.pos;
            }
        }
        ggml_tensor * t = ggml_new_tensor_4d(ctx, GGML_TYPE_I32, n_kv, 1, 1, ns);
        ggml_set_input(t);
        ggml_set_name(t, "sparq_inp_pos");
        pos.push_back({ kv, s0, t });
        return t;
    }

    void ensure_seq_inputs(ggml_context * ctx, bool with_onehot, bool with_rows, bool with_future) {
        if (with_onehot && onehot == nullptr) {
            onehot = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_tokens, n_seq_max);
            ggml_set_input(onehot);
        }
        if (with_rows && seq_idx == nullptr) {
            seq_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens);
            ggml_set_input(seq_idx);
        }
        if (with_future && future == nullptr) {
            future = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_tokens, n_tokens);
            ggml_set_input(future);
        }
    }

    ggml_tensor * get_ones(ggml_context * ctx, int64_t n_head_kv) {
        auto it = ones.find(n_head_kv);
        if (it != ones.end()) {
            return it->second;
        }
        ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, n_head_kv, n_tokens);
        ggml_set_input(t);
        ones[n_head_kv] = t;
        return t;
    }

    // an input no node uses gets no memory from the scheduler
    static bool allocated(const ggml_tensor * t) {
        if (t == nullptr || t->data == nullptr) {
            return false;
        }
        GGML_ASSERT(t->buffer && ggml_backend_buffer_is_host(t->buffer));
        return true;
    }

    void set_input(const llama_ubatch * ubatch) override {
        GGML_ASSERT(ubatch && (int64_t) ubatch->n_tokens == n_tokens);
        for (const auto & e : kt) {
            if (!allocated(e.kt_idxs)) {
                continue;
            }
            GGML_ASSERT(allocated(e.k_idxs));
            const int64_t * src = (const int64_t *) e.k_idxs->data;
            int64_t * dst = (int64_t *) e.kt_idxs->data;
            for (int64_t t = 0; t < n_tokens; ++t) {
                const int64_t stream = src[t] / e.kv_size;
                const int64_t cell   = src[t] % e.kv_size;
                for (int64_t j = 0; j < e.n_embd; ++j) {
                    dst[t*e.n_embd + j] = (stream*e.n_embd + j)*e.kv_size + cell;
                }
            }
        }
        for (const auto & e : pos) {
            if (!allocated(e.pos)) {
                continue;
            }
            int32_t * p = (int32_t *) e.pos->data;
            const int64_t n_kv = e.pos->ne[0];
            for (int64_t s = 0; s < e.pos->ne[3]; ++s) {
                // a stream's cells: sequence s0+s owns stream s0+s unless the cache is unified (one stream)
                const auto & cells = e.kv->get_cells(e.kv->get_n_stream() == 1 ? 0 : (llama_seq_id) (e.s0 + s));
                for (int64_t j = 0; j < n_kv; ++j) {
                    p[s*n_kv + j] = cells.is_empty(j) ? -1 : cells.pos_get(j);
                }
            }
        }
        if (allocated(seq_idx)) {
            int32_t * sidx = (int32_t *) seq_idx->data;
            for (int64_t t = 0; t < n_tokens; ++t) {
                sidx[t] = ubatch->seq_id[t][0];
            }
        }
        if (allocated(onehot)) {
            float * oh = (float *) onehot->data;
            std::fill(oh, oh + n_tokens*n_seq_max, 0.0f);
            for (int64_t t = 0; t < n_tokens; ++t) {
                for (int32_t i = 0; i < ubatch->n_seq_id[t]; ++i) {
                    oh[(int64_t) ubatch->seq_id[t][i]*n_tokens + t] = 1.0f;
                }
            }
        }
        if (allocated(future)) {
            // future[t, t2] (ne0 = t2): t2 shares t's first sequence and comes later, so it is already in
            // the updated sums but not visible to row t
            float * f = (float *) future->data;
            for (int64_t t = 0; t < n_tokens; ++t) {
                const llama_seq_id s = ubatch->seq_id[t][0];
                for (int64_t t2 = 0; t2 < n_tokens; ++t2) {
                    bool later = false;
                    if (ubatch->pos[t2] > ubatch->pos[t]) {
                        for (int32_t i = 0; i < ubatch->n_seq_id[t2]; ++i) {
                            later = later || ubatch->seq_id[t2][i] == s;
                        }
                    }
                    f[t*n_tokens + t2] = later ? 1.0f : 0.0f;
                }
            }
        }
        for (auto & [h, t] : ones) {
            if (!allocated(t)) {
                continue;
            }
            float * o = (float *) t->data;
            std::fill(o, o + ggml_nelements(t), 1.0f);
        }
    }

    bool can_reuse(const llm_graph_params & params) override {
        return (int64_t) params.ubatch.n_tokens == n_tokens && one_seq_per_token(params.ubatch) == one_seq_each;
    }
};

sparq_graph_input * sparq_input(llm_graph_result * res, const llama_ubatch & ubatch, uint32_t n_seq_max) {
    for (auto & inp : res->inputs) {
        if (auto * s = dynamic_cast<sparq_graph_input *>(inp.get())) {
            return s;
        }
    }
    return static_cast<sparq_graph_input *>(res->add_input(std::make_unique<sparq_graph_input>(
        ubatch.n_tokens, n_seq_max, sparq_graph_input::one_seq_per_token(ubatch))));
}

// Whether a (view of a) cache tensor lives in host memory: the CPU's measured default applies there, the GPU's
// elsewhere (sparq_min_n_kv).
bool sparq_on_host(const ggml_tensor * t) {
    const ggml_tensor * src = t->view_src ? t->view_src : t;
    return src->buffer == nullptr || ggml_backend_buffer_is_host(src->buffer);
}

void sparq_log_fallback(const sparq_kv_layer * L, int il, const char * why) {
    if (!L->logged) {
        L->logged = true;
        LLAMA_LOG_INFO("%s: SparQ: dense attention for layer %d: %s\n", __func__, il, why);
    }
}

// The running V sums (table [(d_v + 1)*n_head_kv, n_seq_max]) take this ubatch's values; returns the sums
// each row sees (NULL unless select), after adding the graph's nodes that write the table back. The sums take V
// as the cache stores it (rounded to its type), so a rebuild from the cache agrees.
ggml_tensor * build_vsum_upkeep(ggml_context * ctx0, ggml_cgraph * gf, sparq_graph_input * inp, ggml_tensor * tab,
                                ggml_tensor * v_cur, ggml_type type_v, int64_t d_v, int64_t h, bool select,
                                bool need_future) {
    const int64_t n_tokens = inp->n_tokens;
    const bool plain_type = v_cur->type == GGML_TYPE_F32 &&
                            (type_v == GGML_TYPE_F32 || type_v == GGML_TYPE_F16 || type_v == GGML_TYPE_BF16);
    if (inp->one_seq_each && plain_type) {
        // a decode step: each row is its sequence's sums plus its own value, and is the sequence's new row of
        // the table (the rows are distinct): one node, then the write back
        ggml_tensor * v3 = v_cur->nb[0] == sizeof(float) && ggml_n_dims(v_cur) == 3 && v_cur->ne[0] == d_v &&
                           v_cur->ne[1] == h ? v_cur : ggml_cont_3d(ctx0, v_cur, d_v, h, n_tokens);
        ggml_tensor * rows = ggml_sparq_vsum_rows(ctx0, tab, v3, inp->seq_idx, type_v);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, tab, rows, inp->seq_idx));
        ggml_build_forward_expand(gf, rows);
        return rows;
    }

    ggml_tensor * v3 = nullptr;
    if (type_v == GGML_TYPE_F32) {
        v3 = ggml_cont_3d(ctx0, v_cur, d_v, h, n_tokens);
    } else {
        ggml_tensor * src = ggml_is_contiguous(v_cur) ? v_cur : ggml_cont(ctx0, v_cur);
        ggml_tensor * rounded = ggml_cast(ctx0, ggml_cast(ctx0, src, type_v), GGML_TYPE_F32);
        v3 = ggml_reshape_3d(ctx0, rounded, d_v, h, n_tokens);
    }
    ggml_tensor * aug = ggml_concat(ctx0, v3, inp->get_ones(ctx0, h), 0);         // [d_v+1, h, n_tokens]
    ggml_tensor * aug_2d = ggml_reshape_2d(ctx0, aug, (d_v + 1)*h, n_tokens);
    ggml_tensor * rows = nullptr;
    if (inp->one_seq_each) {
        // a decode step with a quantized V cache: get_rows + add + set_rows (no one-hot product, no table copy)
        rows = ggml_add(ctx0, ggml_get_rows(ctx0, tab, inp->seq_idx), aug_2d);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, tab, rows, inp->seq_idx));
    } else {
        ggml_tensor * aug_t   = ggml_cont(ctx0, ggml_transpose(ctx0, aug_2d));
        ggml_tensor * tab_new = ggml_add(ctx0, tab, ggml_mul_mat(ctx0, aug_t, inp->onehot));
        if (select) {
            rows = ggml_get_rows(ctx0, tab_new, inp->seq_idx);
            if (need_future) {
                rows = ggml_sub(ctx0, rows, ggml_mul_mat(ctx0, aug_t, inp->future));
            }
        }
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, tab_new, tab));
    }
    if (rows) {
        ggml_build_forward_expand(gf, rows);
    }
    return rows;
}

} // namespace

ggml_tensor * llm_graph_context::build_attn_sparq(
        const llama_kv_cache_context * mctx_cur,
        ggml_tensor * q,
        ggml_tensor * k_cur,
        ggml_tensor * v_cur,
        ggml_tensor * k_idxs,
        ggml_tensor * kq_b,
        ggml_tensor * kq_mask,
        ggml_tensor * sinks,
        ggml_tensor * v_mla,
              float   kq_scale,
                int   il) const {
    const llama_sparq_params & sp = cparams.sparq;
    if (mctx_cur == nullptr) {
        return nullptr;
    }
    const llama_kv_cache * kv = mctx_cur->get_kv();
    const float softcap = hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f;
    const bool decode = ubatch.n_tokens == ubatch.n_seqs_unq;  // one token per sequence
    const sparq_kv_layer * L = sp.enabled ? kv->sparq_layer(il) : nullptr;
    if (L == nullptr || !L->active) {
        // a prepared prefix (centroid-sparse) without SparQ
        return kv->squeeze && cparams.causal_attn ?
            squeeze_build_attn(ctx0, res, mctx_cur, q, kq_mask, kq_scale, softcap, il, kq_b || sinks || v_mla, decode) :
            nullptr;
    }

    const uint32_t n_seq_max = kv->get_n_seq_max();
    sparq_graph_input * inp = sparq_input(res, ubatch, n_seq_max);

    const bool select = decode || sp.prefill;

    // 1. the derived state follows this ubatch's writes
    if (k_cur && L->kt) {
        ggml_tensor * kt_idxs = inp->get_kt_idxs(ctx0, k_idxs, hparams.n_embd_k_gqa(il), kv->get_size());
        ggml_build_forward_expand(gf, kv->sparq_cpy_kt(ctx0, k_cur, kt_idxs, il));
    }

    ggml_tensor * vsum_rows = nullptr; // [(d_v + 1)*n_head_kv, n_tokens]: the sums each row sees
    if (v_cur && L->vsum) {
        const bool need_future = select && !decode;
        inp->ensure_seq_inputs(ctx0, !inp->one_seq_each, select, need_future);  // one_seq_each implies select
        vsum_rows = build_vsum_upkeep(ctx0, gf, inp, L->vsum, v_cur, mctx_cur->type_v(), hparams.n_embd_head_v(il),
                                      hparams.n_head_kv(il), select, need_future);
    }

    if (!cparams.causal_attn) {
        return nullptr;
    }
    // a prepared prefix takes precedence: its clusters choose the prefix keys, the rest is read exactly
    if (kv->squeeze) {
        if (ggml_tensor * cur = squeeze_build_attn(ctx0, res, mctx_cur, q, kq_mask, kq_scale, softcap, il,
                                                   kq_b || sinks || v_mla, decode)) {
            return cur;
        }
    }
    if (!select) {
        return nullptr;
    }
    const int64_t n_kv     = mctx_cur->get_n_kv();
    ggml_tensor * k = mctx_cur->get_k(ctx0, il);
    if (n_kv < sparq_min_n_kv(sp, sparq_on_host(k), hparams.n_head(il) == hparams.n_head_kv(il))) {
        return nullptr;
    }
    if (kq_b || sinks || v_mla) {
        sparq_log_fallback(L, il, kq_b ? "KQ bias" : sinks ? "attention-sink tensors" : "MLA");
        return nullptr;
    }

    // 2. views in the shapes ggml_sparq_attn takes (as build_attn_mha prepares them for flash attention)
    const auto & sinfo = mctx_cur->get_sinfo();
    ggml_tensor * v  = mctx_cur->get_v(ctx0, il);
    ggml_tensor * kt = L->kt ? kv->sparq_get_kt(ctx0, il, n_kv, sinfo) : nullptr;
    const int64_t ns = k->ne[3];

    ggml_tensor * qv = ggml_view_4d(ctx0, q, q->ne[0], q->ne[1], q->ne[2]/ns, ns,
            q->nb[1], q->nb[2], q->nb[2]*(q->ne[2]/ns), 0);
    qv = ggml_permute(ctx0, qv, 0, 2, 1, 3);
    k  = ggml_permute(ctx0, k,  0, 2, 1, 3);
    v  = ggml_permute(ctx0, v,  0, 2, 1, 3);

    ggml_tensor * vsum = nullptr;
    if (vsum_rows) {
        vsum = ggml_reshape_4d(ctx0, vsum_rows, hparams.n_embd_head_v(il) + 1, hparams.n_head_kv(il), n_tokens/ns, ns);
    }

    const int64_t head_dim = hparams.n_embd_head_k(il);
    ggml_sparq_params op = ggml_sparq_default_params();
    op.k1              = sp.k1 > 0 ? sp.k1 : (int32_t) std::max<int64_t>(1, head_dim/4);
    op.k2              = sp.k2;
    op.window          = sp.window;
    op.sinks           = sp.sinks;
    op.mean            = L->mean_on ? GGML_SPARQ_MEAN_ON : GGML_SPARQ_MEAN_OFF;
    op.policy          = (ggml_sparq_policy) sp.policy;
    op.scale           = kq_scale;
    op.softcap         = softcap;
    op.sparse_v_thresh = sp.sparse_v_thresh;

    if (const char * err = ggml_sparq_attn_check(qv, k, kt, v, kq_mask, vsum, &op)) {
        sparq_log_fallback(L, il, err);
        return nullptr;
    }

    // 3. the op: [d_v, n_head, n_q, ns] -> [d_v*n_head, n_tokens], as flash attention returns it
    ggml_tensor * cur = ggml_sparq_attn(ctx0, qv, k, kt, v, kq_mask, vsum, op);
    // window and sinks by position: after seq_rm fills a hole, new tokens sit in lower cells than old ones
    ggml_sparq_attn_set_pos(cur, inp->get_pos(ctx0, kv, sinfo.s0, n_kv, ns));
    cb(cur, "sparq_attn", il);
    cur = ggml_reshape_2d(ctx0, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
    ggml_build_forward_expand(gf, cur);
    return cur;
}
