// Loading a saved prefix's KV state (llama_squeeze_load_state_file): llama_state_seq_load_file checked first, and a
// state saved from a cache of one stream loaded into a context of one stream per sequence. Also the state file's
// parts and their checksums, which its sidecar records (llama_squeeze_save_files), checked before a load
// (llama_squeeze_load_files): the file is read once, verified, and the verified bytes are what is loaded.
//
// llama.cpp's sequence state file: magic, version, the token count and tokens, then the memory's state: one KV cache's
// state, or two for a sliding-window model (the full-attention layers' cache, then the windowed layers'). A cache's
// state begins with its stream count and holds one block per stream: a cell count, then the cells' positions and
// sequences (llama_kv_cache::state_write_meta) and K and V of every layer (state_write_data). llama.cpp's loader
// aborts on a file that ends early (GGML_ASSERT in llama_state_seq_load_file) and refuses another stream count than
// the context's; llama-completion and the Python API save from a cache of one stream, -np N without a unified cache
// makes N. A sequence's blocks are read into its own stream whichever block holds them, so a one-stream state loads
// into n streams once each count says n and n - 1 empty blocks follow. The in-memory form llama_state_seq_set_data
// reads has a prologue of its own before the memory's state: it is taken, with the stream count, from the state of
// the (empty) destination sequence.
#include "sparq-llama.h"
#include "sparq-squeeze.h"

#include "ggml.h"
#include "llama-impl.h"
#include "llama.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace {

// A reader of the state file's bytes from an offset up to its end that fails (rather than reads past the end) once
// anything is missing.
struct state_reader {
    const uint8_t * data;
    size_t          end;
    size_t          at;
    bool            ok = true;

    template <typename T> T get() {
        T v{};
        if (skip(sizeof(T))) {
            std::memcpy(&v, data + at - sizeof(T), sizeof(T));
        }
        return v;
    }
    bool skip(uint64_t bytes) {
        ok = ok && bytes <= end - at;
        at = ok ? at + (size_t) bytes : end;
        return ok;
    }
};

using sparq_squeeze_detail::state_part;

// The length of one stream's block of a cache's state read from r's position, with cells carrying `ext` bytes of
// extension (llama_kv_cell_ext: M-RoPE positions and token; 0 for other models). 0 when the bytes do not read as one.
// With parts, the block's parts are appended (named after `prefix`): its cells, then each layer's K and V.
size_t stream_block_size(state_reader r, size_t ext, const std::string & prefix, std::vector<state_part> * parts) {
    const size_t start = r.at;
    auto add = [&](std::string name, size_t from) {
        if (parts != nullptr) {
            parts->push_back({ prefix + name, from, r.at - from, 0 });
        }
    };
    const uint32_t n_cells = r.get<uint32_t>();
    if (!r.ok || n_cells == 0) {
        add("cells", start);
        return r.ok ? r.at - start : 0;
    }
    for (uint32_t i = 0; i < n_cells && r.ok; ++i) {
        r.get<int32_t>();  // position
        const uint32_t n_seq = r.get<uint32_t>();
        r.skip(ext + (uint64_t) n_seq*sizeof(int32_t));
    }
    const uint32_t v_trans = r.get<uint32_t>();
    const uint32_t n_layer = r.get<uint32_t>();
    if (!r.ok || v_trans > 1 || n_layer == 0 || n_layer > 4096) {
        return 0;
    }
    add("cells", start);
    for (uint32_t il = 0; il < 2*n_layer && r.ok; ++il) {  // K of every layer, then V of every layer
        const size_t from = r.at;
        const int32_t type = r.get<int32_t>();
        if (type < 0 || type >= GGML_TYPE_COUNT) {
            return 0;
        }
        if (il < n_layer || !v_trans) {
            const uint64_t row = r.get<uint64_t>();
            r.skip((uint64_t) n_cells*row);
        } else {  // V transposed: per row of V, one element per cell
            const uint32_t size_el = r.get<uint32_t>(), n_embd = r.get<uint32_t>();
            r.skip((uint64_t) n_cells*size_el*n_embd);
        }
        add("layer " + std::to_string(il % n_layer) + (il < n_layer ? " K" : " V"), from);
    }
    return r.ok ? r.at - start : 0;
}

// A cache's state in the file: its stream count and where each stream's block lies (offset, length).
struct cache_state {
    uint32_t n_stream = 0;
    std::vector<std::pair<size_t, size_t>> blocks;
};

// The file's memory state from at read as n_caches caches' states that end exactly at the file's end; with parts,
// their parts (the stream counts are counted with the following block's cells).
bool read_caches(const std::vector<uint8_t> & file, size_t at, size_t n_caches, std::vector<cache_state> & caches,
                 std::vector<state_part> * parts) {
    const size_t n_parts = parts != nullptr ? parts->size() : 0;
    for (const size_t ext : { (size_t) 0, (size_t) 12 }) {  // 12: sizeof(llama_kv_cell_ext) at the pinned version
        caches.assign(n_caches, cache_state{});
        if (parts != nullptr) {
            parts->resize(n_parts);
        }
        state_reader r{ file.data(), file.size(), at };
        bool ok = true;
        for (size_t ic = 0; ic < n_caches && ok; ++ic) {
            cache_state & c = caches[ic];
            const size_t count_at = r.at;
            c.n_stream = r.get<uint32_t>();
            ok = r.ok && c.n_stream >= 1 && c.n_stream <= 4096;
            for (uint32_t s = 0; ok && s < c.n_stream; ++s) {
                const std::string prefix = (n_caches > 1 ? "cache " + std::to_string(ic) + " " : std::string()) +
                                           (c.n_stream > 1 ? "stream " + std::to_string(s) + " " : std::string());
                const size_t first = parts != nullptr ? parts->size() : 0;
                const size_t len = stream_block_size(r, ext, prefix, parts);
                ok = len != 0 && r.skip(len);
                if (ok) {
                    c.blocks.emplace_back(r.at - len, len);
                    if (parts != nullptr && s == 0) {  // the stream count joins the first block's cells
                        (*parts)[first].length += (*parts)[first].offset - count_at;
                        (*parts)[first].offset = count_at;
                    }
                }
            }
        }
        if (ok && r.at == file.size()) {
            return true;
        }
    }
    if (parts != nullptr) {
        parts->resize(n_parts);
    }
    return false;
}

// The token count of a state file's header (magic, version, count), or a reason it has none.
std::string state_header(const char * path, const std::vector<uint8_t> & file, uint32_t & n_tokens) {
    uint32_t head[3] = {};
    if (file.size() < sizeof(head)) {
        return std::string(path) + " is not a sequence state file of this llama.cpp (magic or version)";
    }
    std::memcpy(head, file.data(), sizeof(head));
    if (head[0] != LLAMA_STATE_SEQ_MAGIC || head[1] != LLAMA_STATE_SEQ_VERSION) {
        return std::string(path) + " is not a sequence state file of this llama.cpp (magic or version)";
    }
    if ((file.size() - sizeof(head))/sizeof(int32_t) < head[2]) {
        return std::string(path) + " ends inside its token list";
    }
    n_tokens = head[2];
    return "";
}

// file's bytes are reused for the in-memory state where its layout allows (a KV state may be gigabytes).
std::string load_state_bytes(llama_context * ctx, int32_t seq_id, const char * path, std::vector<uint8_t> & file,
                             int32_t * tokens_out, size_t capacity, size_t * n_out) {
    uint32_t n_tokens = 0;
    std::string err = state_header(path, file, n_tokens);
    if (!err.empty()) {
        return err;
    }
    if (n_tokens > capacity) {
        return std::string(path) + " holds " + std::to_string(n_tokens) + " tokens, more than the context's " +
               std::to_string(capacity) + " per sequence";
    }
    // the destination sequence's state, read while it is empty: a prologue of two words, then per cache the stream
    // count and a cell count of 0 per stream
    llama_memory_seq_rm(llama_get_memory(ctx), seq_id, -1, -1);
    const size_t n_prologue = 2*sizeof(uint32_t);
    std::vector<uint8_t> empty(llama_state_seq_get_size(ctx, seq_id));
    if (empty.size() < n_prologue + sizeof(uint32_t) ||
        llama_state_seq_get_data(ctx, empty.data(), empty.size(), seq_id) != empty.size()) {
        return "cannot read the destination sequence's state";
    }
    uint32_t n_stream = 0;
    std::memcpy(&n_stream, empty.data() + n_prologue, sizeof(uint32_t));
    const size_t per_cache = (1 + (size_t) n_stream)*sizeof(uint32_t);
    const size_t n_caches = (empty.size() - n_prologue) / per_cache;
    const bool kv_layout = n_stream >= 1 && (n_caches == 1 || n_caches == 2) &&
                           empty.size() == n_prologue + n_caches*per_cache;
    const size_t at = 3*sizeof(uint32_t) + (size_t) n_tokens*sizeof(int32_t);
    std::memcpy(tokens_out, file.data() + 3*sizeof(uint32_t), (size_t) n_tokens*sizeof(int32_t));

    // the in-memory state: the prologue, then per cache the destination's stream count and the file's blocks (n_stream
    // - 1 empty blocks after a one-stream state's block); the file's state as is when the stream counts agree or for
    // another memory (recurrent, hybrid), the prologue then written over the header's last 8 bytes
    std::vector<uint8_t> state;
    std::vector<cache_state> caches;
    bool same = true;
    if (kv_layout) {
        if (!read_caches(file, at, n_caches, caches, nullptr)) {
            return std::string(path) + " does not read as a KV state of this model's cache to its end (damaged, cut "
                   "short, or saved from another model)";
        }
        same = caches[0].n_stream == n_stream;
        for (const cache_state & c : caches) {
            if ((c.n_stream == n_stream) != same || (!same && c.n_stream != 1)) {
                return std::string(path) + ": a state of " + std::to_string(c.n_stream) + " cache streams does not "
                       "load into a context of " + std::to_string(n_stream);
            }
        }
        if (!same) {
            state.assign(empty.begin(), empty.begin() + n_prologue);
            for (const cache_state & c : caches) {
                const uint8_t * count = reinterpret_cast<const uint8_t *>(&n_stream);
                state.insert(state.end(), count, count + sizeof(uint32_t));
                for (const auto & [offset, len] : c.blocks) {
                    state.insert(state.end(), file.begin() + offset, file.begin() + offset + len);
                }
                state.resize(state.size() + (n_stream - c.n_stream)*sizeof(uint32_t), 0);
            }
        }
    }
    const uint8_t * data = state.data();
    size_t size = state.size();
    if (state.empty()) {
        std::memcpy(file.data() + at - n_prologue, empty.data(), n_prologue);  // tokens_out holds the tokens already
        data = file.data() + at - n_prologue;
        size = file.size() - (at - n_prologue);
    }
    if (llama_state_seq_set_data(ctx, data, size, seq_id) != size) {
        return std::string("llama_state_seq_set_data failed on ") + path + " (another model, or more cells than the "
               "context holds; see the log)";
    }
    *n_out = n_tokens;
    if (!same) {
        LLAMA_LOG_INFO("%s: the saved state's one cache stream loaded into sequence %d's of %u\n", __func__, seq_id,
                       n_stream);
    }
    return "";
}

}  // namespace

namespace sparq_squeeze_detail {

// Four independent lanes of multiply-rotate over 8-byte words (so the multiplies overlap), folded together with the
// length, the last bytes mixed in one at a time, and a final avalanche so that every input bit reaches every output
// bit. Not cryptographic: it detects damage, not forgery.
uint64_t hash64(const void * data, size_t n) {
    constexpr uint64_t M1 = 0x9E3779B97F4A7C15ull, M2 = 0xBF58476D1CE4E5B9ull, M3 = 0x94D049BB133111EBull;
    auto rotl = [](uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
    auto word = [](const uint8_t * p) { uint64_t w; std::memcpy(&w, p, sizeof(w)); return w; };
    const uint8_t * p = static_cast<const uint8_t *>(data);
    uint64_t lane[4] = { M1, M2, M3, M1 ^ M2 };
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int j = 0; j < 4; ++j) {
            lane[j] = rotl(lane[j] ^ (word(p + i + 8*j)*M2), 29)*M1;
        }
    }
    uint64_t h = rotl(lane[0], 1) + rotl(lane[1], 9) + rotl(lane[2], 17) + rotl(lane[3], 25) + (uint64_t) n*M3;
    for (; i + 8 <= n; i += 8) {
        h = rotl(h ^ (word(p + i)*M2), 31)*M1;
    }
    for (; i < n; ++i) {
        h = (h ^ p[i])*0x100000001B3ull;
    }
    h ^= h >> 31; h *= M2; h ^= h >> 29; h *= M3; h ^= h >> 32;
    return h;
}

std::string read_file(const char * path, std::vector<uint8_t> & bytes) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        return std::string("cannot open ") + path;
    }
    in.seekg(0, std::ios::end);
    const std::streamoff size = in.tellg();
    in.seekg(0);
    bytes.resize(size > 0 ? (size_t) size : 0);
    if (size < 0 || !in.read(reinterpret_cast<char *>(bytes.data()), (std::streamsize) bytes.size())) {
        return std::string("cannot read ") + path;
    }
    return "";
}

std::vector<state_part> state_file_parts(const std::vector<uint8_t> & file) {
    std::vector<state_part> parts;
    uint32_t n_tokens = 0;
    if (!state_header("", file, n_tokens).empty()) {
        parts.push_back({ "contents", 0, file.size(), 0 });
    } else {
        const size_t at = 3*sizeof(uint32_t) + (size_t) n_tokens*sizeof(int32_t);
        parts.push_back({ "header and prefix tokens", 0, at, 0 });
        std::vector<cache_state> caches;
        if (!read_caches(file, at, 1, caches, &parts) && !read_caches(file, at, 2, caches, &parts)) {
            parts.push_back({ "memory state", at, file.size() - at, 0 });  // not KV caches (recurrent, hybrid)
        }
    }
    for (state_part & p : parts) {
        p.hash = hash64(file.data() + p.offset, p.length);
    }
    return parts;
}

std::string verify_state(const char * path, const std::vector<uint8_t> & file, const char * sidecar,
                         const state_record & rec, const std::vector<int32_t> & prefix) {
    uint32_t n_tokens = 0;
    std::string err = state_header(path, file, n_tokens);
    if (!err.empty()) {
        return err;
    }
    const int32_t * tokens = reinterpret_cast<const int32_t *>(file.data() + 3*sizeof(uint32_t));
    // a recorded pair holds the prefix exactly (llama_squeeze_save_files writes it so); an unrecorded one may go on
    const bool exact = !rec.parts.empty();
    if (n_tokens < prefix.size() || (exact && n_tokens != prefix.size()) ||
        !std::equal(prefix.begin(), prefix.end(), tokens)) {
        return std::string(path) + " holds other tokens than the prefix " + sidecar + " was saved with (not the pair "
               "saved together, or damaged)";
    }
    if (file.size() != rec.size) {
        return std::string(path) + " has " + std::to_string(file.size()) + " bytes where " + sidecar + " records " +
               std::to_string(rec.size) + " (cut short, extended, or not the KV state saved with it)";
    }
    for (const state_part & p : rec.parts) {
        if (hash64(file.data() + p.offset, p.length) != p.hash) {
            return std::string(path) + ": " + p.name + " checksum mismatch (file damaged, or not the KV state " +
                   sidecar + " was saved with)";
        }
    }
    return "";
}

std::string load_state(llama_context * ctx, int32_t seq_id, const char * path, std::vector<uint8_t> & file,
                       int32_t * tokens_out, size_t capacity, size_t * n_out) {
    return load_state_bytes(ctx, seq_id, path, file, tokens_out, capacity, n_out);
}

}  // namespace sparq_squeeze_detail

int32_t llama_squeeze_load_state_file(struct llama_context * ctx, int32_t seq_id, const char * path, int32_t * tokens_out,
                                      size_t n_token_capacity, size_t * n_token_out) {
    if (ctx == nullptr || path == nullptr || tokens_out == nullptr || n_token_out == nullptr || seq_id < 0) {
        return sparq_squeeze_result(__func__, "null argument or negative seq_id");
    }
    *n_token_out = 0;
    std::vector<uint8_t> file;
    std::string err = sparq_squeeze_detail::read_file(path, file);
    if (err.empty()) {
        err = load_state_bytes(ctx, seq_id, path, file, tokens_out, n_token_capacity, n_token_out);
    }
    return sparq_squeeze_result(__func__, err);
}
