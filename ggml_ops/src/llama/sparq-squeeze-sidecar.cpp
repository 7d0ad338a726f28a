// The sidecar file of a prepared prefix (llama_squeeze_save / llama_squeeze_load): the clusters, assignments by
// position, thresholds, prefix tokens and calibration queries, with a format version and the model's fingerprint.
#include "sparq-squeeze.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

namespace sparq_squeeze_detail {

constexpr char     SIDECAR_MAGIC[4] = { 'S', 'Q', 'Z', 'P' };
constexpr uint32_t SIDECAR_VERSION  = 3;  // 2: + the calibration queries; 3: + var_weight and the tables' variances
                                          // (versions 1 and 2 are still read: the mean rule, tables of width d + 1)

// What a saved prefix must match: the model's shape and description, and a hash of its first token embeddings.
static std::string model_fingerprint(const llama_model & model) {
    const auto & hp = model.hparams;
    std::string fp = model.arch_name() + "|" + model.desc() + "|" + std::to_string(model.n_elements()) + "|" +
                     std::to_string(hp.n_embd) + "|" + std::to_string(hp.n_layer()) + "|";
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        fp += std::to_string(hp.n_head_kv(il)) + "x" + std::to_string(hp.n_embd_head_k(il)) + ",";
    }
    uint64_t hash = 1469598103934665603ull; // FNV-1a
    if (model.tok_embd != nullptr && model.tok_embd->buffer != nullptr) {
        std::vector<uint8_t> bytes(std::min<size_t>(ggml_nbytes(model.tok_embd), 1u << 16));
        ggml_backend_tensor_get(model.tok_embd, bytes.data(), 0, bytes.size());
        for (uint8_t b : bytes) {
            hash = (hash ^ b)*1099511628211ull;
        }
    }
    char hex[24];
    snprintf(hex, sizeof(hex), "%016llx", (unsigned long long) hash);
    return fp + "|" + hex;
}

struct writer {
    FILE * f;
    bool ok = true;
    void raw(const void * p, size_t n) { ok = ok && fwrite(p, 1, n, f) == n; }
    template <typename T> void val(T v) { raw(&v, sizeof(v)); }
    template <typename T> void vec(const std::vector<T> & v) { val<uint64_t>(v.size()); raw(v.data(), v.size()*sizeof(T)); }
    void str(const std::string & s) { val<uint64_t>(s.size()); raw(s.data(), s.size()); }
};

struct reader {
    FILE * f;
    bool ok = true;
    void raw(void * p, size_t n) { ok = ok && fread(p, 1, n, f) == n; }
    template <typename T> T val() { T v{}; raw(&v, sizeof(v)); return v; }
    template <typename T> void vec(std::vector<T> & v, uint64_t max_n) {
        const uint64_t n = val<uint64_t>();
        if (!ok || n > max_n) { ok = false; return; }
        v.resize(n);
        raw(v.data(), n*sizeof(T));
    }
    std::string str(uint64_t max_n) {
        std::string s;
        const uint64_t n = val<uint64_t>();
        if (!ok || n > max_n) { ok = false; return s; }
        s.resize(n);
        raw(s.data(), n);
        return s;
    }
};

struct file_closer { void operator()(FILE * f) const { fclose(f); } };

}  // namespace sparq_squeeze_detail

namespace sqp = sparq_squeeze_detail;

std::string sparq_squeeze_access::save(llama_context & ctx, const char * path) {
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    verify(*kv);
    const squeeze_kv_state * st = kv->squeeze.get();
    if (st == nullptr || !st->ready) {
        return "no prepared prefix to save";
    }
    std::unique_ptr<FILE, sqp::file_closer> f(fopen(path, "wb"));
    if (!f) {
        return std::string("cannot write ") + path + ": " + strerror(errno);
    }
    sqp::writer w{ f.get() };
    w.raw(sqp::SIDECAR_MAGIC, 4);
    w.val<uint32_t>(sqp::SIDECAR_VERSION);
    w.str(sqp::model_fingerprint(ctx.model));
    const auto & p = st->params;
    w.val(p.centroids); w.val(p.keep); w.val(p.levels); w.val(p.centroids_coarse); w.val(p.keep_coarse);
    w.val(p.n_calib); w.val(p.n_iter); w.val(p.group); w.val(p.var_weight);
    w.val(st->n_prefix); w.val(st->n_clustered);
    w.val(st->threshold); w.val(st->threshold_coarse); w.val(st->kept_calib);
    w.vec(st->tokens);
    w.val<uint32_t>((uint32_t) st->layers.size());
    for (size_t ikv = 0; ikv < st->layers.size(); ++ikv) {
        const auto & L = st->layers[ikv];
        w.val<uint32_t>(kv->layers[ikv].il);
        w.val<uint8_t>(L.active ? 1 : 0);
        w.str(L.reason);
        w.val(L.d); w.val(L.n_head_kv); w.val(L.n_cent); w.val(L.n_coarse); w.val(L.width);
        w.vec(L.table); w.vec(L.assign); w.vec(L.coarse_table); w.vec(L.parent);
    }
    w.val<uint32_t>((uint32_t) st->calib_q.size());
    for (const auto & [il, q] : st->calib_q) {
        w.val<int32_t>(il);
        w.val<float>(st->calib_scale.at(il));
        w.vec(q);
    }
    if (!w.ok || fflush(f.get()) != 0) {
        return std::string("writing ") + path + " failed";
    }
    return "";
}

std::string sparq_squeeze_access::load(llama_context & ctx, int32_t seq_id, const char * path, const int32_t * tokens,
                                       int32_t n_tokens) {
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    std::unique_ptr<FILE, sqp::file_closer> f(fopen(path, "rb"));
    if (!f) {
        return std::string("cannot read ") + path + ": " + strerror(errno);
    }
    sqp::reader r{ f.get() };
    char magic[4] = {};
    r.raw(magic, 4);
    if (!r.ok || std::memcmp(magic, sqp::SIDECAR_MAGIC, 4) != 0) {
        return std::string(path) + " is not a centroid-sparse prefix file";
    }
    const uint32_t version = r.val<uint32_t>();
    const uint32_t swapped = ((version & 0xFFu) << 24) | ((version & 0xFF00u) << 8) | ((version >> 8) & 0xFF00u) |
                             (version >> 24);
    if ((version < 1 || version > sqp::SIDECAR_VERSION) && swapped >= 1 && swapped <= sqp::SIDECAR_VERSION) {
        // the file holds its numbers in the writer's byte order (as llama.cpp's state files do)
        return std::string(path) + " was written on a machine of the other byte order; prepare the prefix again here";
    }
    if (version < 1 || version > sqp::SIDECAR_VERSION) {
        return std::string(path) + ": format version " + std::to_string(version) + ", this build reads versions 1 to " +
               std::to_string(sqp::SIDECAR_VERSION);
    }
    if (r.str(1u << 20) != sqp::model_fingerprint(ctx.model)) {
        return std::string(path) + " was prepared with a different model (the fingerprint differs)";
    }
    auto st = std::make_shared<squeeze_kv_state>();
    auto & p = st->params;
    p = llama_squeeze_default_params();
    p.centroids = r.val<float>(); p.keep = r.val<float>(); p.levels = r.val<int32_t>();
    p.centroids_coarse = r.val<float>(); p.keep_coarse = r.val<float>(); p.n_calib = r.val<int32_t>();
    p.n_iter = r.val<int32_t>(); p.group = r.val<int32_t>();
    p.var_weight = version >= 3 ? r.val<float>() : 0.0f;  // older files: the mean rule, whose thresholds they hold
    st->n_prefix = r.val<int32_t>(); st->n_clustered = r.val<int32_t>();
    st->threshold = r.val<float>(); st->threshold_coarse = r.val<float>(); st->kept_calib = r.val<float>();
    r.vec(st->tokens, 1u << 30);
    if (!r.ok || st->n_clustered < 1 || st->n_clustered > st->n_prefix || (int32_t) st->tokens.size() != st->n_prefix ||
        llama_squeeze_check(&p) != nullptr) {
        return std::string(path) + " is truncated or damaged";
    }
    if (tokens != nullptr) {
        if (n_tokens < st->n_prefix || !std::equal(st->tokens.begin(), st->tokens.end(), tokens)) {
            return std::string(path) + " holds a different prefix than the given tokens (" + std::to_string(st->n_prefix) +
                   " saved tokens)";
        }
    }
    const uint32_t n_layers = r.val<uint32_t>();
    if (!r.ok || n_layers != kv->layers.size()) {
        return std::string(path) + ": the layer count differs from this context's cache";
    }
    const auto & hp = ctx.model.hparams;
    st->layers.resize(n_layers);
    for (uint32_t ikv = 0; ikv < n_layers; ++ikv) {
        auto & L = st->layers[ikv];
        const uint32_t il = r.val<uint32_t>();
        L.active = r.val<uint8_t>() != 0;
        L.reason = r.str(1u << 12);
        L.d = r.val<int64_t>(); L.n_head_kv = r.val<int64_t>(); L.n_cent = r.val<int64_t>(); L.n_coarse = r.val<int64_t>();
        L.width = version >= 3 ? r.val<int64_t>() : L.d + 1;
        const uint64_t max_n = uint64_t(1) << 36;
        r.vec(L.table, max_n); r.vec(L.assign, max_n); r.vec(L.coarse_table, max_n); r.vec(L.parent, max_n);
        if (!r.ok || il != kv->layers[ikv].il || L.d != hp.n_embd_head_k(il) || L.n_head_kv != hp.n_head_kv(il)) {
            return std::string(path) + " is truncated, damaged or from a different cache layout (layer " + std::to_string(il) + ")";
        }
        if (L.active && ((L.width != L.d + 1 && L.width != 2*L.d + 1) || (p.var_weight > 0.0f && L.width != 2*L.d + 1) ||
                         (int64_t) L.table.size() != L.n_head_kv*L.n_cent*L.width ||
                         (int64_t) L.assign.size() != L.n_head_kv*st->n_clustered ||
                         (int64_t) L.coarse_table.size() != L.n_head_kv*L.n_coarse*L.width ||
                         (int64_t) L.parent.size() != (L.n_coarse > 0 ? L.n_head_kv*L.n_cent : 0))) {
            return std::string(path) + ": layer " + std::to_string(il) + "'s tables have inconsistent sizes";
        }
        for (int32_t a : L.assign) {
            if (a < 0 || a >= L.n_cent) {
                return std::string(path) + ": layer " + std::to_string(il) + " has a cluster index out of range";
            }
        }
        if (L.active && !sqp::device_runs_op(kv->layers[ikv].k, kv->layers[ikv].v, L.d, hp.n_embd_head_v(il), hp.n_head(il),
                                             L.n_head_kv, L.n_coarse > 0)) {
            L.active = false;
            L.reason = "no ggml_centroid_attn kernel for this case on this device";
        }
    }
    if (version >= 2) {
        const uint32_t n_q = r.val<uint32_t>();
        for (uint32_t i = 0; r.ok && i < n_q; ++i) {
            const int32_t il = r.val<int32_t>();
            const float scale = r.val<float>();
            std::vector<float> q;
            r.vec(q, uint64_t(1) << 36);
            const squeeze_kv_layer * L = nullptr;
            for (uint32_t ikv = 0; ikv < n_layers; ++ikv) {
                L = (int32_t) kv->layers[ikv].il == il ? &st->layers[ikv] : L;
            }
            if (!r.ok || L == nullptr || il < 0 || (int64_t) q.size() !=
                    (int64_t) (st->n_prefix - st->n_clustered)*hp.n_head(il)*L->d) {
                return std::string(path) + " is truncated or damaged (calibration queries)";
            }
            st->calib_q[il] = std::move(q);
            st->calib_scale[il] = scale;
        }
        if (!r.ok) {
            return std::string(path) + " is truncated or damaged (calibration queries)";
        }
    }
    st->generation = next_generation();
    st->seq_id = seq_id;
    err = prefix_cells(*kv, seq_id, st->n_clustered, st->n_clustered, false, st->stream, st->cells);
    if (!err.empty()) {
        return err + " (load the KV state of the prefix before its sidecar)";
    }
    kv->squeeze.reset();
    err = install(*kv, *st);
    if (!err.empty()) {
        return err;
    }
    kv->squeeze = st;
    reset_graphs(ctx);
    LLAMA_LOG_INFO("%s: centroid-sparse prefix of sequence %d loaded from %s: %d tokens, T = %.4g\n", __func__, seq_id, path,
                   st->n_prefix, (double) st->threshold);
    return "";
}
