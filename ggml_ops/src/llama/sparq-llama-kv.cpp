// SparQ's derived KV state, kept by llama_kv_cache (member functions declared by vendor/patches/0003):
//   K^T  per layer [kv_size, n_embd_k_gqa, n_stream]: one row of cells per key component, so the
//        approximate-score pass reads k1 contiguous rows (docs/design.md, "Derived KV state");
//   vsum per layer [(d_v + 1) * n_head_kv, n_seq_max] f32: per sequence and KV head, the sum of V over the
//        sequence's cells and their count (the mean value of step 5 without reading V).
// Graphs write both next to cpy_k/cpy_v (sparq-llama-graph.cpp). Whatever changes K or the cells outside a
// graph (K-shift, seq_rm/cp/keep/add, clear, state load, stream copy) marks them stale, and update(),
// which runs before every decode, rebuilds them from K, V and the cells on the device that holds them once a step
// may read them (sparq_kv_state::wanted): until the cache reaches --sparq-min-kv they stay stale and unkept.
#include "sparq-llama-internal.h"
#include "sparq-squeeze.h"

#include "llama-arch.h"
#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <map>
#include <string>

static bool sparq_float_type(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

static bool sparq_quant_type(ggml_type t) {
    return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_0 ||
           t == GGML_TYPE_Q5_1;
}

// Why the op cannot read a cache tensor of this type and head dim ("" when it can): quantized rows are read a
// block at a time, so each head must start on a block boundary.
static std::string sparq_kv_type_reason(const char * what, ggml_type t, uint32_t head_dim) {
    if (sparq_float_type(t)) {
        return "";
    }
    if (!sparq_quant_type(t)) {
        return std::string(what) + " cache type " + ggml_type_name(t) +
               " (the op reads f32, f16, bf16, q8_0, q4_0, q4_1, q5_0 or q5_1 caches)";
    }
    if (head_dim % ggml_blck_size(t) != 0) {
        return std::string(what) + " cache type " + ggml_type_name(t) + " with head dim " + std::to_string(head_dim) +
               " (not a multiple of the type's block of " + std::to_string(ggml_blck_size(t)) + ")";
    }
    return "";
}

// kt: some keys changed; cells: some cells changed their sequences (or were freed). A q8_0 index block counts its
// empty cells as 0, so freed cells change it; the key statistics follow both the keys and the cells.
static void sparq_mark_dirty(sparq_kv_state & st, bool kt, bool cells) {
    st.kt_dirty    = st.kt_dirty    || (kt && st.has_kt()) || (cells && st.has_block_index());
    st.vsum_dirty  = st.vsum_dirty  || (cells && st.has_vsum());
    st.kstat_dirty = st.kstat_dirty || ((kt || cells) && st.has_kstat());
}

bool llama_kv_cache::sparq_enable(const llama_sparq_params & params, std::string & err) {
    sparq_disable();

    if (other) {
        err = "SparQ: this KV cache shares its cells with another cache (not supported)";
        return false;
    }
    if (v_trans) {
        err = "SparQ needs flash attention's row-major V cache; create the context with flash attention on "
              "(-fa on, flash_attn=True, LLAMA_FLASH_ATTN_TYPE_ENABLED)";
        return false;
    }

    auto st = std::make_shared<sparq_kv_state>();
    st->params = params;
    st->layers.resize(layers.size());

    std::map<std::string, std::string> dense_layers; // reason -> layer list, one log line per reason
    std::map<ggml_backend_buffer_type_t, ggml_context_ptr> ctx_map; // one context per buffer type

    auto ctx_for = [&](ggml_backend_buffer_type_t buft) -> ggml_context * {
        auto & ctx = ctx_map[buft];
        if (!ctx) {
            ggml_init_params ip = {
                /*.mem_size   =*/ 3u*layers.size()*ggml_tensor_overhead(),
                /*.mem_buffer =*/ nullptr,
                /*.no_alloc   =*/ true,
            };
            ctx.reset(ggml_init(ip));
            GGML_ASSERT(ctx && "sparq: failed to create a ggml context");
        }
        return ctx.get();
    };

    const uint32_t kv_size  = get_size();
    const bool     q4_index = !params.default_layout && params.index == LLAMA_SPARQ_INDEX_Q4;

    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const auto & layer = layers[ikv];
        const uint32_t il = layer.il;
        auto & L = st->layers[ikv];

        const bool swa = hparams.is_swa(il);
        if (swa && !params.swa) {
            L.reason = "sliding-window layer (its read is bounded; --sparq-swa includes it)";
        } else if (model.arch == LLM_ARCH_GROK) {
            L.reason = "Grok's attention logit scaling";
        } else if (hparams.use_alibi || hparams.f_max_alibi_bias > 0.0f) {
            L.reason = "ALiBi position bias";
        } else if (layer.v == nullptr) {
            L.reason = "no V cache";
        } else if (!(L.reason = sparq_kv_type_reason("K", layer.k->type, hparams.n_embd_head_k(il))).empty() ||
                   !(L.reason = sparq_kv_type_reason("V", layer.v->type, hparams.n_embd_head_v(il))).empty()) {
            // the reason is set
        } else if (params.k1 > 0 && (uint32_t) params.k1 > hparams.n_embd_head_k(il)) {
            L.reason = "k1 exceeds this layer's head dim";
        } else if (q4_index && hparams.n_embd_head_k(il) % 8 != 0) {
            L.reason = "the q4 index needs a key head dim that is a multiple of 8";
        } else if (q4_index && !sparq_on_host(layer.k) &&
                   (hparams.n_embd_head_k(il) % 32 != 0 || hparams.n_embd_head_k(il) > 256)) {
            L.reason = "the q4 index's CUDA kernel needs a key head dim that is a multiple of 32, at most 256 (use "
                       "--sparq-index q8 for this model on a GPU)";
        }
        if (!L.reason.empty()) {
            auto & list = dense_layers[L.reason];
            list += (list.empty() ? "" : ",") + std::to_string(il);
            continue;
        }

        L.active  = true;
        L.mean_on = params.mean == LLAMA_SPARQ_MEAN_ON ||
                    (params.mean == LLAMA_SPARQ_MEAN_AUTO && hparams.n_head(il) == hparams.n_head_kv(il));

        L.k = layer.k;
        L.v = layer.v;
        GGML_ASSERT(ggml_is_contiguous(layer.k) && layer.k->ne[1] == kv_size && layer.k->ne[2] == n_stream);
        GGML_ASSERT(ggml_is_contiguous(layer.v) && layer.v->ne[1] == kv_size && layer.v->ne[2] == n_stream);

        ggml_context * ctx = ctx_for(ggml_backend_buffer_get_type(layer.k->buffer));
        if (!params.default_layout) {
            // q8: int8 blocks of 32 cells per component row (the row padded to whole blocks); f16: 2 bytes a
            // component whatever the cache type (the dequantized keys rounded once); q4: per stream and block of 32
            // cells each KV head's block (ggml-sparq.h, "The q4 index")
            const bool      q8      = params.index == LLAMA_SPARQ_INDEX_Q8;
            const ggml_type kt_type = q8 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
            const int64_t   row_len = q8 ? GGML_PAD((int64_t) kv_size, ggml_blck_size(GGML_TYPE_Q8_0)) : kv_size;
            if (q4_index) {
                const int64_t n_blk = ((int64_t) kv_size + GGML_SPARQ_Q4_CELLS - 1) / GGML_SPARQ_Q4_CELLS;
                L.kt = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, GGML_SPARQ_Q4_DIM_BYTES*hparams.n_embd_head_k(il),
                                          hparams.n_head_kv(il), n_blk, n_stream);
            } else {
                L.kt = ggml_new_tensor_3d(ctx, kt_type, row_len, hparams.n_embd_k_gqa(il), n_stream);
            }
            ggml_format_name(L.kt, "sparq_kt_l%u", il);
        }
        // sliding-window layers hide part of the sequence, so a per-sequence sum is not their mean: the op
        // then averages the visible V itself (a bounded read)
        if (L.mean_on && !swa) {
            L.vsum = ggml_new_tensor_2d(ctx, GGML_TYPE_F32,
                    (int64_t) (hparams.n_embd_head_v(il) + 1)*hparams.n_head_kv(il), n_seq_max);
            ggml_format_name(L.vsum, "sparq_vsum_l%u", il);
        }
        // the same for the keys' per-component spread (select qsigma; the q4 index chooses no components): sliding-
        // window layers leave it to the op
        if (params.select == LLAMA_SPARQ_SELECT_QSIGMA && !q4_index && !swa) {
            L.kstat = ggml_new_tensor_2d(ctx, GGML_TYPE_F32,
                    (int64_t) (2*hparams.n_embd_head_k(il) + 1)*hparams.n_head_kv(il), n_seq_max);
            ggml_format_name(L.kstat, "sparq_kstat_l%u", il);
        }
    }

    for (const auto & [reason, list] : dense_layers) {
        LLAMA_LOG_INFO("%s: SparQ: dense attention for layers %s: %s\n", __func__, list.c_str(), reason.c_str());
    }

    for (auto & [buft, ctx] : ctx_map) {
        if (ggml_get_first_tensor(ctx.get()) == nullptr) {
            continue; // only layers without K^T and V sums on this buffer type
        }
        ggml_backend_buffer_t buf = nullptr;
        size_t size = 0;
        if (hparams.no_alloc) {
            // a model loaded to measure memory (llama.cpp's parameter fitting): a dummy buffer, as the cache's own
            // tensors get, and the size the tensors would take
            buf  = ggml_backend_buft_alloc_buffer(buft, /*size =*/ 0);
            size = ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.get(), buft);
            for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); t != nullptr; t = ggml_get_next_tensor(ctx.get(), t)) {
                t->buffer = buf;
            }
        } else {
            buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
            size = buf ? ggml_backend_buffer_get_size(buf) : 0;
        }
        if (buf == nullptr) {
            err = std::string("SparQ: failed to allocate the derived KV state in ") + ggml_backend_buft_name(buft);
            return false;
        }
        if (!hparams.no_alloc) {
            ggml_backend_buffer_clear(buf, 0);
        }
        std::string index_types; // the index types on this buffer (every layer's, usually one)
        for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); t != nullptr; t = ggml_get_next_tensor(ctx.get(), t)) {
            const bool is_kt = std::string(ggml_get_name(t)).rfind("sparq_kt_", 0) == 0;
            const std::string name = t->type == GGML_TYPE_I8 ? "q4" : ggml_type_name(t->type);
            if (is_kt && index_types.find(name) == std::string::npos) {
                index_types += (index_types.empty() ? "" : ",") + name;
            }
        }
        LLAMA_LOG_INFO("%s: %10s SparQ K^T (%s) + V-sum + key-stat buffer size = %8.2f MiB\n", __func__,
                ggml_backend_buffer_name(buf), index_types.empty() ? "none" : index_types.c_str(),
                size/1024.0/1024.0);
        st->ctxs_bufs.emplace_back(std::move(ctx), ggml_backend_buffer_ptr(buf));
    }

    // a measuring cache (no_alloc) holds nothing to derive and never decodes
    st->kt_dirty    = !hparams.no_alloc && st->has_kt();
    st->vsum_dirty  = !hparams.no_alloc && st->has_vsum();
    st->kstat_dirty = !hparams.no_alloc && st->has_kstat();
    st->wanted      = params.min_n_kv == 0;
    sparq = std::move(st);
    return true;
}

void llama_kv_cache::sparq_disable() {
    sparq.reset();
}

void llama_kv_cache::sparq_invalidate(bool kt, bool vsum, int32_t keys_stream, llama_seq_id keys_seq) {
    if (squeeze && keys_seq >= 0) {
        // a state load places cells itself, before any decode verifies: prefix cells that earlier removals freed
        // must be seen now, or the load could reuse them at the same positions unnoticed
        sparq_squeeze_access::verify(*this);
    }
    if (squeeze) {
        // a state load of one sequence writes that sequence's cells after removing it: the prefix's cells can
        // be rewritten only if that sequence alone holds some of them (another sequence sharing them keeps them)
        const bool rewrites = kt && (keys_seq < 0 || sparq_squeeze_access::sole_holder(*this, keys_seq));
        if (rewrites && (keys_stream < 0 || keys_stream == (int32_t) squeeze->stream)) {
            // the prefix's K itself may have changed (K-shift, a copy into its stream, a state load of a
            // sequence that alone held some of its cells): the clusters no longer describe it
            sparq_squeeze_access::drop(*this, "the cache's keys changed (shift, stream copy or state load)");
        } else {
            if (rewrites && keys_seq >= 0) {
                // the same in a mirror stream ends that mirror (a copy into one is decided by sparq_stream_copied)
                sparq_squeeze_access::end_mirror(*this, (uint32_t) keys_stream, "a state load rewrote its cells");
            }
            squeeze->check = true; // cells may have been removed or copied: verified before the next graph
        }
    }
    if (!sparq) {
        return;
    }
    sparq_mark_dirty(*sparq, kt, vsum);
}

// seq_rm: only a removal that touches some sequence's cells changes the V sums (llama-cpp-python calls
// seq_rm(-1, n_past, -1) before every eval, which usually removes nothing)
void llama_kv_cache::sparq_invalidate_range(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (squeeze) {
        squeeze->check = true;
    }
    if (!sparq) {
        return;
    }
    const bool clean = (!sparq->has_vsum() || sparq->vsum_dirty) && (!sparq->has_kstat() || sparq->kstat_dirty) &&
                       (!sparq->has_block_index() || sparq->kt_dirty);
    if (clean) {
        return; // nothing a removal could make stale
    }
    for (llama_seq_id s = 0; s < (llama_seq_id) n_seq_max; ++s) {
        if (seq_id >= 0 && s != seq_id) {
            continue;
        }
        const auto & cells = v_cells[seq_to_stream[s]];
        const llama_pos lo = cells.seq_pos_min(s);
        const llama_pos hi = cells.seq_pos_max(s);
        if (lo >= 0 && hi >= p0 && lo < p1) {
            sparq_mark_dirty(*sparq, false, true);
            return;
        }
    }
}

// seq_cp across streams, after the destination's cells were set: the destination may now mirror the prepared prefix
void llama_kv_cache::sparq_stream_copied(uint32_t s_src, uint32_t s_dst) {
    if (squeeze) {
        sparq_squeeze_access::stream_copied(*this, s_src, s_dst);
    }
}

// Whether update() has work: a stale derived state that the next step may read, or a prepared prefix to verify. The
// next step may read the state where a graph wanted it, or where the cache view after one more cell (padded as
// get_n_kv pads it) reaches a SparQ layer's min_n_kv; a step that crosses it by more cells than that reads
// densely and wants the state (build_attn_sparq).
bool llama_kv_cache::sparq_pending() const {
    if (squeeze && squeeze->check) {
        return true;
    }
    if (!sparq || !sparq->stale()) {
        return false;
    }
    if (sparq->wanted) {
        return true;
    }
    const uint32_t n_pad_cur = std::max(n_pad, 256u);
    uint32_t n_kv_next = 0;
    for (const auto & cells : v_cells) {
        const uint32_t padded = std::max(n_pad_cur, GGML_PAD(cells.used_max_p1() + 1, n_pad_cur));
        n_kv_next = std::max(n_kv_next, std::min(cells.size(), padded));
    }
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const int32_t il  = layers[ikv].il;
        const bool    mha = hparams.n_head(il) == hparams.n_head_kv(il);
        const int32_t min_n_kv = sparq_min_n_kv(sparq->params, sparq_on_host(layers[ikv].k), mha);
        if (sparq->layers[ikv].active && n_kv_next >= (uint32_t) min_n_kv) {
            return true;
        }
    }
    return false;
}

// The derived state's buffers, counted like the cache's own (llama_get_memory_breakdown, llama.cpp's parameter fitting);
// with a model loaded to measure memory (no_alloc) the sizes its tensors would take.
void llama_kv_cache::sparq_memory_breakdown(std::map<ggml_backend_buffer_type_t, size_t> & ret) const {
    if (squeeze) {
        for (const auto & [ctx, buf] : squeeze->ctxs_bufs) {
            ret[ggml_backend_buffer_get_type(buf.get())] += ggml_backend_buffer_get_size(buf.get());
        }
    }
    if (!sparq) {
        return;
    }
    for (const auto & [ctx, buf] : sparq->ctxs_bufs) {
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(buf.get());
        ret[buft] += hparams.no_alloc ? ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.get(), buft) :
                                        ggml_backend_buffer_get_size(buf.get());
    }
}

const sparq_kv_layer * llama_kv_cache::sparq_layer(int32_t il) const {
    if (!sparq) {
        return nullptr;
    }
    const auto it = map_layer_ids.find(il);
    return it == map_layer_ids.end() ? nullptr : &sparq->layers[it->second];
}

ggml_tensor * llama_kv_cache::sparq_vsum_table(int32_t il) const {
    const sparq_kv_layer * L = sparq_layer(il);
    return L ? L->vsum : nullptr;
}

ggml_tensor * llama_kv_cache::sparq_get_kt(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo) const {
    const sparq_kv_layer * L = sparq_layer(il);
    if (L == nullptr || L->kt == nullptr) {
        return nullptr;
    }
    ggml_tensor * kt = L->kt;
    const uint32_t ns        = sinfo.s1 - sinfo.s0 + 1;
    if (kt->type == GGML_TYPE_I8) {
        // the q4 index [18*head_dim, n_head_kv, n_blk, n_stream] as the op takes it: [18*head_dim, n_kv/32 rounded
        // up, n_head_kv, ns]
        const int64_t n_blk = ((int64_t) n_kv + GGML_SPARQ_Q4_CELLS - 1) / GGML_SPARQ_Q4_CELLS;
        GGML_ASSERT(n_blk <= kt->ne[2]);
        return ggml_view_4d(ctx, kt, kt->ne[0], n_blk, kt->ne[1], ns, kt->nb[2], kt->nb[1], kt->nb[3],
                            kt->nb[3]*sinfo.s0);
    }
    const int64_t  row_len   = kt->ne[0];
    const int64_t  n_kt      = GGML_PAD((int64_t) n_kv, sparq_index_block(kt)); // whole q8_0 blocks
    const uint64_t head_dim  = hparams.n_embd_head_k(il);
    const uint64_t n_embd    = kt->ne[1];
    GGML_ASSERT(n_kt <= row_len);

    // [n_kt, head_dim, n_head_kv, ns]: the layout ggml_sparq_attn takes as kt
    return ggml_view_4d(ctx, kt,
            n_kt, head_dim, hparams.n_head_kv(il), ns,
            ggml_row_size(kt->type, row_len),
            ggml_row_size(kt->type, row_len*head_dim),
            ggml_row_size(kt->type, row_len*n_embd),
            ggml_row_size(kt->type, row_len*n_embd)*sinfo.s0);
}


//
// rebuild
//

namespace {

// The rebuild's host inputs, filled from the cells.
class sparq_rebuild_input : public llm_graph_input_i {
public:
    const llama_kv_cells_vec * cells = nullptr; // per stream
    uint32_t kv_size   = 0;
    uint32_t n_seq_max = 0;

    // the used cells of every stream, stream by stream (cells 0..used_max_p1-1 of each): the sums read them
    ggml_tensor * sum_cells = nullptr;  // [n_cells] I32: stream*kv_size + cell
    ggml_tensor * onehot    = nullptr;  // [n_cells, n_seq_max] f32: the cell holds the sequence

    // the index blocks of every stream's used cells, per block size B: as ggml_sparq_index_write takes them
    struct index_entry {
        int64_t B, n_blk;
        ggml_tensor * cells, * mask, * blk;
    };
    std::vector<index_entry> index;

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        const int64_t n_stream = (int64_t) cells->size();
        if (sum_cells) {
            GGML_ASSERT(ggml_backend_buffer_is_host(sum_cells->buffer) && ggml_backend_buffer_is_host(onehot->buffer));
            int32_t * cdata = (int32_t *) sum_cells->data;
            float   * odata = (float *) onehot->data;
            const int64_t n_cells = sum_cells->ne[0];
            int64_t r = 0;
            for (int64_t s = 0; s < n_stream; ++s) {
                const auto & cs = (*cells)[s];
                for (uint32_t c = 0; c < cs.used_max_p1(); ++c, ++r) {
                    GGML_ASSERT(r < n_cells);
                    cdata[r] = (int32_t) (s*kv_size + c);
                    // a stream's cells hold only the sequences of that stream
                    for (uint32_t q = 0; q < n_seq_max; ++q) {
                        odata[q*n_cells + r] = cs.seq_has(c, q) ? 1.0f : 0.0f;
                    }
                }
            }
            GGML_ASSERT(r == n_cells);
        }
        for (const auto & e : index) {
            GGML_ASSERT(ggml_backend_buffer_is_host(e.cells->buffer) && ggml_backend_buffer_is_host(e.blk->buffer));
            GGML_ASSERT(e.mask == nullptr || ggml_backend_buffer_is_host(e.mask->buffer));
            int32_t * cdata = (int32_t *) e.cells->data;
            int64_t * bdata = (int64_t *) e.blk->data;
            float   * mdata = e.mask ? (float *) e.mask->data : nullptr;
            for (int64_t s = 0; s < n_stream; ++s) {
                const auto & cs = (*cells)[s];
                const int64_t n_blk_s = ((int64_t) cs.used_max_p1() + e.B - 1)/e.B;
                for (int64_t b = 0; b < e.n_blk; ++b) {
                    // a stream with fewer blocks writes its last one again (block 0 when it has none)
                    const int64_t blk = n_blk_s == 0 ? 0 : std::min(b, n_blk_s - 1);
                    bdata[s*e.n_blk + b] = blk;
                    for (int64_t i = 0; i < e.B; ++i) {
                        const int64_t c   = blk*e.B + i;
                        const int64_t out = (s*e.n_blk + b)*e.B + i;
                        const bool    in  = c < (int64_t) kv_size;
                        cdata[out] = (int32_t) (s*kv_size + (in ? c : 0));
                        if (mdata) {
                            mdata[out] = in && !cs.is_empty((uint32_t) c) ? 1.0f : 0.0f;
                        }
                    }
                }
            }
        }
    }
};

// Per sequence and head the sums of x over the sequence's cells followed by their count: x [w*h, n_cells] f32,
// onehot [n_cells, n_seq] (the cell holds the sequence) -> [w + 1, h, n_seq]
ggml_tensor * sparq_seq_sums(ggml_context * ctx, ggml_tensor * x, int64_t w, int64_t h, ggml_tensor * onehot) {
    const int64_t n_seq = onehot->ne[1];
    GGML_ASSERT(x->ne[0] == w*h && x->ne[1] == onehot->ne[0]);
    ggml_tensor * x_t  = ggml_cont(ctx, ggml_transpose(ctx, x));                 // [n_used, w*h]
    ggml_tensor * sums = ggml_mul_mat(ctx, x_t, onehot);                         // [w*h, n_seq]
    ggml_tensor * cnt  = ggml_sum_rows(ctx, onehot);                             // [1, n_seq]
    cnt = ggml_repeat_4d(ctx, ggml_reshape_3d(ctx, cnt, 1, 1, n_seq), 1, h, n_seq, 1);
    return ggml_concat(ctx, ggml_reshape_3d(ctx, sums, w, h, n_seq), cnt, 0);
}

} // namespace

bool llama_kv_cache::sparq_update(llama_context * lctx) {
    sparq_squeeze_access::verify(*this); // host only: whether the prepared prefix's cells still hold it
    if (!sparq_pending()) {  // after the verify: the SparQ state's due
        return false;
    }

    auto * sched = lctx->get_sched();
    ggml_backend_sched_reset(sched);

    auto * res = lctx->get_gf_res_reserve();
    res->reset();

    ggml_context * ctx = res->get_ctx();
    ggml_cgraph  * gf  = res->get_gf();

    auto inp = std::make_unique<sparq_rebuild_input>();
    inp->cells     = &v_cells;
    inp->kv_size   = get_size();
    inp->n_seq_max = n_seq_max;

    std::vector<uint32_t> n_used(n_stream);
    uint32_t max_used = 0;
    for (uint32_t s = 0; s < n_stream; ++s) {
        n_used[s] = v_cells[s].used_max_p1();
        max_used  = std::max(max_used, n_used[s]);
    }

    // the sums read every used cell of each stream, dequantized (get_rows), in one product per table
    uint32_t n_sum_cells = 0;
    for (uint32_t s = 0; s < n_stream; ++s) {
        n_sum_cells += n_used[s];
    }
    const bool sums = (sparq->vsum_dirty && sparq->has_vsum()) || (sparq->kstat_dirty && sparq->has_kstat());
    if (sums && n_sum_cells > 0) {
        inp->sum_cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_sum_cells);
        inp->onehot    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_sum_cells, n_seq_max);
        ggml_set_input(inp->sum_cells);
        ggml_set_input(inp->onehot);
    }

    // the index inputs, one set per block size: every stream's blocks up to its last used cell
    auto index_inputs = [&](int64_t B) -> const sparq_rebuild_input::index_entry & {
        for (const auto & e : inp->index) {
            if (e.B == B) {
                return e;
            }
        }
        int64_t n_blk = 0;
        for (uint32_t s = 0; s < n_stream; ++s) {
            n_blk = std::max<int64_t>(n_blk, ((int64_t) n_used[s] + B - 1)/B);
        }
        sparq_rebuild_input::index_entry e = { B, n_blk, nullptr, nullptr, nullptr };
        e.cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B*n_blk*n_stream);
        e.blk   = ggml_new_tensor_3d(ctx, GGML_TYPE_I64, n_blk, 1, n_stream);
        ggml_set_input(e.cells);
        ggml_set_input(e.blk);
        if (B > 1) {
            e.mask = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, B*n_blk*n_stream);
            ggml_set_input(e.mask);
        }
        inp->index.push_back(e);
        return inp->index.back();
    };

    int n_work = 0;
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const auto & layer = layers[ikv];
        const auto & L     = sparq->layers[ikv];
        const uint32_t il  = layer.il;

        if (sparq->kt_dirty && L.kt && max_used > 0) {
            const auto & e = index_inputs(sparq_index_block(L.kt));
            ggml_build_forward_expand(gf, ggml_sparq_index_write(ctx, L.kt, L.k, e.cells, e.mask, e.blk, 0));
            n_work++;
        }

        // per sequence sums over the used rows of x [n_embd_x, kv_size, n_stream] (d components a head, then with
        // squares their squares too)
        auto rebuild_sums = [&](ggml_tensor * table, ggml_tensor * x, int64_t d, int64_t h, bool squares) {
            if (inp->sum_cells == nullptr) {
                ggml_backend_tensor_memset(table, 0, 0, ggml_nbytes(table)); // no cells: all sums are 0
                return;
            }
            const int64_t w = squares ? 2*d : d;
            ggml_tensor * r = ggml_get_rows(ctx, ggml_reshape_2d(ctx, x, x->ne[0], x->ne[1]*x->ne[2]), inp->sum_cells);
            if (x->ne[0] != d*h) {
                r = ggml_view_2d(ctx, r, d*h, n_sum_cells, r->nb[1], 0); // V rows may be padded
            }
            if (squares) {
                // the keys and their squares, per head: [2d, h, n_cells]
                ggml_tensor * r3 = ggml_reshape_3d(ctx, ggml_is_contiguous(r) ? r : ggml_cont(ctx, r), d, h, n_sum_cells);
                r = ggml_reshape_2d(ctx, ggml_concat(ctx, r3, ggml_sqr(ctx, r3), 0), w*h, n_sum_cells);
            }
            ggml_tensor * acc = sparq_seq_sums(ctx, r, w, h, inp->onehot);
            ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_reshape_2d(ctx, acc, table->ne[0], n_seq_max), table));
            n_work++;
        };

        if (sparq->vsum_dirty && L.vsum) {
            rebuild_sums(L.vsum, layer.v, hparams.n_embd_head_v(il), hparams.n_head_kv(il), false);
        }
        if (sparq->kstat_dirty && L.kstat) {
            rebuild_sums(L.kstat, layer.k, hparams.n_embd_head_k(il), hparams.n_head_kv(il), true);
        }
    }

    sparq->kt_dirty    = false;
    sparq->vsum_dirty  = false;
    sparq->kstat_dirty = false;
    sparq->wanted      = sparq->params.min_n_kv == 0;

    if (n_work == 0) {
        return false;
    }

    res->add_input(std::move(inp));

    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        LLAMA_LOG_ERROR("%s: SparQ: failed to allocate the graph that rebuilds the derived KV state\n", __func__);
        sparq->kt_dirty = sparq->vsum_dirty = sparq->kstat_dirty = sparq->wanted = true;
        return false;
    }

    res->set_inputs(nullptr);

    if (lctx->graph_compute(gf, false) != GGML_STATUS_SUCCESS) {
        LLAMA_LOG_ERROR("%s: SparQ: failed to rebuild the derived KV state\n", __func__);
        sparq->kt_dirty = sparq->vsum_dirty = sparq->kstat_dirty = sparq->wanted = true;
        return false;
    }

    LLAMA_LOG_DEBUG("%s: SparQ: rebuilt the derived KV state (%d nodes)\n", __func__, ggml_graph_n_nodes(gf));
    return true;
}
