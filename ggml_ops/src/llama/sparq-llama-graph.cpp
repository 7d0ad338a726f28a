// SparQ in llama.cpp's attention graph: llm_graph_context::build_attn_sparq, called by both build_attn
// variants (plain and sliding-window caches) after the new K and V rows are stored.
//   - every ubatch: recompute the index (K^T) blocks the new keys fall in from K, add the new values into the
//     per-sequence V sums and the new keys into the key statistics (select qsigma);
//   - decode ubatches (one token per sequence), or every ubatch with --sparq-prefill, once the cache view
//     holds at least min_n_kv cells: ggml_sparq_attn instead of flash attention.
//   - a prepared prefix (sparq-squeeze-state.cpp): ggml_centroid_attn for every ubatch, before SparQ.
// Anything the op cannot honour for a layer falls back to dense with one log line.
#include "sparq-llama-internal.h"

#include "ggml-sparq.h"

#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-memory-hybrid.h"

#include <algorithm>
#include <map>

namespace {

// The context of `kv` within a graph's memory context (plain, sliding-window pair or hybrid), or nullptr.
const llama_kv_cache_context * sparq_kv_context(const llama_memory_context_i * mctx, const llama_kv_cache * kv) {
    const llama_kv_cache_context * found[2] = { nullptr, nullptr };
    if (const auto * c = dynamic_cast<const llama_kv_cache_context *>(mctx)) {
        found[0] = c;
    } else if (const auto * c = dynamic_cast<const llama_kv_cache_iswa_context *>(mctx)) {
        found[0] = c->get_base();
        found[1] = c->get_swa();
    } else if (const auto * c = dynamic_cast<const llama_memory_hybrid_context *>(mctx)) {
        found[0] = c->get_attn();
    }
    for (const auto * c : found) {
        if (c && c->get_kv() == kv) {
            return c;
        }
    }
    return nullptr;
}

// Index blocks of B cells a ubatch writes, per stream of its slot: the most over its streams (the graph's shape)
int64_t sparq_n_index_blocks(const llama_kv_cache::slot_info & sinfo, int64_t B) {
    int64_t n_blk = 0;
    for (const auto & idxs : sinfo.idxs) {
        std::vector<int64_t> blocks;
        blocks.reserve(idxs.size());
        for (const auto c : idxs) {
            blocks.push_back((int64_t) c/B);
        }
        std::sort(blocks.begin(), blocks.end());
        n_blk = std::max<int64_t>(n_blk, std::unique(blocks.begin(), blocks.end()) - blocks.begin());
    }
    return n_blk;
}

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

    // The cells this ubatch writes, per cache, derived from the cache's own k_idxs input (stream*kv_size + cell,
    // stream by stream), which is set before this input (inputs are set in the order they were added):
    //   tok_cells [n_tokens] I32: each token's cell, to read the keys and values back as the cache holds them;
    //   cells, mask, blk: the index blocks the writes touch, as ggml_sparq_index_write takes them (B = 1: the cells).
    struct cache_entry {
        const llama_kv_cache * kv;
        ggml_tensor * k_idxs;     // [n_tokens] I64
        int64_t       kv_size;
        uint32_t      s0;         // the slot's first stream
        int64_t       ns;         // its streams
        ggml_tensor * tok_cells = nullptr;
        int64_t       B = 0, n_blk = 0;
        ggml_tensor * cells = nullptr;   // [B*n_blk*ns] I32
        ggml_tensor * mask  = nullptr;   // [B*n_blk*ns] f32 (B > 1)
        ggml_tensor * blk   = nullptr;   // [n_blk, 1, ns] I64
    };
    std::vector<cache_entry> caches;

    cache_entry & get_cache(const llama_kv_cache * kv, ggml_tensor * k_idxs, const llama_kv_cache::slot_info & sinfo) {
        for (auto & e : caches) {
            if (e.kv == kv) {
                GGML_ASSERT(e.k_idxs == k_idxs);
                return e;
            }
        }
        cache_entry e = {};
        e.kv      = kv;
        e.k_idxs  = k_idxs;
        e.kv_size = kv->get_size();
        e.s0      = sinfo.s0;
        e.ns      = sinfo.s1 - sinfo.s0 + 1;
        caches.push_back(e);
        return caches.back();
    }

    ggml_tensor * get_tok_cells(ggml_context * ctx, cache_entry & e) {
        if (e.tok_cells == nullptr) {
            e.tok_cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens);
            ggml_set_input(e.tok_cells);
            ggml_set_name(e.tok_cells, "sparq_inp_tok_cells");
        }
        return e.tok_cells;
    }

    void ensure_index(ggml_context * ctx, cache_entry & e, const llama_kv_cache::slot_info & sinfo, int64_t B) {
        if (e.cells) {
            GGML_ASSERT(e.B == B); // one index type per cache
            return;
        }
        e.B     = B;
        e.n_blk = sparq_n_index_blocks(sinfo, B);
        e.cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B*e.n_blk*e.ns);
        e.blk   = ggml_new_tensor_3d(ctx, GGML_TYPE_I64, e.n_blk, 1, e.ns);
        ggml_set_input(e.cells);
        ggml_set_input(e.blk);
        ggml_set_name(e.cells, "sparq_inp_index_cells");
        ggml_set_name(e.blk, "sparq_inp_index_blk");
        if (B > 1) {
            e.mask = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, B*e.n_blk*e.ns);
            ggml_set_input(e.mask);
            ggml_set_name(e.mask, "sparq_inp_index_mask");
        }
    }

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
        for (const auto & e : caches) {
            if (!allocated(e.tok_cells) && !allocated(e.cells)) {
                continue;
            }
            GGML_ASSERT(allocated(e.k_idxs));
            const int64_t * src = (const int64_t *) e.k_idxs->data;
            if (allocated(e.tok_cells)) {
                int32_t * dst = (int32_t *) e.tok_cells->data;
                for (int64_t t = 0; t < n_tokens; ++t) {
                    dst[t] = (int32_t) src[t];
                }
            }
            if (allocated(e.cells)) {
                set_index(e, src);
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

    // the blocks of each stream, in the order the tokens first touch them; a stream with fewer blocks than n_blk
    // writes its last one again (block 0 when it has none: recomputing any block from K leaves it as it is)
    void set_index(const cache_entry & e, const int64_t * k_idxs) const {
        GGML_ASSERT(allocated(e.blk) && (e.mask == nullptr || allocated(e.mask)));
        int32_t * cdata = (int32_t *) e.cells->data;
        int64_t * bdata = (int64_t *) e.blk->data;
        float   * mdata = e.mask ? (float *) e.mask->data : nullptr;
        std::vector<std::vector<int64_t>> blocks(e.ns);
        for (int64_t t = 0; t < n_tokens; ++t) {
            const int64_t stream = k_idxs[t] / e.kv_size;
            const int64_t b      = (k_idxs[t] % e.kv_size) / e.B;
            GGML_ASSERT(stream >= e.s0 && stream < e.s0 + e.ns);
            auto & list = blocks[stream - e.s0];
            // a ubatch writes each cell once, so cells (B = 1) are distinct; blocks of 32 repeat
            if (e.B == 1 || std::find(list.begin(), list.end(), b) == list.end()) {
                list.push_back(b);
            }
        }
        for (int64_t s = 0; s < e.ns; ++s) {
            const auto & list = blocks[s];
            GGML_ASSERT((int64_t) list.size() <= e.n_blk && "the graph was built for fewer index blocks");
            // a stream's cells: sequence s0+s owns stream s0+s unless the cache is unified (one stream)
            const auto & cs = e.kv->get_cells(e.kv->get_n_stream() == 1 ? 0 : (llama_seq_id) (e.s0 + s));
            for (int64_t i = 0; i < e.n_blk; ++i) {
                const int64_t b = list.empty() ? 0 : list[std::min<int64_t>(i, (int64_t) list.size() - 1)];
                bdata[s*e.n_blk + i] = b;
                for (int64_t j = 0; j < e.B; ++j) {
                    const int64_t c   = b*e.B + j;
                    const int64_t out = (s*e.n_blk + i)*e.B + j;
                    const bool    in  = c < e.kv_size;
                    cdata[out] = (int32_t) ((e.s0 + s)*e.kv_size + (in ? c : 0));
                    if (mdata) {
                        // empty cells (and the padding past kv_size) count as 0 in a q8_0 block
                        mdata[out] = in && !cs.is_empty((uint32_t) c) ? 1.0f : 0.0f;
                    }
                }
            }
        }
    }

    // Per cache whether this graph keeps its derived state (adds the upkeep): a graph built for one case is not
    // reused in the other, which an invalidation or a rebuild between two steps brings about.
    std::vector<std::pair<const sparq_kv_state *, bool>> kept;

    void note_kept(const sparq_kv_state * st, bool keep) {
        for (const auto & [s, k] : kept) {
            if (s == st) {
                GGML_ASSERT(k == keep);
                return;
            }
        }
        kept.emplace_back(st, keep);
    }

    bool can_reuse(const llm_graph_params & params) override {
        if ((int64_t) params.ubatch.n_tokens != n_tokens || one_seq_per_token(params.ubatch) != one_seq_each) {
            return false;
        }
        for (const auto & [st, keep] : kept) {
            if (st->stale() == keep) {
                return false;
            }
        }
        // the graph's index writes have room for as many blocks per stream as the ubatch it was built for touched
        for (const auto & e : caches) {
            if (e.cells == nullptr) {
                continue;
            }
            const llama_kv_cache_context * c = sparq_kv_context(params.mctx, e.kv);
            if (c == nullptr) {
                return false;
            }
            const auto & sinfo = c->get_sinfo();
            if (sinfo.s0 != e.s0 || (int64_t) (sinfo.s1 - sinfo.s0 + 1) != e.ns ||
                sparq_n_index_blocks(sinfo, e.B) != e.n_blk) {
                return false;
            }
        }
        return true;
    }
};

// What the graph's attention layers run, counted while it is built. It has no tensors: a reused graph keeps it.
class sparq_graph_record : public llm_graph_input_i {
public:
    int32_t n_layers   = 0; // attention layers over a KV cache (each calls build_attn_sparq once)
    int32_t n_sparq    = 0; // of them, with ggml_sparq_attn
    int32_t n_centroid = 0; // of them, with ggml_centroid_attn

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
    }

    bool can_reuse(const llm_graph_params & params) override {
        GGML_UNUSED(params);
        return true;
    }
};

sparq_graph_record * sparq_record(llm_graph_result * res) {
    for (auto & inp : res->inputs) {
        if (auto * r = dynamic_cast<sparq_graph_record *>(inp.get())) {
            return r;
        }
    }
    return static_cast<sparq_graph_record *>(res->add_input(std::make_unique<sparq_graph_record>()));
}

sparq_graph_input * sparq_input(llm_graph_result * res, const llama_ubatch & ubatch, uint32_t n_seq_max) {
    for (auto & inp : res->inputs) {
        if (auto * s = dynamic_cast<sparq_graph_input *>(inp.get())) {
            return s;
        }
    }
    return static_cast<sparq_graph_input *>(res->add_input(std::make_unique<sparq_graph_input>(
        ubatch.n_tokens, n_seq_max, sparq_graph_input::one_seq_per_token(ubatch))));
}

void sparq_log_fallback(const sparq_kv_layer * L, int il, const char * why) {
    if (!L->logged) {
        L->logged = true;
        LLAMA_LOG_INFO("%s: SparQ: dense attention for layer %d: %s\n", __func__, il, why);
    }
}

// The upkeep ops write the derived state in place, so they run on the backend whose memory holds it: left to choose by
// a node's neighbours, the scheduler could run one elsewhere on a copy of the state, and the writes would be lost.
void run_where_state_is(ggml_backend_sched_t sched, ggml_tensor * node, const ggml_tensor * state) {
    const ggml_backend_buffer_t buf = state->view_src ? state->view_src->buffer : state->buffer;
    if (sched == nullptr || buf == nullptr) {
        return;
    }
    const ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(buf);
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_supports_buft(backend, buft) && ggml_backend_supports_op(backend, node)) {
            ggml_backend_sched_set_tensor_backend(sched, node, backend);
            return;
        }
    }
}

// x [d, h, n_tokens] as the sum ops read it (contiguous components, any row strides): x itself where it is (a
// decode step's one token counts too: ggml_n_dims would call it 2-dimensional), else a copy.
ggml_tensor * rows_as_3d(ggml_context * ctx0, ggml_tensor * x, int64_t d, int64_t h, int64_t n_tokens) {
    const bool as_is = x->nb[0] == sizeof(float) && x->ne[0] == d && x->ne[1] == h && x->ne[2] == n_tokens &&
                       x->ne[3] == 1;
    return as_is ? x : ggml_cont_3d(ctx0, x, d, h, n_tokens);
}

// A running per-sequence sum table (table [(d_v + 1)*n_head_kv, n_seq_max]: per head d_v sums and a count) takes
// this ubatch's rows v_cur [d_v, n_head_kv, n_tokens]; returns the sums each row sees (NULL unless select), after
// adding the graph's nodes that write the table back. The V sums pass V and its cache type (the rows are rounded
// to it here); the key statistics pass [k, k*k] of the keys as stored, type f32. Either way the sums are over the
// values the cache holds, so a rebuild from the cache agrees.
ggml_tensor * build_vsum_upkeep(ggml_context * ctx0, ggml_cgraph * gf, ggml_backend_sched_t sched,
                                sparq_graph_input * inp, ggml_tensor * tab,
                                ggml_tensor * v_cur, ggml_type type_v, int64_t d_v, int64_t h, bool select,
                                bool need_future) {
    const int64_t n_tokens = inp->n_tokens;
    const bool plain_type = v_cur->type == GGML_TYPE_F32 &&
                            (type_v == GGML_TYPE_F32 || type_v == GGML_TYPE_F16 || type_v == GGML_TYPE_BF16);
    if (inp->one_seq_each && plain_type) {
        // a decode step: each row is its sequence's sums plus its own value, and is the sequence's new row of
        // the table (the rows are distinct): one node that also writes it back
        ggml_tensor * rows = ggml_sparq_vsum_rows(ctx0, tab, rows_as_3d(ctx0, v_cur, d_v, h, n_tokens), inp->seq_idx,
                                                  type_v);
        run_where_state_is(sched, rows, tab);
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

void sparq_graph_run(const llm_graph_result * res, llama_sparq_run & out) {
    out.n_layers_sparq    = 0;
    out.n_layers_centroid = 0;
    out.n_layers_dense    = 0;
    for (const auto & inp : res->inputs) {
        if (const auto * r = dynamic_cast<const sparq_graph_record *>(inp.get())) {
            GGML_ASSERT(r->n_sparq + r->n_centroid <= r->n_layers);
            out.n_layers_sparq    = r->n_sparq;
            out.n_layers_centroid = r->n_centroid;
            out.n_layers_dense    = r->n_layers - r->n_sparq - r->n_centroid;
            return;
        }
    }
}

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
    // every layer is counted as dense unless it returns one of the ops below
    sparq_graph_record * record = sparq_record(res);
    record->n_layers++;
    if (mctx_cur == nullptr) {
        return nullptr;
    }
    const llama_kv_cache * kv = mctx_cur->get_kv();
    const float softcap = hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f;
    const bool decode = ubatch.n_tokens == ubatch.n_seqs_unq;  // one token per sequence
    const sparq_kv_layer * L = sp.enabled ? kv->sparq_layer(il) : nullptr;
    if (L == nullptr || !L->active) {
        // a prepared prefix (centroid-sparse) without SparQ
        ggml_tensor * cur = kv->squeeze && cparams.causal_attn ?
            squeeze_build_attn(ctx0, res, mctx_cur, q, kq_mask, kq_scale, softcap, il, kq_b || sinks || v_mla, decode) :
            nullptr;
        record->n_centroid += cur != nullptr;
        return cur;
    }

    const uint32_t n_seq_max = kv->get_n_seq_max();
    sparq_graph_input * inp = sparq_input(res, ubatch, n_seq_max);

    const bool select = decode || sp.prefill;

    // 1. the derived state follows this ubatch's writes where it is kept (not stale: sparq_kv_state::wanted); a
    // reserve graph sizes the buffers for the steps that keep it (llama_batch_allocr::ubatch_reserve gives its
    // tokens no sequences, which a decoded token always has). The K and V writes (cpy_k, cpy_v) are already in the
    // graph, and graph order is execution order, so reading the cache here reads this ubatch's rows too.
    const bool reserve = ubatch.n_tokens > 0 && ubatch.n_seq_id[0] == 0;
    const bool keep    = reserve || !kv->sparq->stale();
    inp->note_kept(kv->sparq.get(), keep);
    if (!keep) {
        k_cur = v_cur = nullptr;  // no upkeep: nothing adds this ubatch's rows to a stale state
    }
    const auto & sinfo = mctx_cur->get_sinfo();
    const int64_t n_head_kv = hparams.n_head_kv(il);
    const int64_t d_k       = hparams.n_embd_head_k(il);
    const int64_t d_v       = hparams.n_embd_head_v(il);
    auto * entry = (k_cur || v_cur) ? &inp->get_cache(kv, k_idxs, sinfo) : nullptr;
    // the ubatch's rows as the cache holds them, dequantized: [n_embd_gqa, n_tokens] f32
    auto cache_rows = [&](ggml_tensor * x) {
        ggml_tensor * x2d = ggml_reshape_2d(ctx0, x, x->ne[0], x->ne[1]*x->ne[2]);
        return ggml_get_rows(ctx0, x2d, inp->get_tok_cells(ctx0, *entry));
    };

    const ggml_type v_type = mctx_cur->type_v();
    auto plain = [](ggml_type t) { return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16; };
    // a decode step: the new values rounded to the cache's type as its write rounds them (a float V cache) and the
    // new keys read back from the cache (any type), added to their sequences' sums, the sums written back and the
    // index blocks recomputed, all in one node. Reading the keys from the cache leaves the graph's new keys one use,
    // their cache write, which ggml-cuda then fuses with their RoPE.
    const bool step_v = inp->one_seq_each && v_cur && L->vsum && v_cur->type == GGML_TYPE_F32 && plain(v_type);
    const bool step_k = inp->one_seq_each && k_cur && L->kstat;
    const bool need_future = select && !decode;
    ggml_tensor * vsum_rows  = nullptr; // [(d_v + 1)*n_head_kv, n_tokens]: the sums each row sees
    ggml_tensor * kstat_rows = nullptr; // [(2*d_k + 1)*n_head_kv, n_tokens]: the key statistics each row sees
    const bool one_node = step_v || step_k;  // the index blocks go into that node too
    if (one_node) {
        inp->ensure_seq_inputs(ctx0, !inp->one_seq_each, select, need_future);
        ggml_sparq_upkeep u = {};
        u.idx = inp->seq_idx;
        if (step_v) {
            u.vsum = L->vsum; u.v = rows_as_3d(ctx0, v_cur, d_v, n_head_kv, n_tokens); u.v_type = v_type;
        }
        u.k = L->k;
        if (step_k) {
            u.kstat = L->kstat; u.k_cells = inp->get_tok_cells(ctx0, *entry);
        }
        if (k_cur && L->kt) {
            inp->ensure_index(ctx0, *entry, sinfo, sparq_index_block(L->kt));
            u.kt = L->kt; u.cells = entry->cells; u.mask = entry->mask; u.blk = entry->blk;
            u.s0 = (int32_t) entry->s0;
        }
        ggml_tensor * rows = ggml_sparq_decode_upkeep(ctx0, &u);
        run_where_state_is(sched, rows, step_v ? L->vsum : L->kstat);
        ggml_build_forward_expand(gf, rows);
        const int64_t n_v = step_v ? L->vsum->ne[0] : 0;
        vsum_rows  = step_v ? ggml_view_2d(ctx0, rows, n_v, n_tokens, rows->nb[1], 0) : nullptr;
        kstat_rows = step_k ? ggml_view_2d(ctx0, rows, L->kstat->ne[0], n_tokens, rows->nb[1], n_v*sizeof(float))
                            : nullptr;
    }

    if (k_cur && L->kt && !one_node) {
        // recompute the index blocks the new keys fall in from K (q8_0: whole blocks of 32 cells), after the graph's
        // K write (graph order), so the index is a function of the cache's K only
        inp->ensure_index(ctx0, *entry, sinfo, sparq_index_block(L->kt));
        ggml_build_forward_expand(gf, ggml_sparq_index_write(ctx0, L->kt, L->k, entry->cells, entry->mask, entry->blk,
                                                             (int32_t) entry->s0));
    }

    if (v_cur && L->vsum && !step_v) {
        inp->ensure_seq_inputs(ctx0, !inp->one_seq_each, select, need_future);  // one_seq_each implies select
        ggml_tensor * v_new  = v_cur;
        ggml_type     v_sum_type = v_type;
        if (ggml_is_quantized(v_type)) {
            // quantized V: the values as stored (the quantize/dequantize round trip), read back from the cache
            ggml_tensor * r = cache_rows(L->v);
            v_new      = ggml_view_3d(ctx0, r, d_v, n_head_kv, n_tokens, ggml_row_size(r->type, d_v), r->nb[1], 0);
            v_sum_type = GGML_TYPE_F32;
        }
        vsum_rows = build_vsum_upkeep(ctx0, gf, sched, inp, L->vsum, v_new, v_sum_type, d_v, n_head_kv, select,
                                      need_future);
    }

    if (k_cur && L->kstat && !step_k) {
        // the keys as stored (rounded to K's type) and their squares, per head: [2*d_k, n_head_kv, n_tokens]
        inp->ensure_seq_inputs(ctx0, !inp->one_seq_each, select, need_future);
        ggml_tensor * r3 = ggml_reshape_3d(ctx0, cache_rows(L->k), d_k, n_head_kv, n_tokens);
        ggml_tensor * k2 = ggml_concat(ctx0, r3, ggml_sqr(ctx0, r3), 0);
        kstat_rows = build_vsum_upkeep(ctx0, gf, sched, inp, L->kstat, k2, GGML_TYPE_F32, 2*d_k, n_head_kv, select,
                                       need_future);
    }

    if (!cparams.causal_attn) {
        return nullptr;
    }
    // a prepared prefix takes precedence: its clusters choose the prefix keys, the rest is read exactly
    if (kv->squeeze) {
        if (ggml_tensor * cur = squeeze_build_attn(ctx0, res, mctx_cur, q, kq_mask, kq_scale, softcap, il,
                                                   kq_b || sinks || v_mla, decode)) {
            record->n_centroid++;
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
    if (!keep) {
        // the view reached min_n_kv by more than the one cell update() looks ahead: this step reads densely, and
        // the state is rebuilt before the next one
        kv->sparq->wanted = true;
        return nullptr;
    }

    // 2. views in the shapes ggml_sparq_attn takes (as build_attn_mha prepares them for flash attention)
    ggml_tensor * v  = mctx_cur->get_v(ctx0, il);
    ggml_tensor * kt = L->kt ? kv->sparq_get_kt(ctx0, il, n_kv, sinfo) : nullptr;
    const int64_t ns = k->ne[3];

    ggml_tensor * qv = ggml_view_4d(ctx0, q, q->ne[0], q->ne[1], q->ne[2]/ns, ns,
            q->nb[1], q->nb[2], q->nb[2]*(q->ne[2]/ns), 0);
    qv = ggml_permute(ctx0, qv, 0, 2, 1, 3);
    k  = ggml_permute(ctx0, k,  0, 2, 1, 3);
    v  = ggml_permute(ctx0, v,  0, 2, 1, 3);

    // the rows [width*n_head_kv, n_tokens] (any row stride) per KV head, query row and stream, as the op reads them
    auto per_row = [&](ggml_tensor * rows, int64_t width) {
        return ggml_view_4d(ctx0, rows, width, n_head_kv, n_tokens/ns, ns, width*sizeof(float), rows->nb[1],
                            rows->nb[1]*(n_tokens/ns), 0);
    };
    ggml_tensor * vsum  = vsum_rows  ? per_row(vsum_rows, d_v + 1)  : nullptr;
    ggml_tensor * kstat = kstat_rows ? per_row(kstat_rows, 2*d_k + 1) : nullptr;

    // k1 by default: about 1/8 of dense attention's bytes read by the score pass (k1 rows of the index per cell
    // against 2*d_k elements of K and V), so twice the components for the q8 index's half-size rows; the q4 index
    // scores every component
    const int64_t k1_auto  = sparq_k1_auto(L->kt ? sp.index : LLAMA_SPARQ_INDEX_F16, d_k);
    ggml_sparq_params op = ggml_sparq_default_params();
    op.k1              = sp.k1 > 0 ? sp.k1 : (int32_t) std::max<int64_t>(1, k1_auto);
    op.k2              = sp.k2;
    op.window          = sp.window;
    op.sinks           = sp.sinks;
    op.mean            = L->mean_on ? GGML_SPARQ_MEAN_ON : GGML_SPARQ_MEAN_OFF;
    op.policy          = (ggml_sparq_policy) sp.policy;
    op.scale           = kq_scale;
    op.softcap         = softcap;
    op.sparse_v_thresh = sp.sparse_v_thresh;
    op.select          = sp.select == LLAMA_SPARQ_SELECT_QSIGMA ? GGML_SPARQ_SELECT_QSIGMA : GGML_SPARQ_SELECT_Q;

    if (const char * err = ggml_sparq_attn_check(qv, k, kt, v, kq_mask, vsum, &op)) {
        sparq_log_fallback(L, il, err);
        return nullptr;
    }

    // 3. the op: [d_v, n_head, n_q, ns] -> [d_v*n_head, n_tokens], as flash attention returns it
    ggml_tensor * cur = ggml_sparq_attn(ctx0, qv, k, kt, v, kq_mask, vsum, op);
    // window and sinks by position: after seq_rm fills a hole, new tokens sit in lower cells than old ones
    ggml_sparq_attn_set_pos(cur, inp->get_pos(ctx0, kv, sinfo.s0, n_kv, ns));
    if (kstat) {
        // the running key statistics (select qsigma); without them the op computes them from the visible K
        ggml_sparq_attn_set_kstat(cur, kstat);
    }
    cb(cur, "sparq_attn", il);
    cur = ggml_reshape_2d(ctx0, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
    ggml_build_forward_expand(gf, cur);
    record->n_sparq++;
    return cur;
}
