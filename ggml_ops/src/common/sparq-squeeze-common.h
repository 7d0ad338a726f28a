// sparq-llama: the command-line tools' side of centroid-sparse attention over a fixed prefix (--squeeze*), shared by
// llama-completion and llama-server (which llama-cli runs in-process). Compiled into llama-common.
#pragma once

#include "common.h"

#include <string>
#include <vector>

// Evaluates --squeeze-prefix-file's text as seq_id and prepares it (saving it when --squeeze-save is given), or loads
// --squeeze-load into seq_id (recalibrating when --squeeze-keep is given), then applies --squeeze-prefill. The cache
// is cleared first and afterwards holds exactly the prefix, whose tokens come back in `prefix`. Logs the reason and
// returns false on failure.
bool common_squeeze_setup(llama_context * ctx, const common_params & params, llama_seq_id seq_id,
                          std::vector<llama_token> & prefix);

// llama-cli (which renders every prompt as a chat): --squeeze-prefix-file becomes the system prompt (-sys / -sysf
// may give the same text, no other) and the prefix its chat rendering (--squeeze-chat); --squeeze-load needs the
// system prompt given. Logs the reason and returns false on a conflict.
bool common_squeeze_cli_params(common_params & params);

// The prepared prefix a server slot holds: which prompts it can serve, and whether it is still prepared.
struct common_squeeze_slot {
    llama_seq_id             seq_id = -1;   // the slot's sequence; -1: no prefix held
    std::vector<llama_token> tokens;        // the prefix
    int32_t                  n_clustered = 0;
    bool                     dropped = false;  // held() saw the prefix dropped: the server prepares it again

    // A prompt reuses the prefix when it starts with the clustered tokens: the calibration tail after them is read
    // exactly, so it may differ (a token merged across the prefix's end) and is then evaluated again.
    bool matches(const llama_tokens & prompt) const;

    // Whether the prefix is still prepared in seq_id. Something that changed its cells (a context shift, a slot erase
    // or restore) drops it: then the slot is released for any prompt, with one warning, and `dropped` is set.
    bool held(const llama_context * ctx);

    // What the server's routing needs of one of its slots.
    struct slot_view {
        int32_t id;
        bool    busy;
        size_t  lcp;          // tokens the slot's cache has in common with the prompt
        int64_t t_last_used;
        bool    sparse;       // the slot reads the prefix sparsely now (llama_squeeze_seq_sparse)
    };
    struct route {
        int32_t slot    = -1;  // -1: the server's usual choice (a requested busy slot, or none free: the task waits)
        size_t  n_share = 0;   // > 0: first give the slot the first n_share cells of the prefix (seq_cp from seq_id)
    };

    // The slot for a prompt that matches(): the prefix's own slot when idle; else the idle slot whose cache matches the
    // prompt longest (the least recently used of equals), given the prefix's cells first when it holds fewer than the
    // clustered tokens or does not read them sparsely. home_tokens: the tokens the prefix's slot holds now (slot 0 only
    // ever removes cells after the clustered part). id_slot: a requested slot or -1.
    route choose(const std::vector<slot_view> & slots, int32_t id_slot, const llama_tokens & home_tokens) const;

    // Why a task that cannot use the prefix is refused ("" when another slot takes it): with one slot, or when it asks
    // for the prefix's slot.
    std::string refusal(size_t n_slots, int32_t id_slot, bool serves) const;
};
