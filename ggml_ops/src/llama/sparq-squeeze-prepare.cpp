// Preparing a fixed prefix for centroid-sparse attention (docs/design.md, "Prepared prefixes"):
//   1. capture: the prefix's last n_calib tokens are removed and decoded again while the graph copies each
//      layer's query rows out (the cache ends as it was; those tokens stay unclustered, read exactly);
//   2. cluster: per layer, the clustered prefix keys of every KV head are clustered by k-means on the backend
//      that holds them (sparq-squeeze-cluster.cpp);
//   3. calibrate (two levels): one coarse threshold over all layers, KV heads and calibration rows such that the
//      mean share of the clustered prefix under kept coarse clusters reaches `keep_coarse`
//      (sparq-squeeze-calibrate.cpp); the fine level needs none: each row reads its best clusters up to `keep`;
//   4. install the tables on the device (sparq-squeeze-state.cpp).
// The sidecar file is in sparq-squeeze-sidecar.cpp, the C API in sparq-squeeze-api.cpp.
#include "sparq-squeeze.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace sqp = sparq_squeeze_detail;

llama_kv_cache * sparq_squeeze_access::cache(llama_context & ctx, std::string & err) {
    llama_memory_i * mem = ctx.memory.get();
    llama_kv_cache * kv = nullptr;
    if (mem == nullptr) {
        err = "the context has no KV cache (an embedding-only or encoder context)";
    } else if (auto * plain = dynamic_cast<llama_kv_cache *>(mem)) {
        kv = plain;
    } else if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        kv = iswa->get_base(); // sliding-window layers read a bounded window: they stay dense
    } else if (auto * hyb = dynamic_cast<llama_memory_hybrid *>(mem)) {
        kv = hyb->get_mem_attn();
    } else {
        err = "this model's memory is not an attention KV cache (recurrent or a special cache)";
    }
    if (kv && kv->other) {
        err = "this KV cache shares its cells with another cache (not supported)";
        kv = nullptr;
    }
    if (kv && kv->v_trans) {
        err = "centroid-sparse attention needs flash attention's row-major V cache; create the context with flash "
              "attention on (-fa on, flash_attn=True, LLAMA_FLASH_ATTN_TYPE_ENABLED)";
        kv = nullptr;
    }
    return kv;
}

void sparq_squeeze_access::reset_graphs(llama_context & ctx) {
    ctx.sched_need_reserve = true;
    for (auto & res : ctx.gf_res_prev) {
        if (res) {
            res->reset();
        }
    }
    ctx.gf_res_prev_active = nullptr;
}

void sparq_squeeze_access::clear(llama_context & ctx) {
    std::string err;
    if (llama_kv_cache * kv = cache(ctx, err)) {
        kv->squeeze.reset();
    }
    reset_graphs(ctx);
}

// Which layers take part; the others stay dense (logged once per reason). Returns how many take part.
int sparq_squeeze_access::select_layers(llama_context & ctx, const llama_kv_cache & kv, squeeze_kv_state & st) {
    const auto & hp = ctx.model.hparams;
    st.layers.resize(kv.layers.size());
    int n_active = 0;
    std::map<std::string, std::string> dense; // reason -> layers
    for (size_t ikv = 0; ikv < kv.layers.size(); ++ikv) {
        const auto & layer = kv.layers[ikv];
        auto & L = st.layers[ikv];
        const uint32_t il = layer.il;
        L.d = hp.n_embd_head_k(il);
        L.n_head_kv = hp.n_head_kv(il);
        const ggml_type kt = layer.k->type;
        if (hp.is_swa(il)) {
            L.reason = "sliding-window layer (its read is bounded)";
        } else if (layer.v == nullptr || (kt != GGML_TYPE_F32 && kt != GGML_TYPE_F16 && kt != GGML_TYPE_BF16) || layer.v->type != kt) {
            L.reason = std::string("KV cache type ") + ggml_type_name(kt) + " (the op reads f32, f16 or bf16 caches)";
        } else if (!sqp::device_runs_op(layer.k, layer.v, L.d, hp.n_embd_head_v(il), hp.n_head(il), L.n_head_kv, st.params.levels == 2)) {
            L.reason = std::string("no ggml_centroid_attn kernel for this case on ") +
                       ggml_backend_buft_name(ggml_backend_buffer_get_type(layer.k->buffer));
        }
        if (!L.reason.empty()) {
            auto & list = dense[L.reason];
            list += (list.empty() ? "" : ",") + std::to_string(il);
            continue;
        }
        L.active = true;
        n_active++;
    }
    for (const auto & [reason, list] : dense) {
        LLAMA_LOG_INFO("%s: centroid-sparse: dense attention for layers %s: %s\n", __func__, list.c_str(), reason.c_str());
    }
    return n_active;
}

// Whether the prefix's tail [n_clustered, ...) can be removed and decoded again as it was decoded: a sliding-window
// layers' cache that keeps only its window (swa_full off) drops positions as decoding goes on, and the tail's first
// token attends to positions from before n_clustered that may be gone (decoding it again would then silently see a
// shorter window and change the prefix's K and V).
std::string sparq_squeeze_access::redecode_check(llama_context & ctx, int32_t seq_id, int32_t n_clustered) {
    auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(llama_get_memory(&ctx));
    if (iswa == nullptr) {
        return "";
    }
    const llama_hparams & hp = ctx.model.hparams;
    llama_pos p_need = n_clustered;  // the lowest position the token at n_clustered attends to in a windowed layer
    while (p_need > 0 && !llama_hparams::is_masked_swa(hp.n_swa, hp.swa_type, p_need - 1, n_clustered)) {
        --p_need;
    }
    const llama_pos p_min = iswa->get_swa()->seq_pos_min(seq_id);
    if (p_need < n_clustered && (p_min < 0 || p_min > p_need)) {
        return "the sliding-window layers' cache keeps only its window and no longer holds position " +
               std::to_string(p_need) + " (it starts at " + std::to_string(p_min) + "), which the calibration "
               "tokens from " + std::to_string(n_clustered) + " attend to: evaluate only the prefix's first " +
               std::to_string(n_clustered) + " tokens before preparing (the rest is decoded then), or make the "
               "context with a full-size sliding-window cache (swa_full, --swa-full)";
    }
    return "";
}

// Step 1: the calibration queries. The prefix's last n_prefix - n_clustered tokens are decoded (again, after their
// removal, unless only [0, n_clustered) is in the cache: tail_in_cache false) while the graph hook copies each
// layer's query rows out: q_rows[il] = [n_calib][n_head][d].
std::string sparq_squeeze_access::capture_queries(llama_context & ctx, squeeze_kv_state & st, const int32_t * tokens,
                                                  bool tail_in_cache, std::map<int32_t, std::vector<float>> & q_rows) {
    const int32_t seq_id = st.seq_id, n_prefix = st.n_prefix, n_clustered = st.n_clustered;
    st.capturing = true;
    reset_graphs(ctx);
    if (tail_in_cache && !llama_memory_seq_rm(llama_get_memory(&ctx), seq_id, n_clustered, -1)) {
        return "this model's memory cannot remove the prefix's last tokens to decode them again (recurrent "
               "layers); centroid-sparse preparation needs that";
    }
    const int32_t n_ub = (int32_t) ctx.cparams.n_ubatch;
    for (int32_t p0 = n_clustered; p0 < n_prefix; p0 += n_ub) {
        const int32_t n = std::min(n_ub, n_prefix - p0);
        llama_batch batch = llama_batch_init(n, 0, 1);
        for (int32_t i = 0; i < n; ++i) {
            batch.token[i] = tokens[p0 + i];
            batch.pos[i] = p0 + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = seq_id;
            batch.logits[i] = p0 + i == n_prefix - 1;
        }
        batch.n_tokens = n;
        st.captured_q.clear();
        reset_graphs(ctx);  // the graph hook captures while the graph is built: a reused graph would capture nothing
        const int32_t rc = llama_decode(&ctx, batch);
        llama_batch_free(batch);
        if (rc != 0) {
            return "decoding the calibration tokens failed (llama_decode returned " + std::to_string(rc) +
                   "); the cache lost positions from " + std::to_string(p0);
        }
        for (auto & [il, t] : st.captured_q) {
            auto & rows = q_rows[il];
            const size_t off = rows.size();
            rows.resize(off + ggml_nelements(t));
            ggml_backend_tensor_get(t, rows.data() + off, 0, ggml_nbytes(t));
        }
    }
    st.capturing = false;
    st.captured_q.clear();
    reset_graphs(ctx);
    return "";
}

std::string sparq_squeeze_access::prepare(llama_context & ctx, int32_t seq_id, const int32_t * tokens, int32_t n_prefix,
                                          const llama_squeeze_params & params) {
    if (const char * msg = llama_squeeze_check(&params)) {
        return msg;
    }
    if (tokens == nullptr || n_prefix < 2) {
        return "the prefix needs its tokens and at least 2 of them";
    }
    if (!ctx.cparams.causal_attn) {
        return "the context does not use causal attention (an embedding context)";
    }
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    const int32_t n_calib     = llama_squeeze_n_calib(&params, n_prefix);
    const int32_t n_clustered = n_prefix - n_calib;
    const int64_t n_cent      = std::max<int64_t>(1, std::lround((double) params.centroids*n_clustered));
    const int64_t n_coarse    = params.levels == 2 ? std::max<int64_t>(1, std::min<int64_t>(n_cent,
                                    std::lround((double) params.centroids_coarse*n_clustered))) : 0;

    auto st = std::make_shared<squeeze_kv_state>();
    st->params      = params;
    st->generation  = next_generation();
    st->seq_id      = seq_id;
    st->n_prefix    = n_prefix;
    st->n_clustered = n_clustered;
    st->tokens.assign(tokens, tokens + n_prefix);
    // the cache holds the prefix (its tail is decoded again), or only [0, n_clustered) (the tail is decoded here)
    std::vector<uint32_t> cells;
    const bool tail_in_cache = seq_id < 0 || (uint32_t) seq_id >= kv->n_seq_max ||
                               kv->v_cells[kv->seq_to_stream[seq_id]].seq_pos_max(seq_id) + 1 != n_clustered;
    err = prefix_cells(*kv, seq_id, tail_in_cache ? n_prefix : n_clustered, tail_in_cache ? n_prefix : n_clustered,
                       /*only_prefix =*/ true, st->stream, cells);
    if (err.empty() && tail_in_cache) {
        err = redecode_check(ctx, seq_id, n_clustered);
    }
    if (!err.empty()) {
        return err;
    }

    const int n_active = select_layers(ctx, *kv, *st);
    if (n_active == 0) {
        return "no layer can use centroid-sparse attention (see the log)";
    }

    auto progress = [&](float f) {
        return params.progress_callback == nullptr || params.progress_callback(f, params.progress_callback_user_data);
    };
    auto fail = [&](const std::string & why) {
        kv->squeeze.reset();
        reset_graphs(ctx);
        return why;
    };

    // phase_us: microseconds spent in capture, clustering, calibration and install (logged below)
    int64_t phase_us[4] = { 0, 0, 0, 0 };
    int64_t t_us = ggml_time_us();
    auto phase_done = [&](int phase) {
        const int64_t now = ggml_time_us();
        phase_us[phase] = now - t_us;
        t_us = now;
    };

    kv->squeeze = st; // the graph hook captures the queries through it
    err = capture_queries(ctx, *st, tokens, tail_in_cache, st->calib_q);
    phase_done(0);
    if (!err.empty()) {
        return fail(err);
    }
    st->calib_scale = std::move(st->captured_scale);
    st->captured_scale.clear();
    for (size_t ikv = 0; ikv < kv->layers.size(); ++ikv) {  // keep the active layers' queries only
        if (!st->layers[ikv].active) {
            st->calib_q.erase((int32_t) kv->layers[ikv].il);
            st->calib_scale.erase((int32_t) kv->layers[ikv].il);
        }
    }
    if (!progress(0.05f)) {
        return fail("cancelled");
    }
    err = cluster_layers(ctx, *kv, *st, n_cent, n_coarse, n_active, progress);
    phase_done(1);
    if (err.empty()) {
        err = calibrate_layers(ctx, *kv, *st);
        phase_done(2);
    }
    if (err.empty()) {
        err = install(*kv, *st);
        phase_done(3);
    }
    if (!err.empty()) {
        return fail(err);
    }
    reset_graphs(ctx);
    progress(1.0f);
    LLAMA_LOG_INFO("%s: centroid-sparse prefix of sequence %d: %d tokens (%d clustered into %lld clusters per KV head%s, "
                   "%d calibration tokens, %s seeds), %d layers, keep %.3g, var_weight %g%s\n", __func__,
            seq_id, n_prefix, n_clustered, (long long) n_cent, n_coarse ? (", " + std::to_string(n_coarse) + " coarse").c_str() : "",
            n_calib, st->params.init == LLAMA_SQUEEZE_INIT_KPP ? "k-means++" : "even", n_active, (double) st->params.keep,
            (double) st->params.var_weight,
            n_coarse ? (", coarse T = " + std::to_string(st->threshold_coarse) + ", under kept coarse clusters on the "
                        "calibration queries " + std::to_string(100.0*st->kept_calib) + "%").c_str() : "");
    LLAMA_LOG_INFO("%s: centroid-sparse preparation phases: capture %.2f s, clustering %.2f s, calibration %.2f s "
                   "(%d threads), install %.2f s\n", __func__, 1e-6*(double) phase_us[0], 1e-6*(double) phase_us[1],
            1e-6*(double) phase_us[2], (int) ctx.cparams.n_threads_batch, 1e-6*(double) phase_us[3]);
    return "";
}
