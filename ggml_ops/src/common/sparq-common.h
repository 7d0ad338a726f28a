// sparq-llama: the command-line tools' side of SparQ (--sparq*), shared by every common-based tool. Compiled into
// llama-common.
#pragma once

#include "llama.h"

#include <string>

// Logs what the context runs (llama_sparq_summary: SparQ on or off, in how many layers, why the others stay dense,
// below how many cells) at the tools' default verbosity, and keeps the line for llama-cli's banner (llama-cli shows
// only errors of the log by default).
void common_sparq_report(const llama_context * ctx);

// The line common_sparq_report logged last in this process ("" when none did).
std::string common_sparq_last_report();

// An integer option's value: the whole string must be a decimal integer in int's range; otherwise
// std::invalid_argument saying what was expected and what was given (the parser names the option).
int common_sparq_parse_int(const std::string & value);

// The same for a floating-point value.
float common_sparq_parse_float(const std::string & value);
