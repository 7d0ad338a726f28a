// SparQ settings of a llama_context: the C API (sparq-llama.h) and llama_context::set_sparq.
#include "sparq-llama-internal.h"
#include "sparq-llama-testing.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-model.h"

#include <cmath>
#include <cstring>
#include <cstdio>
#include <string>
#include <vector>

static thread_local std::string g_sparq_error;

// The caches whose layers SparQ may decode. SWA caches only when the user includes SWA layers.
// Returns false with err set when the context's memory has no attention KV cache.
static bool sparq_caches(llama_memory_i * mem, bool with_swa, std::vector<llama_kv_cache *> & out, std::string & err) {
    out.clear();
    if (mem == nullptr) {
        err = "the context has no KV cache (an embedding-only or encoder context)";
        return false;
    }
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        out.push_back(kv);
    } else if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        out.push_back(iswa->get_base());
        if (with_swa) {
            out.push_back(iswa->get_swa());
        }
    } else if (auto * hyb = dynamic_cast<llama_memory_hybrid *>(mem)) {
        out.push_back(hyb->get_mem_attn());
    } else {
        err = "this model's memory is not a plain attention KV cache (recurrent or a special cache), SparQ cannot decode it";
        return false;
    }
    return true;
}

int32_t llama_context::set_sparq(const llama_sparq_params & params, std::string & err) {
    if (const char * msg = llama_sparq_check(this, &params)) {
        err = msg;
        return -1;
    }

    // every cache loses its derived state first; enabling rebuilds it for the caches that take part
    std::vector<llama_kv_cache *> all;
    std::string ignored;
    if (sparq_caches(memory.get(), true, all, ignored)) {
        for (auto * kv : all) {
            kv->sparq_disable();
        }
    }

    if (params.enabled) {
        std::vector<llama_kv_cache *> caches;
        if (!sparq_caches(memory.get(), params.swa, caches, err)) {
            cparams.sparq.enabled = false;
            return -1;
        }
        if (!params.swa && dynamic_cast<llama_kv_cache_iswa *>(memory.get()) != nullptr) {
            LLAMA_LOG_INFO("%s: SparQ: sliding-window layers stay dense (their read is bounded; --sparq-swa includes them)\n", __func__);
        }
        for (auto * kv : caches) {
            if (!kv->sparq_enable(params, err)) {
                for (auto * other : caches) {
                    other->sparq_disable();
                }
                cparams.sparq.enabled = false;
                return -1;
            }
        }
        char dense_below[128];
        if (params.min_n_kv < 0) {
            snprintf(dense_below, sizeof(dense_below), "%d (CPU) / %d (GPU, MHA) / %d (GPU, GQA) (measured defaults)",
                     SPARQ_DEFAULT_MIN_N_KV, SPARQ_DEFAULT_MIN_N_KV_GPU_MHA, SPARQ_DEFAULT_MIN_N_KV_GPU_GQA);
        } else {
            snprintf(dense_below, sizeof(dense_below), "%d", params.min_n_kv);
        }
        const bool q4 = params.index == LLAMA_SPARQ_INDEX_Q4;
        const std::string k1_share = params.k1 == 0 ? std::string(" (") + sparq_k1_auto_name(params.index) + ")" : "";
        LLAMA_LOG_INFO("%s: SparQ on: k1 = %d%s, k2 = %d, window = %d, sinks = %d, policy = %s, layout = %s, "
                       "index = %s, select = %s, dense below n_kv = %s (the derived state kept from there on)\n", __func__,
                params.k1, k1_share.c_str(), params.k2,
                sparq_window(params), params.sinks,
                params.policy == LLAMA_SPARQ_POLICY_EXACT ? "exact" : params.policy == LLAMA_SPARQ_POLICY_WINDOW ? "window" : "sparq",
                params.default_layout ? "default (no K^T)" : "K^T", llama_sparq_index_name(params.index),
                q4 ? "none (every component)" : llama_sparq_select_name(params.select), dense_below);
    }

    cparams.sparq = params;

    // new graphs: the op's scratch and the derived-state nodes change the reserve; never reuse an old graph
    sched_need_reserve = true;
    for (auto & res : gf_res_prev) {
        if (res) {
            res->reset();
        }
    }
    gf_res_prev_active = nullptr;

    if (model.hparams.no_alloc) {
        // a context that measures memory (llama.cpp's parameter fitting) never decodes, which is where the reserve
        // would happen: its compute buffer sizes must include SparQ's graphs now
        try {
            sched_reserve();
        } catch (const std::exception & e) {
            err = std::string("SparQ: reserving the compute graphs failed: ") + e.what();
            return -1;
        }
    }

    return 0;
}

// The graph's tensor budget (llama_context::graph_max_nodes) grows by what build_attn_sparq adds per layer at
// most: the index write (up to 9 tensors), the cache read-backs (7), the V-sum and key-statistics upkeep (up to 11
// each) and the op with its views (about 15), rounded up. Every view and reshape takes a tensor of the budget.
uint32_t sparq_graph_nodes(const llama_cparams & cparams, const llama_model & model) {
    return cparams.sparq.enabled ? 64u*model.hparams.n_layer() : 0u;
}

const llama_sparq_params & llama_context::get_sparq() const {
    return cparams.sparq;
}

//
// C API
//

struct llama_sparq_params llama_sparq_default_params(void) {
    llama_sparq_params p = {};
    p.enabled         = false;
    p.k1              = 0;
    p.k2              = 128;
    p.window          = -1;
    p.sinks           = 0;
    p.mean            = LLAMA_SPARQ_MEAN_AUTO;
    p.policy          = LLAMA_SPARQ_POLICY_SPARQ;
    p.sparse_v_thresh = 0.0f;
    p.default_layout  = false;
    p.prefill         = false;
    p.swa             = false;
    p.min_n_kv        = -1;
    p.index           = LLAMA_SPARQ_INDEX_Q8;
    p.select          = LLAMA_SPARQ_SELECT_QSIGMA;
    return p;
}

const char * llama_sparq_check(const struct llama_context * ctx, const struct llama_sparq_params * p) {
    static thread_local char msg[256];
    auto fail = [&](const char * fmt, auto... args) {
        snprintf(msg, sizeof(msg), fmt, args...);
        return msg;
    };
    if (p == nullptr) {
        return "params is NULL";
    }
    if (p->k1 < 0) {
        return fail("k1 must be >= 0 (0: head_dim/4, head_dim/2 with the q8 index, head_dim with the q4 index), got %d",
                    p->k1);
    }
    if (p->k2 < 1) {
        return fail("k2 must be >= 1, got %d", p->k2);
    }
    if (p->window < -1) {
        return fail("window must be >= 0 (or -1: k2/4), got %d", p->window);
    }
    if (p->sinks < 0) {
        return fail("sinks must be >= 0, got %d", p->sinks);
    }
    const int32_t window = sparq_window(*p);
    if ((int64_t) window + p->sinks > p->k2) {
        return fail("window (%d) + sinks (%d) must not exceed k2 (%d)", window, p->sinks, p->k2);
    }
    if (p->mean < LLAMA_SPARQ_MEAN_AUTO || p->mean > LLAMA_SPARQ_MEAN_OFF) {
        return fail("mean must be auto (0), on (1) or off (2), got %d", p->mean);
    }
    if (p->policy < LLAMA_SPARQ_POLICY_SPARQ || p->policy > LLAMA_SPARQ_POLICY_WINDOW) {
        return fail("policy must be sparq (0), exact (1) or window (2), got %d", p->policy);
    }
    if (!std::isfinite(p->sparse_v_thresh) || p->sparse_v_thresh < 0.0f || p->sparse_v_thresh >= 1.0f) {
        return fail("sparse_v_thresh must be in [0, 1), got %g", (double) p->sparse_v_thresh);
    }
    if (p->min_n_kv < -1) {
        return fail("min_n_kv must be >= 0 (or -1: the measured default), got %d", p->min_n_kv);
    }
    if (p->index < LLAMA_SPARQ_INDEX_F16 || p->index > LLAMA_SPARQ_INDEX_Q4) {
        return fail("index must be f16 (0), q8 (1) or q4 (2), got %d", p->index);
    }
    if (p->index == LLAMA_SPARQ_INDEX_Q4 && p->k1 != 0) {
        return fail("the q4 index scores every key component: k1 must be 0 (head_dim) with it, got %d", p->k1);
    }
    if (p->select < LLAMA_SPARQ_SELECT_Q || p->select > LLAMA_SPARQ_SELECT_QSIGMA) {
        return fail("select must be q (0) or qsigma (1), got %d", p->select);
    }
    if (p->default_layout && p->index != LLAMA_SPARQ_INDEX_F16) {
        return fail("the %s index is a quantized key copy, which default_layout does not keep: use the f16 index with "
                    "default_layout", llama_sparq_index_name(p->index));
    }
    if (ctx != nullptr && p->enabled && !ctx->get_cparams().flash_attn) {
        return "SparQ needs flash attention's row-major V cache; create the context with flash attention on "
               "(-fa on, flash_attn=True, LLAMA_FLASH_ATTN_TYPE_ENABLED)";
    }
    if (ctx != nullptr && p->k1 > 0) {
        const auto & hparams = ctx->get_model().hparams;
        for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
            if ((uint32_t) p->k1 > hparams.n_embd_head_k(il)) {
                return fail("k1 (%d) exceeds the model's key head dim (%u, layer %u)",
                            p->k1, hparams.n_embd_head_k(il), il);
            }
        }
    }
    return nullptr;
}

int32_t llama_set_sparq(struct llama_context * ctx, const struct llama_sparq_params * params) {
    std::string err;
    if (ctx == nullptr || params == nullptr) {
        err = "ctx and params must not be NULL";
    } else if (ctx->set_sparq(*params, err) == 0) {
        g_sparq_error.clear();
        return 0;
    }
    LLAMA_LOG_ERROR("%s: %s\n", __func__, err.c_str());
    g_sparq_error = err;
    return -1;
}

struct llama_sparq_params llama_get_sparq(const struct llama_context * ctx) {
    return ctx->get_sparq();
}

const char * llama_sparq_last_error(void) {
    return g_sparq_error.c_str();
}

// After a state load: the cache marked its derived state stale; rebuild it before the caller times a decode
// (llama-bench -d restores its prefix this way). State reads complete only when the reader is destroyed,
// so this runs in the public wrappers, after the read.
void llama_context::sparq_sync() {
    if (cparams.sparq.enabled && memory) {
        memory_update(false);
    }
}

//
// what the last ubatches ran
//

// Called by llama_context::process_ubatch after each graph compute (patch 0003): the graph's counts (a reused graph
// runs what it was built for) become the record of every sequence the ubatch holds.
void llama_context::sparq_record_run(const llm_graph_result * res, const llama_ubatch & ubatch) {
    GGML_ASSERT(res != nullptr);
    llama_sparq_run run = {};
    run.n_tokens = (int32_t) ubatch.n_tokens;
    sparq_graph_run(res, run);

    const size_t n_seq = cparams.n_seq_max;
    if (sparq_runs.size() != n_seq + 1) {
        sparq_runs.assign(n_seq + 1, llama_sparq_run{});
    }
    for (uint32_t i = 0; i < ubatch.n_seqs_unq; ++i) {
        const llama_seq_id s = ubatch.seq_id_unq[i];
        GGML_ASSERT(s >= 0 && (size_t) s < n_seq);
        sparq_runs[s] = run;
    }
    sparq_runs[n_seq] = run;
}

llama_sparq_run llama_context::sparq_last_run(llama_seq_id seq_id) const {
    const size_t n_seq = cparams.n_seq_max;
    if (seq_id < -1 || seq_id >= (llama_seq_id) n_seq || sparq_runs.size() != n_seq + 1) {
        return llama_sparq_run{};
    }
    return sparq_runs[seq_id < 0 ? n_seq : (size_t) seq_id];
}

struct llama_sparq_run llama_sparq_last_run(const struct llama_context * ctx, int32_t seq_id) {
    return ctx != nullptr ? ctx->sparq_last_run(seq_id) : llama_sparq_run{};
}

//
// what the context runs, in one line
//

static std::string sparq_summary(const llama_context & ctx) {
    const llama_sparq_params & p = ctx.get_sparq();
    if (!p.enabled) {
        return "SparQ: off (dense attention in every layer)";
    }
    const auto & hparams = ctx.get_model().hparams;
    std::vector<llama_kv_cache *> caches;
    std::string err;
    sparq_caches(ctx.get_memory(), true, caches, err);

    // per reason, in the order first met, how many layers stay dense; per kind of layer that runs SparQ, the
    // cell count below which it stays dense
    std::vector<std::pair<std::string, int>> dense;
    std::vector<std::pair<std::string, int32_t>> min_kv;
    auto count = [](auto & list, const std::string & key) -> auto & {
        for (auto & e : list) {
            if (e.first == key) {
                return e;
            }
        }
        list.emplace_back(key, 0);
        return list.back();
    };
    const uint32_t n_layer = hparams.n_layer();
    int n_active = 0;
    uint32_t head_dim = 0; // of the first layer that runs SparQ (k1's automatic value is a share of it)
    for (uint32_t il = 0; il < n_layer; ++il) {
        const sparq_kv_layer * L = nullptr;
        for (auto * kv : caches) {
            if ((L = kv->sparq_layer((int32_t) il)) != nullptr) {
                break;
            }
        }
        if (L != nullptr && L->active) {
            ++n_active;
            head_dim = head_dim ? head_dim : hparams.n_embd_head_k(il);
            const bool host = sparq_on_host(L->k);
            const bool mha  = hparams.n_head(il) == hparams.n_head_kv(il);
            const char * kind = host ? "KV in host memory" : mha ? "KV on a GPU, MHA layers" : "KV on a GPU, GQA layers";
            count(min_kv, kind).second = sparq_min_n_kv(p, host, mha);
            continue;
        }
        std::string why = L != nullptr ? L->reason :
                          hparams.is_swa(il) ? "sliding-window layer (its read is bounded; --sparq-swa includes it)" :
                          "not an attention layer of the KV cache (recurrent or without a cache)";
        count(dense, why).second++;
    }

    std::string k1 = std::to_string(p.k1);
    if (p.k1 == 0) {
        const std::string share = sparq_k1_auto_name(p.index);
        k1 = head_dim ? std::to_string(sparq_k1_auto(p.index, head_dim)) + " (" + share + ")" : "0 (" + share + ")";
    }
    std::string out = "SparQ: on, k1 = " + k1 + ", k2 = " + std::to_string(p.k2) + ", index = " +
                      llama_sparq_index_name(p.index) + ", select = " +
                      (p.index == LLAMA_SPARQ_INDEX_Q4 ? "none" : llama_sparq_select_name(p.select));
    if (p.policy != LLAMA_SPARQ_POLICY_SPARQ) {
        out += std::string(", policy = ") + (p.policy == LLAMA_SPARQ_POLICY_EXACT ? "exact" : "window");
    }
    out += "; runs in " + std::to_string(n_active) + " of " + std::to_string(n_layer) + " layers";
    if (n_active < (int) n_layer) {
        out += ", " + std::to_string(n_layer - n_active) + " dense:";
        for (size_t i = 0; i < dense.size(); ++i) {
            out += (i ? "; " : " ") + std::to_string(dense[i].second) + " " + dense[i].first;
        }
    }
    if (n_active > 0) {
        out += "; dense below ";
        if (p.min_n_kv >= 0) {
            out += std::to_string(p.min_n_kv) + " cached cells";
        } else if (min_kv.size() == 1) {
            out += std::to_string(min_kv[0].second) + " cached cells (the measured default with the " + min_kv[0].first +
                   "; --sparq-min-kv / sparq_min_n_kv sets it)";
        } else {
            for (size_t i = 0; i < min_kv.size(); ++i) {
                out += (i ? " / " : "") + std::to_string(min_kv[i].second) + " (" + min_kv[i].first + ")";
            }
            out += " cached cells (measured defaults; --sparq-min-kv / sparq_min_n_kv sets it)";
        }
    }
    return out;
}

int32_t llama_sparq_summary(const struct llama_context * ctx, char * buf, size_t size) {
    if (ctx == nullptr) {
        return -1;
    }
    const std::string s = sparq_summary(*ctx);
    if (buf != nullptr && size > 0) {
        snprintf(buf, size, "%s", s.c_str());
    }
    return (int32_t) s.size();
}

void llama_sparq_log_summary(const struct llama_context * ctx) {
    if (ctx != nullptr) {
        LLAMA_LOG_INFO("%s: %s\n", __func__, sparq_summary(*ctx).c_str());
    }
}

//
// testing: the derived KV state as host arrays
//

int sparq_llama_memory_breakdown(const struct llama_context * ctx, size_t * out) {
    if (ctx == nullptr || out == nullptr) {
        return 1;
    }
    out[0] = out[1] = out[2] = 0;
    for (const auto & [buft, mb] : ctx->memory_breakdown()) {
        out[0] += mb.model;
        out[1] += mb.context;
        out[2] += mb.compute;
    }
    return 0;
}

// The q4 index [18*d, n_head_kv, n_blk, n_stream] read back as K^T [n_stream][n_embd][32*n_blk] f32: component i of
// cell c of a block is (n - 8) * scale_i (ggml-sparq.h, "The q4 index").
template <typename Fail>
static int read_q4_index(const ggml_tensor * t, float * out, size_t n_out, int64_t * ne_out, Fail && fail) {
    constexpr int64_t B = GGML_SPARQ_Q4_CELLS;
    const int64_t d = t->ne[0] / GGML_SPARQ_Q4_DIM_BYTES, n_head_kv = t->ne[1], n_blk = t->ne[2], n_stream = t->ne[3];
    const int64_t n_embd = d*n_head_kv, row_len = B*n_blk;
    ne_out[0] = row_len; ne_out[1] = n_embd; ne_out[2] = n_stream;
    if (out == nullptr) {
        return 0;
    }
    if (n_out < (size_t) (row_len*n_embd*n_stream)) {
        return fail("out is too small for the q4 index");
    }
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    for (int64_t s = 0; s < n_stream; ++s) {
        for (int64_t b = 0; b < n_blk; ++b) {
            for (int64_t h = 0; h < n_head_kv; ++h) {
                const uint8_t * blk = raw.data() + s*t->nb[3] + b*t->nb[2] + h*t->nb[1];
                for (int64_t i = 0; i < d; ++i) {
                    ggml_fp16_t scale16;
                    memcpy(&scale16, blk + 16*d + 2*i, sizeof(scale16));
                    const float scale = ggml_fp16_to_fp32(scale16);
                    for (int64_t c = 0; c < B; ++c) {
                        uint32_t word;
                        memcpy(&word, blk + 4*(B*(i/8) + c), sizeof(word));
                        const int shift = 8*(i % 4) + 4*((i % 8) / 4);
                        const int n = (int) ((word >> shift) & 15);
                        out[(s*n_embd + h*d + i)*row_len + b*B + c] = (float) (n - 8) * scale;
                    }
                }
            }
        }
    }
    return 0;
}

int sparq_llama_read_kv_tensor(struct llama_context * ctx, int32_t il, int32_t what, float * out, size_t n_out,
                               int64_t * ne_out, char * err, size_t err_size) {
    auto fail = [&](const std::string & msg) {
        if (err && err_size > 0) {
            snprintf(err, err_size, "%s", msg.c_str());
        }
        return 1;
    };
    if (ctx == nullptr || ne_out == nullptr) {
        return fail("ctx and ne_out must not be NULL");
    }
    std::vector<llama_kv_cache *> caches;
    std::string msg;
    if (!sparq_caches(ctx->get_memory(), true, caches, msg)) {
        return fail(msg);
    }
    const sparq_kv_layer * L = nullptr;
    const llama_kv_cache * L_kv = nullptr;
    for (auto * kv : caches) {
        if (const sparq_kv_layer * l = kv->sparq_layer(il)) {
            L    = l;
            L_kv = kv;
            break;
        }
    }
    if (L == nullptr || !L->active) {
        return fail("layer " + std::to_string(il) + " has no SparQ state (SparQ off, or the layer is dense)");
    }
    if (what == 4 || what == 5) {
        // the cells' occupancy per stream, or which cells of its stream each sequence holds (sequence s owns
        // stream s unless the cache is unified)
        const llama_kv_cache * kv = L_kv;
        ne_out[0] = kv->get_size();
        ne_out[1] = what == 4 ? kv->get_n_stream() : kv->get_n_seq_max();
        ne_out[2] = 1;
        if (out == nullptr) {
            return 0;
        }
        if (n_out < (size_t) (ne_out[0]*ne_out[1])) {
            return fail("out is too small for the cells");
        }
        for (int64_t s = 0; s < ne_out[1]; ++s) {
            const auto & cells = kv->get_cells((llama_seq_id) s);
            for (int64_t c = 0; c < ne_out[0]; ++c) {
                const bool in = what == 4 ? !cells.is_empty((uint32_t) c) : cells.seq_has((uint32_t) c, (llama_seq_id) s);
                out[s*ne_out[0] + c] = in ? 1.0f : 0.0f;
            }
        }
        return 0;
    }
    const ggml_tensor * t = what == 0 ? L->k : what == 1 ? L->kt : what == 2 ? L->vsum : what == 3 ? L->kstat : nullptr;
    if (t == nullptr) {
        return fail("layer " + std::to_string(il) + " keeps no tensor " + std::to_string(what));
    }
    if (t->type == GGML_TYPE_I8) {
        return read_q4_index(t, out, n_out, ne_out, fail);
    }
    GGML_ASSERT(ggml_is_contiguous(t) && t->ne[3] == 1);
    for (int i = 0; i < 3; ++i) {
        ne_out[i] = t->ne[i];
    }
    if (out == nullptr) {
        return 0;
    }
    if (n_out < (size_t) ggml_nelements(t)) {
        return fail("out holds " + std::to_string(n_out) + " floats, the tensor " + std::to_string(ggml_nelements(t)));
    }
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    const auto * traits = ggml_get_type_traits(t->type);
    const int64_t n_rows = ggml_nrows(t);
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t * row = raw.data() + r*t->nb[1];
        float * dst = out + r*t->ne[0];
        if (t->type == GGML_TYPE_F32) {
            memcpy(dst, row, t->ne[0]*sizeof(float));
        } else {
            GGML_ASSERT(traits->to_float != nullptr);
            traits->to_float(row, dst, t->ne[0]);
        }
    }
    return 0;
}
