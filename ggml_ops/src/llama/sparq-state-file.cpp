// Loading a saved prefix's KV state (llama_squeeze_load_state_file): llama_state_seq_load_file checked first, and a
// state saved from a cache of one stream loaded into a context of one stream per sequence.
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

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace {

// A reader of the state file from a byte offset up to its end that fails (rather than reads past the end) once
// anything is missing; skipped bytes are not read (the stream seeks only over them, so the cells' many small fields
// are read through the stream's buffer).
struct state_reader {
    std::ifstream * in;
    size_t          end;
    size_t          at;
    bool            ok     = true;
    size_t          in_pos = SIZE_MAX;  // where the stream is (SIZE_MAX: unknown)

    template <typename T> T get() {
        T v{};
        if (skip(sizeof(T))) {
            const size_t from = at - sizeof(T);
            if (in_pos != from) {
                in->clear();
                in->seekg((std::streamoff) from);
            }
            ok = (bool) in->read(reinterpret_cast<char *>(&v), sizeof(T));
            in_pos = ok ? at : SIZE_MAX;
        }
        return v;
    }
    bool skip(uint64_t bytes) {
        ok = ok && bytes <= end - at;
        at = ok ? at + (size_t) bytes : end;
        return ok;
    }
};

// The length of one stream's block of a cache's state read from r's position, with cells carrying `ext` bytes of
// extension (llama_kv_cell_ext: M-RoPE positions and token; 0 for other models). 0 when the bytes do not read as one.
size_t stream_block_size(state_reader r, size_t ext) {
    const size_t start = r.at;
    const uint32_t n_cells = r.get<uint32_t>();
    if (!r.ok || n_cells == 0) {
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
    for (uint32_t il = 0; il < 2*n_layer && r.ok; ++il) {  // K of every layer, then V of every layer
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
    }
    return r.ok ? r.at - start : 0;
}

// A cache's state in the file: its stream count and where each stream's block lies (offset, length).
struct cache_state {
    uint32_t n_stream = 0;
    std::vector<std::pair<size_t, size_t>> blocks;
};

// The file's memory state [at, end) read as n_caches caches' states that end exactly at the file's end.
bool read_caches(std::ifstream & in, size_t at, size_t end, size_t n_caches, std::vector<cache_state> & caches) {
    for (const size_t ext : { (size_t) 0, (size_t) 12 }) {  // 12: sizeof(llama_kv_cell_ext) at the pinned version
        caches.assign(n_caches, cache_state{});
        state_reader r{ &in, end, at };
        bool ok = true;
        for (cache_state & c : caches) {
            c.n_stream = r.get<uint32_t>();
            ok = r.ok && c.n_stream >= 1 && c.n_stream <= 4096;
            for (uint32_t s = 0; ok && s < c.n_stream; ++s) {
                const size_t len = stream_block_size(r, ext);
                r.in_pos = SIZE_MAX;  // the copy that measured the block moved the stream
                ok = len != 0 && r.skip(len);
                if (ok) {
                    c.blocks.emplace_back(r.at - len, len);
                }
            }
            if (!ok) {
                break;
            }
        }
        if (ok && r.at == end) {
            return true;
        }
    }
    return false;
}

std::string load_state_file(llama_context * ctx, int32_t seq_id, const char * path, int32_t * tokens_out,
                            size_t capacity, size_t * n_out) {
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

    std::ifstream in(path, std::ios::binary);
    if (!in) {
        return std::string("cannot open ") + path;
    }
    uint32_t head[3] = {};
    if (!in.read(reinterpret_cast<char *>(head), sizeof(head)) || head[0] != LLAMA_STATE_SEQ_MAGIC ||
        head[1] != LLAMA_STATE_SEQ_VERSION) {
        return std::string(path) + " is not a sequence state file of this llama.cpp (magic or version)";
    }
    if (head[2] > capacity) {
        return std::string(path) + " holds " + std::to_string(head[2]) + " tokens, more than the context's " +
               std::to_string(capacity) + " per sequence";
    }
    if (!in.read(reinterpret_cast<char *>(tokens_out), (std::streamsize) (head[2]*sizeof(int32_t)))) {
        return std::string(path) + " ends inside its token list";
    }
    if (!kv_layout) {
        // another memory (recurrent, hybrid): its state's layout is not read here; llama.cpp loads it
        return llama_state_seq_load_file(ctx, path, seq_id, tokens_out, capacity, n_out) != 0 ? ""
               : std::string("llama_state_seq_load_file failed on ") + path + " (see the log)";
    }
    const size_t at = (size_t) in.tellg();
    in.seekg(0, std::ios::end);
    const size_t end = (size_t) in.tellg();
    std::vector<cache_state> caches;
    if (!read_caches(in, at, end, n_caches, caches)) {
        return std::string(path) + " does not read as a KV state of this model's cache to its end (damaged, cut "
               "short, or saved from another model)";
    }
    const bool same = caches[0].n_stream == n_stream;
    for (const cache_state & c : caches) {
        if ((c.n_stream == n_stream) != same || (!same && c.n_stream != 1)) {
            return std::string(path) + ": a state of " + std::to_string(c.n_stream) + " cache streams does not load "
                   "into a context of " + std::to_string(n_stream);
        }
    }
    // the prologue, then per cache: the destination's stream count and the file's blocks (n_stream - 1 empty blocks
    // after a one-stream state's block)
    size_t size = n_prologue;
    for (const cache_state & c : caches) {
        size += sizeof(uint32_t);
        for (const auto & b : c.blocks) {
            size += b.second;
        }
        size += (n_stream - c.n_stream)*sizeof(uint32_t);
    }
    std::vector<uint8_t> state(size, 0);
    std::memcpy(state.data(), empty.data(), n_prologue);
    size_t pos = n_prologue;
    for (const cache_state & c : caches) {
        std::memcpy(state.data() + pos, &n_stream, sizeof(uint32_t));
        pos += sizeof(uint32_t);
        for (const auto & [offset, len] : c.blocks) {
            in.clear();
            in.seekg((std::streamoff) offset);
            if (!in.read(reinterpret_cast<char *>(state.data() + pos), (std::streamsize) len)) {
                return std::string("cannot read ") + path;
            }
            pos += len;
        }
        pos += (n_stream - c.n_stream)*sizeof(uint32_t);
    }
    if (llama_state_seq_set_data(ctx, state.data(), state.size(), seq_id) != state.size()) {
        return std::string("llama_state_seq_set_data failed on ") + path + " (another model, or more cells than the "
               "context holds; see the log)";
    }
    *n_out = head[2];
    if (!same) {
        LLAMA_LOG_INFO("%s: the saved state's one cache stream loaded into sequence %d's of %u\n", __func__, seq_id,
                       n_stream);
    }
    return "";
}

}  // namespace

int32_t llama_squeeze_load_state_file(struct llama_context * ctx, int32_t seq_id, const char * path, int32_t * tokens_out,
                                      size_t n_token_capacity, size_t * n_token_out) {
    if (ctx == nullptr || path == nullptr || tokens_out == nullptr || n_token_out == nullptr || seq_id < 0) {
        return sparq_squeeze_result(__func__, "null argument or negative seq_id");
    }
    *n_token_out = 0;
    return sparq_squeeze_result(__func__, load_state_file(ctx, seq_id, path, tokens_out, n_token_capacity, n_token_out));
}
