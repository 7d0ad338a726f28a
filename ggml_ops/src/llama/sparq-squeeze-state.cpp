// A prepared prefix for centroid-sparse attention, on llama.cpp's KV cache side:
//   - which cells hold the prefix, and whether they still do (every cache change outside a graph marks the
//     state for a check before the next graph; a changed clustered cell drops it);
//   - the device tables graphs read: per layer the centroid table [width, n_cent, n_head_kv, n_stream] and the
//     cell -> cluster map [kv_size, n_head_kv, n_stream] (-1 outside the clustered prefix), both built from the
//     host copies (so preparing and loading a sidecar install the same thing);
//   - mirror streams (one stream per sequence): a cross-stream seq_cp copies a whole stream's buffers, cell for
//     cell, so a copy of the prefix's stream holds the prefix's keys in the same cells and gets the same slices;
//   - the graph side: ggml_centroid_attn over the cache view (squeeze_build_attn).
#include "sparq-squeeze.h"

#include "ggml-centroid.h"

#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace sparq_squeeze_detail {

// Graphs built with a prepared prefix are reused only while that same state lives.
class squeeze_graph_input : public llm_graph_input_i {
public:
    squeeze_graph_input(const llama_kv_cache * kv, uint64_t generation) : kv(kv), generation(generation) {}

    const llama_kv_cache * kv;
    const uint64_t generation;

    void set_input(const llama_ubatch * ubatch) override { GGML_UNUSED(ubatch); }

    bool can_reuse(const llm_graph_params & params) override {
        GGML_UNUSED(params);
        return kv->squeeze && kv->squeeze->ready && kv->squeeze->generation == generation;
    }
};

static bool is_mirror(const squeeze_kv_state & st, uint32_t stream) {
    return std::find(st.mirrors.begin(), st.mirrors.end(), stream) != st.mirrors.end();
}

// Stream `stream`'s slice of each active layer's tables: the prefix's (fill), or empty (no cluster has members, no
// cell is clustered: that stream is read densely).
static void set_stream_tables(const squeeze_kv_state & st, uint32_t kv_size, uint32_t stream, bool fill) {
    const int64_t n_clustered = st.n_clustered;
    for (const auto & L : st.layers) {
        if (!L.active) {
            continue;
        }
        const size_t cent_stream = L.cent->nb[3];
        const size_t cell_stream = L.cell->nb[2];
        if (!fill) {
            ggml_backend_tensor_memset(L.cent, 0, cent_stream*stream, cent_stream);
            ggml_backend_tensor_memset(L.cell, 0xFF, cell_stream*stream, cell_stream);  // -1
            if (L.coarse) {
                ggml_backend_tensor_memset(L.coarse, 0, L.coarse->nb[3]*stream, L.coarse->nb[3]);
                ggml_backend_tensor_memset(L.par, 0, L.par->nb[2]*stream, L.par->nb[2]);
            }
            continue;
        }
        GGML_ASSERT(L.table.size()*sizeof(float) == cent_stream);
        ggml_backend_tensor_set(L.cent, L.table.data(), cent_stream*stream, cent_stream);
        // the map is -1 except at the clustered cells
        std::vector<int32_t> map((size_t) kv_size*L.n_head_kv, -1);
        for (int64_t h = 0; h < L.n_head_kv; ++h) {
            int32_t * row = map.data() + (size_t) h*kv_size;
            for (int64_t p = 0; p < n_clustered; ++p) {
                row[st.cells[p]] = L.assign[h*n_clustered + p];
            }
        }
        GGML_ASSERT(map.size()*sizeof(int32_t) == cell_stream);
        ggml_backend_tensor_set(L.cell, map.data(), cell_stream*stream, cell_stream);
        if (L.coarse) {
            ggml_backend_tensor_set(L.coarse, L.coarse_table.data(), L.coarse->nb[3]*stream, L.coarse->nb[3]);
            ggml_backend_tensor_set(L.par, L.parent.data(), L.par->nb[2]*stream, L.par->nb[2]);
        }
    }
}

static void ensure_graph_input(llm_graph_result * res, const llama_kv_cache * kv, uint64_t generation) {
    for (auto & inp : res->inputs) {
        if (auto * s = dynamic_cast<squeeze_graph_input *>(inp.get())) {
            if (s->kv == kv) {
                return;
            }
        }
    }
    res->add_input(std::make_unique<squeeze_graph_input>(kv, generation));
}

}  // namespace sparq_squeeze_detail

namespace sqd = sparq_squeeze_detail;

uint64_t sparq_squeeze_access::next_generation() {
    static std::atomic<uint64_t> counter{0};
    return ++counter;
}

std::string sparq_squeeze_access::prefix_cells(const llama_kv_cache & kv, int32_t seq_id, int32_t n_prefix,
                                               int32_t n_need, bool only_prefix, uint32_t & stream,
                                               std::vector<uint32_t> & cells) {
    if (seq_id < 0 || (uint32_t) seq_id >= kv.n_seq_max) {
        return "seq_id " + std::to_string(seq_id) + " is outside [0, " + std::to_string(kv.n_seq_max) + ")";
    }
    stream = kv.seq_to_stream[seq_id];
    const auto & lcells = kv.v_cells[stream];
    const llama_pos pos_max = lcells.seq_pos_max(seq_id);
    if (pos_max + 1 < n_prefix) {
        return "the cache holds positions up to " + std::to_string(pos_max) + " of sequence " + std::to_string(seq_id) +
               ", fewer than the prefix's " + std::to_string(n_prefix) + " tokens: evaluate the prefix first";
    }
    if (only_prefix && pos_max + 1 > n_prefix) {
        return "sequence " + std::to_string(seq_id) + " holds positions after the prefix (up to " + std::to_string(pos_max) +
               "): prepare right after evaluating the prefix, or remove the rest first";
    }
    cells.assign(n_need, UINT32_MAX);
    for (const auto & [pos, cell] : lcells.seq_pos_get(seq_id)) {
        if (pos >= n_need) {
            break;
        }
        if (pos < 0 || cells[pos] != UINT32_MAX) {
            return "position " + std::to_string(pos) + " of sequence " + std::to_string(seq_id) +
                   " is held by more than one cell (multi-position models cannot be prepared)";
        }
        cells[pos] = cell;
    }
    for (int32_t p = 0; p < n_need; ++p) {
        if (cells[p] == UINT32_MAX) {
            return "position " + std::to_string(p) + " of sequence " + std::to_string(seq_id) + " is not in the cache";
        }
    }
    return "";
}

void sparq_squeeze_access::drop(llama_kv_cache & kv, const char * why) {
    if (kv.squeeze && kv.squeeze->ready) {
        LLAMA_LOG_INFO("%s: centroid-sparse prefix of sequence %d dropped: %s\n", __func__, kv.squeeze->seq_id, why);
    }
    kv.squeeze.reset();
}

bool sparq_squeeze_access::holds_prefix(const llama_kv_cache & kv, const squeeze_kv_state & st, uint32_t stream) {
    const auto & lcells = kv.v_cells[stream];
    for (size_t p = 0; p < st.cells.size(); ++p) {
        const uint32_t c = st.cells[p];
        if (c >= lcells.size() || lcells.is_empty(c) || lcells.pos_get(c) != (llama_pos) p) {
            return false;
        }
    }
    return true;
}

void sparq_squeeze_access::verify(llama_kv_cache & kv) {
    squeeze_kv_state * st = kv.squeeze.get();
    if (st == nullptr || !st->check) {
        return;
    }
    st->check = false;
    if (!st->ready) {
        return;
    }
    // Any sequence may hold the prefix's cells (the one it was prepared in, or others that share them through
    // seq_cp within the stream: the op reads them through each row's mask). It stays valid while every clustered
    // cell is held by some sequence at its position. This runs before the next ubatch is placed, so a cell that
    // was freed cannot have been reused yet. The same holds for each mirror stream, which alone is ended.
    if (!holds_prefix(kv, *st, st->stream)) {
        drop(kv, "its cells changed (a removal by every sequence that held them, or a shift, inside the clustered prefix)");
        return;
    }
    const std::vector<uint32_t> mirrors = st->mirrors;
    for (const uint32_t m : mirrors) {
        if (!holds_prefix(kv, *st, m)) {
            end_mirror(kv, m, "its cells changed (a removal or a shift inside the clustered prefix)");
        }
    }
}

uint32_t sparq_squeeze_access::prefix_stream_of(const llama_kv_cache & kv, int32_t seq_id) {
    const squeeze_kv_state * st = kv.squeeze.get();
    if (st == nullptr || !st->ready || seq_id < 0 || (uint32_t) seq_id >= kv.n_seq_max) {
        return UINT32_MAX;
    }
    const uint32_t stream = kv.seq_to_stream[seq_id];
    return stream == st->stream || sqd::is_mirror(*st, stream) ? stream : UINT32_MAX;
}

bool sparq_squeeze_access::sole_holder(const llama_kv_cache & kv, int32_t seq_id) {
    const uint32_t stream = prefix_stream_of(kv, seq_id);
    if (stream == UINT32_MAX) {
        return false;
    }
    const squeeze_kv_state * st = kv.squeeze.get();
    const auto & lcells = kv.v_cells[stream];
    for (const uint32_t c : st->cells) {
        if (c < lcells.size() && lcells.seq_has(c, seq_id) && lcells.seq_count(c) == 1) {
            return true;
        }
    }
    return false;
}

bool sparq_squeeze_access::seq_sparse(const llama_kv_cache & kv, int32_t seq_id) {
    const uint32_t stream = prefix_stream_of(kv, seq_id);
    if (stream == UINT32_MAX) {
        return false;
    }
    const squeeze_kv_state * st = kv.squeeze.get();
    const auto & lcells = kv.v_cells[stream];
    for (size_t p = 0; p < st->cells.size(); ++p) {
        const uint32_t c = st->cells[p];
        if (c >= lcells.size() || !lcells.seq_has(c, seq_id) || lcells.pos_get(c) != (llama_pos) p) {
            return false;
        }
    }
    return true;
}

void sparq_squeeze_access::stream_copied(llama_kv_cache & kv, uint32_t s_src, uint32_t s_dst) {
    verify(kv);  // the source's standing first (seq_cp marked the state for a check before it changed the cells)
    squeeze_kv_state * st = kv.squeeze.get();
    if (st == nullptr || !st->ready || s_dst == st->stream) {
        return;  // a copy into the prefix's own stream has dropped it (sparq_invalidate)
    }
    // The buffers are copied whole, cell for cell, at the next update: s_dst holds the prefix's keys in the prefix's
    // cells when the source stream did and the copied sequence held every clustered cell there.
    const bool from_prefix = s_src == st->stream || sqd::is_mirror(*st, s_src);
    if (from_prefix && holds_prefix(kv, *st, s_dst)) {
        if (!sqd::is_mirror(*st, s_dst)) {
            sqd::set_stream_tables(*st, kv.get_size(), s_dst, true);
            st->mirrors.push_back(s_dst);
            LLAMA_LOG_INFO("%s: stream %u holds a copy of the centroid-sparse prefix of sequence %d: read sparsely there too\n",
                    __func__, s_dst, st->seq_id);
        }
    } else if (sqd::is_mirror(*st, s_dst)) {
        end_mirror(kv, s_dst, "another stream's contents were copied into it");
    }
}

void sparq_squeeze_access::end_mirror(llama_kv_cache & kv, uint32_t stream, const char * why) {
    squeeze_kv_state * st = kv.squeeze.get();
    if (st == nullptr || !sqd::is_mirror(*st, stream)) {
        return;
    }
    st->mirrors.erase(std::find(st->mirrors.begin(), st->mirrors.end(), stream));
    sqd::set_stream_tables(*st, kv.get_size(), stream, false);
    LLAMA_LOG_INFO("%s: stream %u no longer reads the centroid-sparse prefix of sequence %d sparsely: %s\n", __func__,
            stream, st->seq_id, why);
}

std::string sparq_squeeze_access::install(llama_kv_cache & kv, squeeze_kv_state & st) {
    const uint32_t kv_size = kv.get_size();
    const int64_t  ns      = kv.n_stream;
    std::map<ggml_backend_buffer_type_t, ggml_context_ptr> ctx_map;
    for (size_t ikv = 0; ikv < kv.layers.size(); ++ikv) {
        auto & L = st.layers[ikv];
        if (!L.active) {
            continue;
        }
        const auto & layer = kv.layers[ikv];
        auto & ctx = ctx_map[ggml_backend_buffer_get_type(layer.k->buffer)];
        if (!ctx) {
            ggml_init_params ip = { 4u*kv.layers.size()*ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
            ctx.reset(ggml_init(ip));
        }
        L.cent = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, L.width, L.n_cent, L.n_head_kv, ns);
        L.cell = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_I32, kv_size, L.n_head_kv, ns);
        ggml_format_name(L.cent, "squeeze_cent_l%u", layer.il);
        ggml_format_name(L.cell, "squeeze_cell_l%u", layer.il);
        if (L.n_coarse > 0) {
            L.coarse = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, L.width, L.n_coarse, L.n_head_kv, ns);
            L.par    = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_I32, L.n_cent, L.n_head_kv, ns);
        }
    }
    for (auto & [buft, ctx] : ctx_map) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        if (buf == nullptr) {
            return std::string("failed to allocate the centroid tables in ") + ggml_backend_buft_name(buft);
        }
        ggml_backend_buffer_clear(buf, 0);
        LLAMA_LOG_INFO("%s: %10s centroid-sparse tables = %8.2f MiB\n", __func__, ggml_backend_buffer_name(buf),
                ggml_backend_buffer_get_size(buf)/1024.0/1024.0);
        st.ctxs_bufs.emplace_back(std::move(ctx), ggml_backend_buffer_ptr(buf));
    }
    // every stream but the prefix's: no cluster has members and no cell is clustered (dense there)
    for (uint32_t s = 0; s < (uint32_t) ns; ++s) {
        sqd::set_stream_tables(st, kv_size, s, s == st.stream);
    }
    st.mirrors.clear();
    st.ready = true;
    return "";
}

//
// the graph side
//

ggml_tensor * squeeze_build_attn(ggml_context * ctx0, llm_graph_result * res, const llama_kv_cache_context * mctx,
                                 ggml_tensor * q, ggml_tensor * kq_mask, float kq_scale, float softcap, int il,
                                 bool unsupported_inputs, bool decode) {
    const llama_kv_cache * kv = mctx->get_kv();
    squeeze_kv_state * st = kv->squeeze.get();
    if (st == nullptr) {
        return nullptr;
    }
    if (st->capturing) {
        // the calibration queries: copied out, kept by the scheduler until read after the decode
        ggml_tensor * qc = ggml_cont(ctx0, q);
        ggml_format_name(qc, "squeeze_calib_q-%d", il);
        ggml_set_output(qc);
        ggml_build_forward_expand(res->get_gf(), qc);
        st->captured_q[il]     = qc;
        st->captured_scale[il] = kq_scale;
        return nullptr;
    }
    if (!st->ready) {
        return nullptr;
    }
    const squeeze_kv_layer * L = sparq_squeeze_access::layer(*kv, il);
    if (L == nullptr || !L->active) {
        return nullptr;
    }
    sqd::ensure_graph_input(res, kv, st->generation);
    auto fallback = [&](const char * why) -> ggml_tensor * {
        if (!L->logged) {
            L->logged = true;
            LLAMA_LOG_INFO("%s: centroid-sparse: dense attention for layer %d: %s\n", __func__, il, why);
        }
        return nullptr;
    };
    if (unsupported_inputs) {
        return fallback("KQ bias, attention-sink tensors or MLA");
    }

    const auto & sinfo = mctx->get_sinfo();
    const int64_t n_kv = mctx->get_n_kv();
    ggml_tensor * k = mctx->get_k(ctx0, il);
    ggml_tensor * v = mctx->get_v(ctx0, il);
    if (!decode) {
        // a prefill: dense attention when asked, or by default where the KV is not in host memory (a GPU)
        // (k is a view built in the graph's context: its buffer is set only at allocation; its source's is the cache's)
        const ggml_tensor * cache_k = k->view_src ? k->view_src : k;
        const bool host = cache_k->buffer == nullptr || ggml_backend_buffer_is_host(cache_k->buffer);
        if (st->prefill == LLAMA_SQUEEZE_PREFILL_DENSE || (st->prefill == LLAMA_SQUEEZE_PREFILL_AUTO && !host)) {
            return nullptr;
        }
    }
    const int64_t ns = k->ne[3];
    const int64_t n_tokens = q->ne[2];

    // views of the tables for the ubatch's streams [s0, s0 + ns)
    ggml_tensor * cent = ggml_view_4d(ctx0, L->cent, L->cent->ne[0], L->cent->ne[1], L->cent->ne[2], ns,
            L->cent->nb[1], L->cent->nb[2], L->cent->nb[3], L->cent->nb[3]*sinfo.s0);
    ggml_tensor * cell = ggml_view_3d(ctx0, L->cell, n_kv, L->cell->ne[1], ns,
            L->cell->nb[1], L->cell->nb[2], L->cell->nb[2]*sinfo.s0);
    ggml_tensor * coarse = nullptr;
    ggml_tensor * parent = nullptr;
    if (L->coarse) {
        coarse = ggml_view_4d(ctx0, L->coarse, L->coarse->ne[0], L->coarse->ne[1], L->coarse->ne[2], ns,
                L->coarse->nb[1], L->coarse->nb[2], L->coarse->nb[3], L->coarse->nb[3]*sinfo.s0);
        parent = ggml_view_3d(ctx0, L->par, L->par->ne[0], L->par->ne[1], ns,
                L->par->nb[1], L->par->nb[2], L->par->nb[2]*sinfo.s0);
    }

    // the shapes flash attention takes (as build_attn_mha prepares them)
    ggml_tensor * qv = ggml_view_4d(ctx0, q, q->ne[0], q->ne[1], n_tokens/ns, ns, q->nb[1], q->nb[2], q->nb[2]*(n_tokens/ns), 0);
    qv = ggml_permute(ctx0, qv, 0, 2, 1, 3);
    k  = ggml_permute(ctx0, k, 0, 2, 1, 3);
    v  = ggml_permute(ctx0, v, 0, 2, 1, 3);

    ggml_centroid_params op = ggml_centroid_default_params();
    op.keep             = st->params.keep;
    op.threshold_coarse = st->threshold_coarse;
    op.group            = (ggml_centroid_group) st->params.group;
    op.scale            = kq_scale;
    op.softcap          = softcap;
    op.var_weight       = st->params.var_weight;
    if (const char * err = ggml_centroid_attn_check(qv, k, v, kq_mask, cent, cell, coarse, parent, &op)) {
        return fallback(err);
    }
    ggml_tensor * cur = ggml_centroid_attn(ctx0, qv, k, v, kq_mask, cent, cell, coarse, parent, op);
    ggml_format_name(cur, "squeeze_attn-%d", il);
    cur = ggml_reshape_2d(ctx0, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
    ggml_build_forward_expand(res->get_gf(), cur);
    return cur;
}

const squeeze_kv_layer * sparq_squeeze_access::layer(const llama_kv_cache & kv, int32_t il) {
    if (!kv.squeeze) {
        return nullptr;
    }
    const auto it = kv.map_layer_ids.find(il);
    return it == kv.map_layer_ids.end() ? nullptr : &kv.squeeze->layers[it->second];
}
