// SparQ's derived KV state, kept by llama_kv_cache (member functions declared by vendor/patches/0003):
//   K^T  per layer [kv_size, n_embd_k_gqa, n_stream]: one row of cells per key component, so the
//        approximate-score pass reads k1 contiguous rows (docs/design.md, "Derived KV state");
//   vsum per layer [(d_v + 1) * n_head_kv, n_seq_max] f32: per sequence and KV head, the sum of V over the
//        sequence's cells and their count (the mean value of step 5 without reading V).
// Graphs write both next to cpy_k/cpy_v (sparq-llama-graph.cpp). Whatever changes K or the cells outside a
// graph (K-shift, seq_rm/cp/keep/add, clear, state load, stream copy) marks them stale, and update(),
// which runs before every decode, rebuilds them from K, V and the cells on the device that holds them.
#include "sparq-llama-internal.h"
#include "sparq-squeeze.h"

#include "llama-arch.h"
#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <map>
#include <string>

static bool sparq_kv_type_ok(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
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
                /*.mem_size   =*/ 2u*layers.size()*ggml_tensor_overhead(),
                /*.mem_buffer =*/ nullptr,
                /*.no_alloc   =*/ true,
            };
            ctx.reset(ggml_init(ip));
            GGML_ASSERT(ctx && "sparq: failed to create a ggml context");
        }
        return ctx.get();
    };

    const uint32_t kv_size = get_size();

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
        } else if (!sparq_kv_type_ok(layer.k->type) || layer.v == nullptr || !sparq_kv_type_ok(layer.v->type)) {
            L.reason = std::string("KV cache type ") + ggml_type_name(layer.k->type) +
                       " (the op reads f32, f16 or bf16 caches)";
        } else if (params.k1 > 0 && (uint32_t) params.k1 > hparams.n_embd_head_k(il)) {
            L.reason = "k1 exceeds this layer's head dim";
        }
        if (!L.reason.empty()) {
            auto & list = dense_layers[L.reason];
            list += (list.empty() ? "" : ",") + std::to_string(il);
            continue;
        }

        L.active  = true;
        L.mean_on = params.mean == LLAMA_SPARQ_MEAN_ON ||
                    (params.mean == LLAMA_SPARQ_MEAN_AUTO && hparams.n_head(il) == hparams.n_head_kv(il));

        ggml_context * ctx = ctx_for(ggml_backend_buffer_get_type(layer.k->buffer));
        if (!params.default_layout) {
            L.kt = ggml_new_tensor_3d(ctx, layer.k->type, kv_size, hparams.n_embd_k_gqa(il), n_stream);
            ggml_format_name(L.kt, "sparq_kt_l%u", il);
        }
        // sliding-window layers hide part of the sequence, so a per-sequence sum is not their mean: the op
        // then averages the visible V itself (a bounded read)
        if (L.mean_on && !swa) {
            L.vsum = ggml_new_tensor_2d(ctx, GGML_TYPE_F32,
                    (int64_t) (hparams.n_embd_head_v(il) + 1)*hparams.n_head_kv(il), n_seq_max);
            ggml_format_name(L.vsum, "sparq_vsum_l%u", il);
        }
    }

    for (const auto & [reason, list] : dense_layers) {
        LLAMA_LOG_INFO("%s: SparQ: dense attention for layers %s: %s\n", __func__, list.c_str(), reason.c_str());
    }

    for (auto & [buft, ctx] : ctx_map) {
        if (ggml_get_first_tensor(ctx.get()) == nullptr) {
            continue; // only layers without K^T and V sums on this buffer type
        }
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        if (buf == nullptr) {
            err = std::string("SparQ: failed to allocate the derived KV state in ") + ggml_backend_buft_name(buft);
            return false;
        }
        ggml_backend_buffer_clear(buf, 0);
        LLAMA_LOG_INFO("%s: %10s SparQ K^T + V-sum buffer size = %8.2f MiB\n", __func__,
                ggml_backend_buffer_name(buf), ggml_backend_buffer_get_size(buf)/1024.0/1024.0);
        st->ctxs_bufs.emplace_back(std::move(ctx), ggml_backend_buffer_ptr(buf));
    }

    st->kt_dirty   = st->has_kt();
    st->vsum_dirty = st->has_vsum();
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
    sparq->kt_dirty   = sparq->kt_dirty   || (kt   && sparq->has_kt());
    sparq->vsum_dirty = sparq->vsum_dirty || (vsum && sparq->has_vsum());
}

// seq_rm: only a removal that touches some sequence's cells changes the V sums (llama-cpp-python calls
// seq_rm(-1, n_past, -1) before every eval, which usually removes nothing)
void llama_kv_cache::sparq_invalidate_range(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (squeeze) {
        squeeze->check = true;
    }
    if (!sparq || sparq->vsum_dirty || !sparq->has_vsum()) {
        return;
    }
    for (llama_seq_id s = 0; s < (llama_seq_id) n_seq_max; ++s) {
        if (seq_id >= 0 && s != seq_id) {
            continue;
        }
        const auto & cells = v_cells[seq_to_stream[s]];
        const llama_pos lo = cells.seq_pos_min(s);
        const llama_pos hi = cells.seq_pos_max(s);
        if (lo >= 0 && hi >= p0 && lo < p1) {
            sparq->vsum_dirty = true;
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

bool llama_kv_cache::sparq_pending() const {
    return (sparq && (sparq->kt_dirty || sparq->vsum_dirty)) || (squeeze && squeeze->check);
}

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
        ret[ggml_backend_buffer_get_type(buf.get())] += ggml_backend_buffer_get_size(buf.get());
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
    const uint64_t kv_size   = get_size();
    const uint64_t head_dim  = hparams.n_embd_head_k(il);
    const uint64_t n_embd    = kt->ne[1];
    const uint32_t ns        = sinfo.s1 - sinfo.s0 + 1;

    // [n_kv, head_dim, n_head_kv, ns]: the layout ggml_sparq_attn takes as kt
    return ggml_view_4d(ctx, kt,
            n_kv, head_dim, hparams.n_head_kv(il), ns,
            ggml_row_size(kt->type, kv_size),
            ggml_row_size(kt->type, kv_size*head_dim),
            ggml_row_size(kt->type, kv_size*n_embd),
            ggml_row_size(kt->type, kv_size*n_embd)*sinfo.s0);
}

// Element-wise scatter of k_cur [head_dim, n_head_kv, n_tokens] into K^T; kt_idxs holds, for token t and
// component j, the flat index ((stream*n_embd_k_gqa + j)*kv_size + cell) (the transposed-V recipe).
ggml_tensor * llama_kv_cache::sparq_cpy_kt(ggml_context * ctx, ggml_tensor * k_cur, ggml_tensor * kt_idxs, int32_t il) const {
    const sparq_kv_layer * L = sparq_layer(il);
    GGML_ASSERT(L && L->kt);

    if (!ggml_is_contiguous(k_cur)) {
        k_cur = ggml_cont(ctx, k_cur);
    }
    ggml_tensor * src = ggml_reshape_2d(ctx, k_cur, 1, ggml_nelements(k_cur));
    ggml_tensor * dst = ggml_reshape_2d(ctx, L->kt, 1, ggml_nelements(L->kt));
    GGML_ASSERT(kt_idxs->ne[0] == ggml_nelements(k_cur));

    return ggml_set_rows(ctx, dst, src, kt_idxs);
}

//
// rebuild
//

namespace {

// One-hot cell -> sequence matrices per stream, [n_used, n_seq_max] f32, filled from the cells.
class sparq_rebuild_input : public llm_graph_input_i {
public:
    struct entry {
        const llama_kv_cells * cells;
        ggml_tensor * onehot;
    };
    std::vector<entry> entries;
    uint32_t n_seq_max = 0;

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        for (const auto & e : entries) {
            GGML_ASSERT(ggml_backend_buffer_is_host(e.onehot->buffer));
            float * data = (float *) e.onehot->data;
            const int64_t n_used = e.onehot->ne[0];
            for (uint32_t s = 0; s < n_seq_max; ++s) {
                for (int64_t c = 0; c < n_used; ++c) {
                    data[s*n_used + c] = e.cells->seq_has(c, s) ? 1.0f : 0.0f;
                }
            }
        }
    }
};

} // namespace

bool llama_kv_cache::sparq_update(llama_context * lctx) {
    sparq_squeeze_access::verify(*this); // host only: whether the prepared prefix's cells still hold it
    if (!sparq || !(sparq->kt_dirty || sparq->vsum_dirty)) {
        return false;
    }

    auto * sched = lctx->get_sched();
    ggml_backend_sched_reset(sched);

    auto * res = lctx->get_gf_res_reserve();
    res->reset();

    ggml_context * ctx = res->get_ctx();
    ggml_cgraph  * gf  = res->get_gf();

    auto inp = std::make_unique<sparq_rebuild_input>();
    inp->n_seq_max = n_seq_max;

    const uint32_t kv_size = get_size();
    std::vector<uint32_t> n_used(n_stream);
    for (uint32_t s = 0; s < n_stream; ++s) {
        n_used[s] = v_cells[s].used_max_p1();
    }

    std::vector<ggml_tensor *> onehot(n_stream, nullptr);
    if (sparq->vsum_dirty) {
        for (uint32_t s = 0; s < n_stream; ++s) {
            if (n_used[s] == 0) {
                continue;
            }
            onehot[s] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_used[s], n_seq_max);
            ggml_set_input(onehot[s]);
            inp->entries.push_back({ &v_cells[s], onehot[s] });
        }
    }

    int n_work = 0;
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const auto & layer = layers[ikv];
        const auto & L     = sparq->layers[ikv];
        const uint32_t il  = layer.il;

        if (sparq->kt_dirty && L.kt) {
            const int64_t n_embd = layer.k->ne[0];
            for (uint32_t s = 0; s < n_stream; ++s) {
                if (n_used[s] == 0) {
                    continue;
                }
                ggml_tensor * k_s = ggml_view_2d(ctx, layer.k, n_embd, n_used[s], layer.k->nb[1],
                        ggml_row_size(layer.k->type, n_embd*kv_size)*s);
                ggml_tensor * kt_s = ggml_view_2d(ctx, L.kt, n_used[s], n_embd, L.kt->nb[1],
                        ggml_row_size(L.kt->type, kv_size*n_embd)*s);
                ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, k_s), kt_s));
                n_work++;
            }
        }

        if (sparq->vsum_dirty && L.vsum) {
            const int64_t d_v = hparams.n_embd_head_v(il);
            const int64_t h   = hparams.n_head_kv(il);
            ggml_tensor * acc = nullptr;
            for (uint32_t s = 0; s < n_stream; ++s) {
                if (onehot[s] == nullptr) {
                    continue;
                }
                ggml_tensor * v_s = ggml_view_2d(ctx, layer.v, d_v*h, n_used[s], layer.v->nb[1],
                        layer.v->nb[1]*kv_size*s);
                ggml_tensor * v_t  = ggml_cont(ctx, ggml_transpose(ctx, v_s));          // [n_used, d_v*h]
                ggml_tensor * sums = ggml_mul_mat(ctx, v_t, onehot[s]);                  // [d_v*h, n_seq]
                ggml_tensor * cnt  = ggml_sum_rows(ctx, onehot[s]);                      // [1, n_seq]
                cnt = ggml_repeat_4d(ctx, ggml_reshape_3d(ctx, cnt, 1, 1, n_seq_max), 1, h, n_seq_max, 1);
                ggml_tensor * aug = ggml_concat(ctx, ggml_reshape_3d(ctx, sums, d_v, h, n_seq_max), cnt, 0);
                acc = acc ? ggml_add(ctx, acc, aug) : aug;
            }
            if (acc == nullptr) {
                ggml_backend_tensor_memset(L.vsum, 0, 0, ggml_nbytes(L.vsum)); // no cells: all sums are 0
            } else {
                ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_reshape_2d(ctx, acc, L.vsum->ne[0], n_seq_max), L.vsum));
                n_work++;
            }
        }
    }

    sparq->kt_dirty   = false;
    sparq->vsum_dirty = false;

    if (n_work == 0) {
        return false;
    }

    res->add_input(std::move(inp));

    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        LLAMA_LOG_ERROR("%s: SparQ: failed to allocate the graph that rebuilds the derived KV state\n", __func__);
        sparq->kt_dirty = sparq->vsum_dirty = true;
        return false;
    }

    res->set_inputs(nullptr);

    if (lctx->graph_compute(gf, false) != GGML_STATUS_SUCCESS) {
        LLAMA_LOG_ERROR("%s: SparQ: failed to rebuild the derived KV state\n", __func__);
        sparq->kt_dirty = sparq->vsum_dirty = true;
        return false;
    }

    LLAMA_LOG_DEBUG("%s: SparQ: rebuilt the derived KV state (%d nodes)\n", __func__, ggml_graph_n_nodes(gf));
    return true;
}
