// sparq-llama: the command-line tools' side of centroid-sparse attention over a fixed prefix (--squeeze*), shared by
// llama-completion and llama-server (which llama-cli runs in-process). Compiled into llama-common.
#pragma once

#include "common.h"

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

    // A prompt reuses the prefix when it starts with the clustered tokens: the calibration tail after them is read
    // exactly, so it may differ (a token merged across the prefix's end) and is then evaluated again.
    bool matches(const llama_tokens & prompt) const;

    // Whether the prefix is still prepared in seq_id. Something that changed its cells (a context shift, a slot erase
    // or restore) drops it: then the slot is released for any prompt, with one warning.
    bool held(const llama_context * ctx);
};
