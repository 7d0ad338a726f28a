// The C API of centroid-sparse attention over a prepared prefix (llama_squeeze_*, sparq-llama.h).
#include "sparq-squeeze.h"

#include "ggml-centroid.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"

#include <algorithm>
#include <cstdio>

static thread_local std::string g_squeeze_error;

int32_t sparq_squeeze_result(const char * fn, const std::string & err) {
    if (err.empty()) {
        g_squeeze_error.clear();
        return 0;
    }
    LLAMA_LOG_ERROR("%s: %s\n", fn, err.c_str());
    g_squeeze_error = err;
    return -1;
}

struct llama_squeeze_params llama_squeeze_default_params(void) {
    llama_squeeze_params p = {};
    p.centroids        = 0.1f;
    p.keep             = 0.1f;
    p.levels           = 1;
    p.centroids_coarse = 0.01f;
    p.keep_coarse      = 0.0f;
    p.n_calib          = 100;
    p.n_iter           = 8;
    p.group            = GGML_CENTROID_GROUP_MAX;
    p.var_weight       = 1.0f;
    p.init             = LLAMA_SQUEEZE_INIT_EVEN;
    p.progress_callback = nullptr;
    p.progress_callback_user_data = nullptr;
    return p;
}

const char * llama_squeeze_check(const struct llama_squeeze_params * p) {
    static thread_local char msg[256];
    auto fail = [&](const char * fmt, auto... args) {
        snprintf(msg, sizeof(msg), fmt, args...);
        return msg;
    };
    if (p == nullptr) {
        return "params is NULL";
    }
    if (!(p->centroids > 0.0f && p->centroids <= 1.0f)) {
        return fail("centroids must be in (0, 1] (a fraction of the prefix), got %g", (double) p->centroids);
    }
    if (!(p->keep > 0.0f && p->keep <= 1.0f)) {
        return fail("keep must be in (0, 1], got %g", (double) p->keep);
    }
    if (p->levels != 1 && p->levels != 2) {
        return fail("levels must be 1 or 2, got %d", p->levels);
    }
    if (p->levels == 2 && !(p->centroids_coarse > 0.0f && p->centroids_coarse <= p->centroids)) {
        return fail("centroids_coarse must be in (0, centroids=%g], got %g", (double) p->centroids, (double) p->centroids_coarse);
    }
    if (!(p->keep_coarse >= 0.0f && p->keep_coarse <= 1.0f)) {
        return fail("keep_coarse must be in [0, 1] (0: min(1, 2*keep)), got %g", (double) p->keep_coarse);
    }
    if (p->n_calib < 1) {
        return fail("n_calib must be >= 1, got %d", p->n_calib);
    }
    if (p->n_iter < 1) {
        return fail("n_iter must be >= 1, got %d", p->n_iter);
    }
    if (p->group != GGML_CENTROID_GROUP_MAX && p->group != GGML_CENTROID_GROUP_MEAN) {
        return fail("group must be max (0) or mean (1), got %d", p->group);
    }
    if (!(p->var_weight >= 0.0f && p->var_weight <= 100.0f)) {
        return fail("var_weight must be in [0, 100] (0: the mean rule), got %g", (double) p->var_weight);
    }
    if (p->init != LLAMA_SQUEEZE_INIT_EVEN && p->init != LLAMA_SQUEEZE_INIT_KPP) {
        return fail("init must be even (0) or kpp (1), got %d", p->init);
    }
    return nullptr;
}

int32_t llama_squeeze_prepare(struct llama_context * ctx, int32_t seq_id, const int32_t * tokens, int32_t n_prefix,
                              const struct llama_squeeze_params * params) {
    if (ctx == nullptr || params == nullptr) {
        return sparq_squeeze_result(__func__, "ctx and params must not be NULL");
    }
    ctx->synchronize();
    return sparq_squeeze_result(__func__, sparq_squeeze_access::prepare(*ctx, seq_id, tokens, n_prefix, *params));
}

int32_t llama_squeeze_save(struct llama_context * ctx, const char * path) {
    if (ctx == nullptr || path == nullptr) {
        return sparq_squeeze_result(__func__, "ctx and path must not be NULL");
    }
    return sparq_squeeze_result(__func__, sparq_squeeze_access::save(*ctx, path));
}

int32_t llama_squeeze_save_files(struct llama_context * ctx, const char * state_path, const char * sidecar_path) {
    if (ctx == nullptr || state_path == nullptr || sidecar_path == nullptr) {
        return sparq_squeeze_result(__func__, "ctx, state_path and sidecar_path must not be NULL");
    }
    ctx->synchronize();
    return sparq_squeeze_result(__func__, sparq_squeeze_access::save_files(*ctx, state_path, sidecar_path));
}

int32_t llama_squeeze_load_files(struct llama_context * ctx, int32_t seq_id, const char * state_path,
                                 const char * sidecar_path, int32_t * tokens_out, size_t n_token_capacity,
                                 size_t * n_token_out) {
    if (ctx == nullptr || state_path == nullptr || sidecar_path == nullptr || tokens_out == nullptr ||
        n_token_out == nullptr || seq_id < 0) {
        return sparq_squeeze_result(__func__, "null argument or negative seq_id");
    }
    *n_token_out = 0;
    ctx->synchronize();
    return sparq_squeeze_result(__func__, sparq_squeeze_access::load_files(*ctx, seq_id, state_path, sidecar_path,
                                                                           tokens_out, n_token_capacity, n_token_out));
}

int32_t llama_squeeze_recalibrate(struct llama_context * ctx, float keep, float keep_coarse) {
    if (ctx == nullptr) {
        return sparq_squeeze_result(__func__, "ctx must not be NULL");
    }
    ctx->synchronize();
    return sparq_squeeze_result(__func__, sparq_squeeze_access::recalibrate(*ctx, keep, keep_coarse));
}

int32_t llama_squeeze_load(struct llama_context * ctx, int32_t seq_id, const char * path, const int32_t * tokens,
                           int32_t n_tokens) {
    if (ctx == nullptr || path == nullptr) {
        return sparq_squeeze_result(__func__, "ctx and path must not be NULL");
    }
    ctx->synchronize();
    return sparq_squeeze_result(__func__, sparq_squeeze_access::load(*ctx, seq_id, path, tokens, n_tokens));
}

int32_t llama_squeeze_set_prefill(struct llama_context * ctx, enum llama_squeeze_prefill mode) {
    if (ctx == nullptr) {
        return sparq_squeeze_result(__func__, "ctx must not be NULL");
    }
    if (mode != LLAMA_SQUEEZE_PREFILL_AUTO && mode != LLAMA_SQUEEZE_PREFILL_SPARSE && mode != LLAMA_SQUEEZE_PREFILL_DENSE) {
        return sparq_squeeze_result(__func__, "mode must be LLAMA_SQUEEZE_PREFILL_AUTO, _SPARSE or _DENSE, got " +
                                    std::to_string((int) mode));
    }
    std::string err;
    llama_kv_cache * kv = sparq_squeeze_access::cache(*ctx, err);
    if (kv == nullptr) {
        return sparq_squeeze_result(__func__, err);
    }
    ctx->synchronize();
    sparq_squeeze_access::verify(*kv);
    squeeze_kv_state * st = kv->squeeze.get();
    if (st == nullptr || !st->ready) {
        return sparq_squeeze_result(__func__, "no prepared prefix (llama_squeeze_prepare or llama_squeeze_load first)");
    }
    if (st->prefill != mode) {
        st->prefill = mode;
        st->generation = sparq_squeeze_access::next_generation();  // graphs built for the other mode are not reused
    }
    return sparq_squeeze_result(__func__, "");
}

void llama_squeeze_clear(struct llama_context * ctx) {
    if (ctx != nullptr) {
        sparq_squeeze_access::clear(*ctx);
    }
}

struct llama_squeeze_info llama_squeeze_get_info(const struct llama_context * ctx) {
    llama_squeeze_info info = {};
    std::string err;
    llama_kv_cache * kv = ctx ? sparq_squeeze_access::cache(const_cast<llama_context &>(*ctx), err) : nullptr;
    if (kv == nullptr) {
        return info;
    }
    sparq_squeeze_access::verify(*kv);
    const squeeze_kv_state * st = kv->squeeze.get();
    if (st == nullptr || !st->ready) {
        return info;
    }
    info.prepared         = true;
    info.seq_id           = st->seq_id;
    info.n_prefix         = st->n_prefix;
    info.n_clustered      = st->n_clustered;
    info.levels           = st->params.levels;
    info.keep             = st->params.keep;
    info.prefill          = st->prefill;
    info.threshold_coarse = st->threshold_coarse;
    info.kept_calib       = st->kept_calib;
    info.var_weight       = st->params.var_weight;
    for (const auto & L : st->layers) {
        info.n_layers += L.active ? 1 : 0;
    }
    return info;
}

bool llama_squeeze_seq_sparse(const struct llama_context * ctx, int32_t seq_id) {
    std::string err;
    llama_kv_cache * kv = ctx ? sparq_squeeze_access::cache(const_cast<llama_context &>(*ctx), err) : nullptr;
    if (kv == nullptr) {
        return false;
    }
    sparq_squeeze_access::verify(*kv);
    return sparq_squeeze_access::seq_sparse(*kv, seq_id);
}

int32_t llama_squeeze_n_calib(const struct llama_squeeze_params * params, int32_t n_prefix) {
    return params == nullptr ? 0 : std::max(0, std::min(params->n_calib, n_prefix/2));
}

const char * llama_squeeze_last_error(void) {
    return g_squeeze_error.c_str();
}
