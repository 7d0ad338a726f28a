// sparq-llama: the --squeeze setup of llama-completion, llama-server and llama-cli, and the server slot holding the
// prefix (see sparq-squeeze-common.h).
#include "sparq-squeeze-common.h"

#include "chat.h"
#include "log.h"
#include "sparq-llama.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

// Progress of a start-up step that takes seconds (evaluating and clustering an 8k-token prefix on 2 cores takes about
// 24 s): one log line at each quarter of the work passed, with the time so far.
struct squeeze_progress_log {
    const char * what;
    int64_t      t0      = ggml_time_us();
    int          quarter = 0;

    explicit squeeze_progress_log(const char * what) : what(what) {}

    void update(double fraction, const std::string & detail = "") {
        const int q = std::min(4, (int) (fraction*4.0 + 1e-9));
        if (q <= quarter) {
            return;
        }
        quarter = q;
        LOG_INF("squeeze_prepare_prefix: %s the fixed prefix: %d%%%s, %.1f s\n", what, 25*q,
                detail.empty() ? "" : (" (" + detail + ")").c_str(), (ggml_time_us() - t0)/1e6);
    }
};

static bool squeeze_load_prefix(llama_context * ctx, const common_params & params, llama_seq_id seq_id,
                                std::vector<llama_token> & prefix) {
    prefix.resize(llama_n_ctx_seq(ctx));
    size_t n = 0;
    // both files verified before either is applied; the KV state's layout checked, a one-stream state loaded into
    // -np N's streams
    const std::string sidecar = params.squeeze_load + ".squeeze";
    if (llama_squeeze_load_files(ctx, seq_id, params.squeeze_load.c_str(), sidecar.c_str(), prefix.data(),
                                 prefix.size(), &n) != 0) {
        LOG_ERR("%s: failed to load the prepared prefix: %s\n", __func__, llama_squeeze_last_error());
        return false;
    }
    prefix.resize(n);
    LOG_INF("%s: loaded a prepared prefix of %zu tokens from '%s'\n", __func__, n, params.squeeze_load.c_str());
    const auto & args = params.squeeze_args;
    if (std::find(args.begin(), args.end(), "--squeeze-keep") != args.end()) {
        if (llama_squeeze_recalibrate(ctx, params.squeeze_params.keep, params.squeeze_params.keep_coarse) != 0) {
            LOG_ERR("%s: %s\n", __func__, llama_squeeze_last_error());
            return false;
        }
        const llama_squeeze_info info = llama_squeeze_get_info(ctx);
        LOG_INF("%s: set to keep %g (each row reads its best clusters up to that share of the clustered cells)\n",
                __func__, (double) info.keep);
    }
    return true;
}

// The system message as -sysf reads a file: one trailing newline dropped.
static std::string squeeze_system_text(std::string text) {
    if (!text.empty() && text.back() == '\n') {
        text.pop_back();
    }
    return text;
}

// --squeeze-chat: the tokens that every conversation starting with the system message `system` shares, as the
// server renders (the model's chat template or --chat-template) and tokenizes (special tokens parsed) a chat: the
// longest common prefix of conversations whose first user messages differ from their first character on.
static bool squeeze_chat_prefix(llama_context * ctx, const common_params & params, const std::string & system,
                                std::vector<llama_token> & prefix) {
    try {
        const common_chat_templates_ptr tmpls = common_chat_templates_init(llama_get_model(ctx), params.chat_template);
        bool first = true;
        for (const char * user : { "A", "z", "0", "?", " \n" }) {
            common_chat_templates_inputs in;
            in.use_jinja             = params.use_jinja;
            in.add_generation_prompt = true;
            in.chat_template_kwargs  = params.default_template_kwargs;
            common_chat_msg sys;
            sys.role    = "system";
            sys.content = system;
            common_chat_msg usr;
            usr.role    = "user";
            usr.content = user;
            in.messages = { sys, usr };
            const std::vector<llama_token> toks =
                common_tokenize(ctx, common_chat_templates_apply(tmpls.get(), in).prompt, true, true);
            if (first) {
                prefix = toks;
                first  = false;
                continue;
            }
            size_t n = 0;
            while (n < prefix.size() && n < toks.size() && prefix[n] == toks[n]) {
                ++n;
            }
            prefix.resize(n);
        }
    } catch (const std::exception & e) {
        LOG_ERR("%s: --squeeze-chat: the chat template cannot render the prefix as a system message: %s\n", __func__,
                e.what());
        return false;
    }
    return true;
}

static bool squeeze_prepare_prefix(llama_context * ctx, const common_params & params, llama_seq_id seq_id,
                                   std::vector<llama_token> & prefix) {
    std::ifstream f(params.squeeze_prefix_file, std::ios::binary);
    if (!f) {
        LOG_ERR("%s: cannot read --squeeze-prefix-file '%s'\n", __func__, params.squeeze_prefix_file.c_str());
        return false;
    }
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (!params.squeeze_chat) {
        prefix = common_tokenize(ctx, text, true, true);
    } else if (!squeeze_chat_prefix(ctx, params, squeeze_system_text(text), prefix)) {
        return false;
    }
    const int n_ctx_seq = (int) llama_n_ctx_seq(ctx);
    if (prefix.size() < 2 || (int) prefix.size() > n_ctx_seq - 4) {
        LOG_ERR("%s: the fixed prefix has %zu tokens: it needs at least 2 and must leave room for the prompt in the "
                "context (%d tokens per sequence)\n", __func__, prefix.size(), n_ctx_seq);
        return false;
    }
    LOG_INF("%s: evaluating the fixed prefix (%zu tokens)\n", __func__, prefix.size());
    const int n_batch = std::max(1, (int) llama_n_batch(ctx));
    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    bool ok = true;
    squeeze_progress_log eval_progress("evaluating");
    for (size_t i = 0; ok && i < prefix.size(); i += n_batch) {
        const int n = std::min((int) (prefix.size() - i), n_batch);
        batch.n_tokens = n;
        for (int j = 0; j < n; ++j) {
            batch.token[j]     = prefix[i + j];
            batch.pos[j]       = (llama_pos) (i + j);
            batch.n_seq_id[j]  = 1;
            batch.seq_id[j][0] = seq_id;
            batch.logits[j]    = j == n - 1;
        }
        ok = llama_decode(ctx, batch) == 0;
        eval_progress.update((double) (i + n)/(double) prefix.size(),
                             std::to_string(i + n) + " of " + std::to_string(prefix.size()) + " tokens");
    }
    llama_batch_free(batch);
    if (!ok) {
        LOG_ERR("%s: failed to evaluate the fixed prefix\n", __func__);
        return false;
    }
    const int64_t t0 = ggml_time_us();
    // the last quarter is the line that says it is prepared
    squeeze_progress_log prepare_progress("clustering");
    llama_squeeze_params sqp = params.squeeze_params;
    sqp.progress_callback = [](float f, void * user) {
        if (f < 1.0f) {
            static_cast<squeeze_progress_log *>(user)->update(f);
        }
        return true;
    };
    sqp.progress_callback_user_data = &prepare_progress;
    if (llama_squeeze_prepare(ctx, seq_id, prefix.data(), (int32_t) prefix.size(), &sqp) != 0) {
        LOG_ERR("%s: %s\n", __func__, llama_squeeze_last_error());
        return false;
    }
    const llama_squeeze_info info = llama_squeeze_get_info(ctx);
    LOG_INF("%s: prepared the fixed prefix in %.2f s (keep %g)\n", __func__, (ggml_time_us() - t0)/1e6,
            (double) info.keep);
    if (!params.squeeze_save.empty()) {
        const std::string sidecar = params.squeeze_save + ".squeeze";
        if (llama_squeeze_save_files(ctx, params.squeeze_save.c_str(), sidecar.c_str()) != 0) {
            LOG_ERR("%s: failed to save the prepared prefix to '%s' and '%s': %s\n", __func__,
                    params.squeeze_save.c_str(), sidecar.c_str(), llama_squeeze_last_error());
            return false;
        }
        LOG_INF("%s: saved the prepared prefix to '%s' and '%s'\n", __func__, params.squeeze_save.c_str(), sidecar.c_str());
    }
    return true;
}

bool common_squeeze_setup(llama_context * ctx, const common_params & params, llama_seq_id seq_id,
                          std::vector<llama_token> & prefix) {
    llama_memory_clear(llama_get_memory(ctx), true);
    const bool ok = params.squeeze_load.empty() ? squeeze_prepare_prefix(ctx, params, seq_id, prefix)
                                                : squeeze_load_prefix(ctx, params, seq_id, prefix);
    if (!ok) {
        return false;
    }
    if (llama_squeeze_set_prefill(ctx, params.squeeze_prefill) != 0) {
        LOG_ERR("%s: %s\n", __func__, llama_squeeze_last_error());
        return false;
    }
    return true;
}

// (its errors go to stderr directly, as the argument parser's do: the log's worker may not flush before the exit)
bool common_squeeze_cli_params(common_params & params) {
    if (!params.squeeze) {
        return true;
    }
    if (!params.squeeze_load.empty()) {
        if (params.system_prompt.empty()) {
            fprintf(stderr, "%s: llama-cli --squeeze-load needs the prepared document as the system prompt (-sysf FILE): the "
                    "chat then starts with the saved prefix\n", __func__);
            return false;
        }
        return true;
    }
    std::ifstream f(params.squeeze_prefix_file, std::ios::binary);
    if (!f) {
        fprintf(stderr, "%s: cannot read --squeeze-prefix-file '%s'\n", __func__, params.squeeze_prefix_file.c_str());
        return false;
    }
    const std::string system = squeeze_system_text(std::string((std::istreambuf_iterator<char>(f)),
                                                               std::istreambuf_iterator<char>()));
    if (!params.system_prompt.empty() && params.system_prompt != system) {
        fprintf(stderr, "%s: llama-cli takes --squeeze-prefix-file as the system prompt; -sys / -sysf give another one\n",
                __func__);
        return false;
    }
    params.system_prompt = system;
    params.squeeze_chat  = true;
    return true;
}

bool common_squeeze_slot::matches(const llama_tokens & prompt) const {
    return seq_id >= 0 && n_clustered > 0 && prompt.size() > (size_t) n_clustered &&
           std::equal(tokens.begin(), tokens.begin() + n_clustered, prompt.begin());
}

bool common_squeeze_slot::held(const llama_context * ctx) {
    if (seq_id < 0) {
        return false;
    }
    const llama_squeeze_info info = llama_squeeze_get_info(ctx);
    if (info.prepared && info.seq_id == seq_id && info.n_prefix == (int32_t) tokens.size()) {
        return true;
    }
    LOG_WRN("%s: the fixed prefix of sequence %d is no longer prepared (its cells changed); that slot now takes any "
            "prompt, and prompts that start with the prefix are evaluated in full until it is prepared again\n",
            __func__, seq_id);
    seq_id = -1;
    dropped = true;
    return false;
}

common_squeeze_slot::route common_squeeze_slot::choose(const std::vector<slot_view> & slots, int32_t id_slot,
                                                       const llama_tokens & home_tokens) const {
    route r;
    const slot_view * home = nullptr;
    for (const auto & v : slots) {
        home = v.id == seq_id ? &v : home;
    }
    if (home != nullptr && (id_slot == -1 || id_slot == seq_id) && !home->busy) {
        r.slot = seq_id;
        return r;
    }
    const slot_view * best = nullptr;
    for (const auto & v : slots) {
        if (v.id == seq_id || v.busy || (id_slot != -1 && v.id != id_slot)) {
            continue;
        }
        if (best == nullptr || v.lcp > best->lcp || (v.lcp == best->lcp && v.t_last_used < best->t_last_used)) {
            best = &v;
        }
    }
    if (best == nullptr) {
        return r;
    }
    if (best->lcp < (size_t) n_clustered || !best->sparse) {
        size_t n = 0;
        while (n < tokens.size() && n < home_tokens.size() && home_tokens[n] == tokens[n]) {
            ++n;
        }
        if (n < (size_t) n_clustered) {
            return r;  // not expected: the prefix's slot keeps the clustered cells while the prefix is held
        }
        r.n_share = n;
    }
    r.slot = best->id;
    return r;
}

std::string common_squeeze_slot::refusal(size_t n_slots, int32_t id_slot, bool serves) const {
    if (seq_id < 0 || serves || (n_slots > 1 && id_slot != seq_id)) {
        return "";
    }
    return string_format("slot %d holds the prepared fixed prefix (--squeeze) and takes only completions (with "
                         "cache_prompt) whose prompt, after the chat template, starts with its %zu tokens%s", seq_id,
                         tokens.size(), n_slots > 1 ? "" : "; with -np 2 or more, llama-server serves other prompts "
                         "in its other slots");
}
