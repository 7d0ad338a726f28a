// sparq-llama: the command-line tools' side of SparQ (--sparq*), shared by every common-based tool. Compiled into
// llama-common.
#pragma once

#include "llama.h"
#include "sparq-llama.h"

#include <string>

// Logs what the context runs (llama_sparq_summary: SparQ on or off, in how many layers, why the others stay dense,
// below how many cells) at the tools' default verbosity, and keeps the line for llama-cli's banner (llama-cli shows
// only errors of the log by default).
void common_sparq_report(const llama_context * ctx);

// The line common_sparq_report logged last in this process ("" when none did).
std::string common_sparq_last_report();

// The SparQ and centroid-sparse settings of the tools' parameters as one JSON object's text (llama-server's /props):
// {"sparq": {"enabled", "k1" (0: by the index), "k2", "window", "sinks", "mean", "policy", "index", "select",
// "min_n_kv" (-1: the measured defaults), "summary": what the context runs (the line common_sparq_report logged)},
// "squeeze": {"enabled", "prefix_file", "loaded_from", "keep", "centroids", "levels", "var_weight", "group",
// "init", "prefill"}}.
struct common_params;
std::string common_sparq_props(const common_params & params);

// An integer option's value: the whole string must be a decimal integer in int's range; otherwise
// std::invalid_argument saying what was expected and what was given (the parser names the option).
int common_sparq_parse_int(const std::string & value);

// The same for a floating-point value.
float common_sparq_parse_float(const std::string & value);

// llama.cpp's parameter fitting (-fit, common/fit.cpp) measures device memory with contexts it creates itself, on a
// model loaded without allocating (no_alloc). While a common_sparq_fit_scope lives, those contexts of its model (the
// main model's, not a draft's) get its SparQ settings (llama_set_sparq) before they are measured, so that the
// fitted context leaves room for SparQ's derived KV state (the index, the V sums, the key statistics) and its graphs.
// Scopes do not nest.
struct common_sparq_fit_scope {
    common_sparq_fit_scope(const std::string & path_model, const llama_sparq_params & sparq);
    ~common_sparq_fit_scope();
    common_sparq_fit_scope(const common_sparq_fit_scope &) = delete;
    common_sparq_fit_scope & operator=(const common_sparq_fit_scope &) = delete;
};

// fit.cpp's hook, right after it creates a measuring context: applies the scope's settings when the context is of the
// scope's model (path_model) and of the default type; otherwise (no scope, SparQ off, a draft or MTP context) nothing.
void common_sparq_fit_probe(llama_context * ctx, const char * path_model, const llama_context_params & cparams);
