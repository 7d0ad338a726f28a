// The sidecar file of a prepared prefix (llama_squeeze_save / llama_squeeze_load): the clusters, assignments by
// position, thresholds, prefix tokens and calibration queries, with a format version and the model's fingerprint;
// each part with its checksum, and the parts and checksums of the KV state file saved with it
// (llama_squeeze_save_files / llama_squeeze_load_files, which verify both files before applying either).
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
// 2: + the calibration queries; 3: + var_weight and the tables' variances; 4: each part framed by its length and
// checksum, + the KV state record. Versions 1 to 3 are still read (1 and 2: the mean rule, tables of width d + 1),
// unverified.
constexpr uint32_t SIDECAR_VERSION  = 4;

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

// Values appended to a buffer in the host's byte order (the reader refuses a file of the other order).
struct writer {
    std::vector<uint8_t> buf;
    void raw(const void * p, size_t n) { buf.insert(buf.end(), (const uint8_t *) p, (const uint8_t *) p + n); }
    template <typename T> void val(T v) { raw(&v, sizeof(v)); }
    template <typename T> void vec(const std::vector<T> & v) { val<uint64_t>(v.size()); raw(v.data(), v.size()*sizeof(T)); }
    void str(const std::string & s) { val<uint64_t>(s.size()); raw(s.data(), s.size()); }
    // ends a part: its length, its checksum and its bytes go to out (version 4's framing), and the buffer starts over
    void seal(std::vector<uint8_t> & out) {
        const uint64_t head[2] = { buf.size(), hash64(buf.data(), buf.size()) };
        out.insert(out.end(), (const uint8_t *) head, (const uint8_t *) head + sizeof(head));
        out.insert(out.end(), buf.begin(), buf.end());
        buf.clear();
    }
};

// Values read from [at, end) of a file's bytes; ok turns false at the first read past end.
struct reader {
    const uint8_t * data = nullptr;
    size_t at = 0, end = 0;
    bool ok = true;
    void raw(void * p, size_t n) {
        ok = ok && n <= end - at;
        if (ok) { std::memcpy(p, data + at, n); at += n; }
    }
    template <typename T> T val() { T v{}; raw(&v, sizeof(v)); return v; }
    template <typename T> void vec(std::vector<T> & v, uint64_t max_n) {
        const uint64_t n = val<uint64_t>();
        if (!ok || n > max_n || n*sizeof(T) > end - at) { ok = false; return; }
        v.resize(n);
        raw(v.data(), n*sizeof(T));
    }
    std::string str(uint64_t max_n) {
        std::string s;
        const uint64_t n = val<uint64_t>();
        if (!ok || n > max_n || n > end - at) { ok = false; return s; }
        s.resize(n);
        raw(s.data(), n);
        return s;
    }
};

// The parts of a sidecar, one after another. From version 4 each is framed by its length and checksum, verified
// before any of its bytes is parsed; older files are one unframed run (their parts are read where they follow).
struct parts_reader {
    const std::vector<uint8_t> & file;
    const char * path;
    bool   framed;
    size_t at;

    // The next part as a reader, or "" and the reason in err (the file and the part named).
    bool next(const std::string & name, reader & r, std::string & err) {
        r = reader{ file.data(), at, file.size() };
        if (!framed) {
            return true;
        }
        uint64_t head[2] = {};
        r.raw(head, sizeof(head));
        if (!r.ok || head[0] > r.end - r.at) {
            err = std::string(path) + ": " + name + " is cut short (truncated or damaged)";
            return false;
        }
        r.end = r.at + head[0];
        if (hash64(file.data() + r.at, head[0]) != head[1]) {
            err = std::string(path) + ": " + name + " checksum mismatch (file damaged)";
            return false;
        }
        return true;
    }
    // After a part was parsed from r: whether it read as one (framed: exactly its bytes).
    bool done(const std::string & name, const reader & r, std::string & err) {
        if (!r.ok || (framed && r.at != r.end)) {
            err = std::string(path) + ": " + name + " is truncated or damaged";
            return false;
        }
        at = framed ? r.end : r.at;
        return true;
    }
};

struct file_closer { void operator()(FILE * f) const { fclose(f); } };

}  // namespace sparq_squeeze_detail

namespace sqp = sparq_squeeze_detail;

std::string sparq_squeeze_access::save(llama_context & ctx, const char * path, const sqp::state_record * rec) {
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
    // the parts in the order load reads them; their bytes joined are version 3's body
    std::vector<uint8_t> out(sqp::SIDECAR_MAGIC, sqp::SIDECAR_MAGIC + 4);
    sqp::writer w;
    w.val<uint32_t>(sqp::SIDECAR_VERSION);
    out.insert(out.end(), w.buf.begin(), w.buf.end());
    w.buf.clear();
    w.str(sqp::model_fingerprint(ctx.model));
    const auto & p = st->params;
    w.val(p.centroids); w.val(p.keep); w.val(p.levels); w.val(p.centroids_coarse); w.val(p.keep_coarse);
    w.val(p.n_calib); w.val(p.n_iter); w.val(p.group); w.val(p.var_weight);
    w.val(st->n_prefix); w.val(st->n_clustered);
    // the fine level's threshold of files before the budget rule: no longer read, written as 0 (the layout unchanged)
    w.val(0.0f); w.val(st->threshold_coarse); w.val(st->kept_calib);
    w.seal(out);
    w.vec(st->tokens);
    w.seal(out);
    w.val<uint32_t>((uint32_t) st->layers.size());
    w.seal(out);
    for (size_t ikv = 0; ikv < st->layers.size(); ++ikv) {
        const auto & L = st->layers[ikv];
        w.val<uint32_t>(kv->layers[ikv].il);
        w.val<uint8_t>(L.active ? 1 : 0);
        w.str(L.reason);
        w.val(L.d); w.val(L.n_head_kv); w.val(L.n_cent); w.val(L.n_coarse); w.val(L.width);
        w.seal(out);
        w.vec(L.table);        w.seal(out);
        w.vec(L.assign);       w.seal(out);
        w.vec(L.coarse_table); w.seal(out);
        w.vec(L.parent);       w.seal(out);
    }
    w.val<uint32_t>((uint32_t) st->calib_q.size());
    w.seal(out);
    for (const auto & [il, q] : st->calib_q) {
        w.val<int32_t>(il);
        w.val<float>(st->calib_scale.at(il));
        w.vec(q);
        w.seal(out);
    }
    const sqp::state_record none;
    const sqp::state_record & r = rec != nullptr ? *rec : none;
    w.val<uint64_t>(r.size);
    w.val<uint32_t>((uint32_t) r.parts.size());
    for (const sqp::state_part & part : r.parts) {
        w.str(part.name); w.val(part.offset); w.val(part.length); w.val(part.hash);
    }
    w.seal(out);
    std::unique_ptr<FILE, sqp::file_closer> f(fopen(path, "wb"));
    if (!f) {
        return std::string("cannot write ") + path + ": " + strerror(errno);
    }
    if (fwrite(out.data(), 1, out.size(), f.get()) != out.size() || fflush(f.get()) != 0) {
        return std::string("writing ") + path + " failed";
    }
    return "";
}

std::string sparq_squeeze_access::save_files(llama_context & ctx, const char * state_path, const char * sidecar_path) {
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
    if (llama_state_seq_save_file(&ctx, state_path, st->seq_id, st->tokens.data(), st->tokens.size()) == 0) {
        return std::string("writing the KV state to ") + state_path + " failed (see the log)";
    }
    // the record is of the file as written: read back, so that it covers what a load will read
    std::vector<uint8_t> bytes;
    err = sqp::read_file(state_path, bytes);
    if (!err.empty()) {
        return err;
    }
    sqp::state_record rec;
    rec.size = bytes.size();
    rec.parts = sqp::state_file_parts(bytes);
    return save(ctx, sidecar_path, &rec);
}

// The sidecar's bytes parsed and checked against this context (model, cache layout, tokens), nothing applied: the
// prepared prefix in st, the record of its KV state in rec, the format version in version.
std::string sparq_squeeze_access::parse_sidecar(llama_context & ctx, const llama_kv_cache & kv, const char * path,
                                                const std::vector<uint8_t> & file, const int32_t * tokens,
                                                int32_t n_tokens, squeeze_kv_state & state, sqp::state_record & rec,
                                                uint32_t & version) {
    if (file.size() < 8 || std::memcmp(file.data(), sqp::SIDECAR_MAGIC, 4) != 0) {
        return std::string(path) + " is not a centroid-sparse prefix file";
    }
    std::memcpy(&version, file.data() + 4, sizeof(version));
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
    sqp::parts_reader parts{ file, path, version >= 4, 8 };
    sqp::reader r;
    std::string err;
    squeeze_kv_state * st = &state;
    auto & p = st->params;
    p = llama_squeeze_default_params();
    if (!parts.next("header", r, err)) {
        return err;
    }
    if (r.str(1u << 20) != sqp::model_fingerprint(ctx.model)) {
        return r.ok ? std::string(path) + " was prepared with a different model (the fingerprint differs)"
                    : std::string(path) + " is truncated or damaged";
    }
    p.centroids = r.val<float>(); p.keep = r.val<float>(); p.levels = r.val<int32_t>();
    p.centroids_coarse = r.val<float>(); p.keep_coarse = r.val<float>(); p.n_calib = r.val<int32_t>();
    p.n_iter = r.val<int32_t>(); p.group = r.val<int32_t>();
    p.var_weight = version >= 3 ? r.val<float>() : 0.0f;  // older files: the mean rule, whose thresholds they hold
    st->n_prefix = r.val<int32_t>(); st->n_clustered = r.val<int32_t>();
    (void) r.val<float>();  // the fine threshold of files before the budget rule: the rule now runs from p.keep
    st->threshold_coarse = r.val<float>(); st->kept_calib = r.val<float>();
    if (!parts.done("header", r, err) || !parts.next("prefix tokens", r, err)) {
        return err;
    }
    r.vec(st->tokens, 1u << 30);
    if (!parts.done("prefix tokens", r, err)) {
        return err;
    }
    if (st->n_clustered < 1 || st->n_clustered > st->n_prefix || (int32_t) st->tokens.size() != st->n_prefix ||
        llama_squeeze_check(&p) != nullptr) {
        return std::string(path) + " is truncated or damaged";
    }
    if (tokens != nullptr) {
        if (n_tokens < st->n_prefix || !std::equal(st->tokens.begin(), st->tokens.end(), tokens)) {
            return std::string(path) + " holds a different prefix than the given tokens (" + std::to_string(st->n_prefix) +
                   " saved tokens)";
        }
    }
    if (!parts.next("layer count", r, err)) {
        return err;
    }
    const uint32_t n_layers = r.val<uint32_t>();
    if (!parts.done("layer count", r, err)) {
        return err;
    }
    if (n_layers != kv.layers.size()) {
        return std::string(path) + ": the layer count differs from this context's cache";
    }
    const auto & hp = ctx.model.hparams;
    st->layers.resize(n_layers);
    for (uint32_t ikv = 0; ikv < n_layers; ++ikv) {
        auto & L = st->layers[ikv];
        const std::string layer = "layer " + std::to_string(kv.layers[ikv].il);
        if (!parts.next(layer + " settings", r, err)) {
            return err;
        }
        const uint32_t il = r.val<uint32_t>();
        L.active = r.val<uint8_t>() != 0;
        L.reason = r.str(1u << 12);
        L.d = r.val<int64_t>(); L.n_head_kv = r.val<int64_t>(); L.n_cent = r.val<int64_t>(); L.n_coarse = r.val<int64_t>();
        L.width = version >= 3 ? r.val<int64_t>() : L.d + 1;
        if (!parts.done(layer + " settings", r, err)) {
            return err;
        }
        const uint64_t max_n = uint64_t(1) << 36;
        const std::pair<const char *, std::vector<float> *> floats[] = { { " cluster table", &L.table },
                                                                         { " coarse table", &L.coarse_table } };
        const std::pair<const char *, std::vector<int32_t> *> ints[] = { { " cluster assignments", &L.assign },
                                                                         { " parent map", &L.parent } };
        // in the file's order: table, assignments, coarse table, parents
        for (int k = 0; k < 4; ++k) {
            const std::string name = layer + (k % 2 == 0 ? floats[k/2].first : ints[k/2].first);
            if (!parts.next(name, r, err)) {
                return err;
            }
            if (k % 2 == 0) {
                r.vec(*floats[k/2].second, max_n);
            } else {
                r.vec(*ints[k/2].second, max_n);
            }
            if (!parts.done(name, r, err)) {
                return err;
            }
        }
        if (il != kv.layers[ikv].il || L.d != hp.n_embd_head_k(il) || L.n_head_kv != hp.n_head_kv(il)) {
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
        if (L.active && !sqp::device_runs_op(kv.layers[ikv].k, kv.layers[ikv].v, L.d, hp.n_embd_head_v(il), hp.n_head(il),
                                             L.n_head_kv, L.n_coarse > 0)) {
            L.active = false;
            L.reason = "no ggml_centroid_attn kernel for this case on this device";
        }
    }
    if (version >= 2) {
        if (!parts.next("calibration query count", r, err)) {
            return err;
        }
        const uint32_t n_q = r.val<uint32_t>();
        if (!parts.done("calibration query count", r, err)) {
            return err;
        }
        for (uint32_t i = 0; i < n_q; ++i) {
            const std::string name = "calibration queries (entry " + std::to_string(i) + ")";
            if (!parts.next(name, r, err)) {
                return err;
            }
            const int32_t il = r.val<int32_t>();
            const float scale = r.val<float>();
            std::vector<float> q;
            r.vec(q, uint64_t(1) << 36);
            if (!parts.done(name, r, err)) {
                return err;
            }
            const squeeze_kv_layer * L = nullptr;
            for (uint32_t ikv = 0; ikv < n_layers; ++ikv) {
                L = (int32_t) kv.layers[ikv].il == il ? &st->layers[ikv] : L;
            }
            if (L == nullptr || il < 0 || (int64_t) q.size() !=
                    (int64_t) (st->n_prefix - st->n_clustered)*hp.n_head(il)*L->d) {
                return std::string(path) + " is truncated or damaged (calibration queries)";
            }
            st->calib_q[il] = std::move(q);
            st->calib_scale[il] = scale;
        }
    }
    if (version >= 4) {
        if (!parts.next("KV state record", r, err)) {
            return err;
        }
        rec.size = r.val<uint64_t>();
        const uint32_t n_parts = r.val<uint32_t>();
        uint64_t covered = 0;
        for (uint32_t i = 0; r.ok && i < n_parts && i < (1u << 20); ++i) {
            sqp::state_part part;
            part.name = r.str(256);
            part.offset = r.val<uint64_t>(); part.length = r.val<uint64_t>(); part.hash = r.val<uint64_t>();
            r.ok = r.ok && part.offset == covered && part.length <= rec.size - covered;
            covered += part.length;
            rec.parts.push_back(std::move(part));
        }
        r.ok = r.ok && rec.parts.size() == n_parts && covered == rec.size;
        if (!parts.done("KV state record", r, err)) {
            return err;
        }
        if (parts.at != file.size()) {
            return std::string(path) + " has bytes after its last part (damaged)";
        }
    }
    return "";
}

// Installs a parsed sidecar's prefix over seq_id's cells, which must hold it (its KV state loaded).
std::string sparq_squeeze_access::apply_sidecar(llama_context & ctx, llama_kv_cache & kv,
                                                const std::shared_ptr<squeeze_kv_state> & st, int32_t seq_id,
                                                const char * path) {
    st->generation = next_generation();
    st->seq_id = seq_id;
    std::string err = prefix_cells(kv, seq_id, st->n_clustered, st->n_clustered, false, st->stream, st->cells);
    if (!err.empty()) {
        return err + " (load the KV state of the prefix before its sidecar)";
    }
    kv.squeeze.reset();
    err = install(kv, *st);
    if (!err.empty()) {
        return err;
    }
    kv.squeeze = st;
    reset_graphs(ctx);
    LLAMA_LOG_INFO("%s: centroid-sparse prefix of sequence %d loaded from %s: %d tokens, keep %.3g\n", __func__, seq_id, path,
                   st->n_prefix, (double) st->params.keep);
    return "";
}

std::string sparq_squeeze_access::load(llama_context & ctx, int32_t seq_id, const char * path, const int32_t * tokens,
                                       int32_t n_tokens) {
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    std::vector<uint8_t> file;
    err = sqp::read_file(path, file);
    if (!err.empty()) {
        return err;
    }
    auto st = std::make_shared<squeeze_kv_state>();
    sqp::state_record rec;
    uint32_t version = 0;
    err = parse_sidecar(ctx, *kv, path, file, tokens, n_tokens, *st, rec, version);
    return err.empty() ? apply_sidecar(ctx, *kv, st, seq_id, path) : err;
}

std::string sparq_squeeze_access::load_files(llama_context & ctx, int32_t seq_id, const char * state_path,
                                             const char * sidecar_path, int32_t * tokens_out, size_t capacity,
                                             size_t * n_out) {
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    std::vector<uint8_t> sidecar, state;
    err = sqp::read_file(sidecar_path, sidecar);
    if (!err.empty()) {
        return err;
    }
    auto st = std::make_shared<squeeze_kv_state>();
    sqp::state_record rec;
    uint32_t version = 0;
    err = parse_sidecar(ctx, *kv, sidecar_path, sidecar, nullptr, 0, *st, rec, version);
    if (!err.empty()) {
        return err;
    }
    err = sqp::read_file(state_path, state);
    if (!err.empty()) {
        return err;
    }
    if (version < 4 || rec.parts.empty()) {
        // older formats carry no checksums, and llama_squeeze_save alone records no KV state: what the files hold
        // is still checked for layout and against each other's tokens, not for damage
        LLAMA_LOG_WARN("%s: %s records no checksums of %s (format %u%s): loaded unverified; save it again to add them\n",
                       __func__, sidecar_path, state_path, version, version < 4 ? "" : ", saved without its KV state");
        rec.size = state.size();
        rec.parts.clear();
    }
    err = sqp::verify_state(state_path, state, sidecar_path, rec, st->tokens);
    if (!err.empty()) {
        return err;
    }
    // both files verified: from here on the context changes
    err = sqp::load_state(&ctx, seq_id, state_path, state, tokens_out, capacity, n_out);
    if (err.empty()) {
        err = apply_sidecar(ctx, *kv, st, seq_id, sidecar_path);
    }
    if (!err.empty()) {
        *n_out = 0;
    }
    return err;
}
