// sparq-llama: see sparq-common.h.
#include "sparq-common.h"

#include "common.h"
#include "log.h"
#include "sparq-llama.h"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <vector>

static std::mutex  g_report_mutex;
static std::string g_last_report;

void common_sparq_report(const llama_context * ctx) {
    const int32_t n = llama_sparq_summary(ctx, nullptr, 0);
    if (n < 0) {
        return;
    }
    std::vector<char> buf((size_t) n + 1);
    llama_sparq_summary(ctx, buf.data(), buf.size());
    LOG_INF("%s\n", buf.data());
    std::lock_guard<std::mutex> lock(g_report_mutex);
    g_last_report = buf.data();
}

std::string common_sparq_last_report() {
    std::lock_guard<std::mutex> lock(g_report_mutex);
    return g_last_report;
}

// The name of enum value i in names (in the enum's order), "?" for a value outside it
template <size_t N>
static const char * enum_name(const char * const (&names)[N], int32_t i) {
    return i >= 0 && (size_t) i < N ? names[i] : "?";
}

std::string common_sparq_props(const common_params & params) {
    static const char * const means[]    = { "auto", "on", "off" };
    static const char * const policies[] = { "sparq", "exact", "window" };
    static const char * const indexes[]  = { "f16", "q8" };
    static const char * const selects[]  = { "q", "qsigma" };
    static const char * const groups[]   = { "max", "mean" };
    static const char * const inits[]    = { "even", "kpp" };
    static const char * const prefills[] = { "auto", "sparse", "dense" };
    const llama_sparq_params & sp = params.sparq;
    const llama_squeeze_params & sq = params.squeeze_params;
    nlohmann::ordered_json j = {
        { "sparq", {
            { "enabled",  sp.enabled },
            { "k1",       sp.k1 },
            { "k2",       sp.k2 },
            { "window",   sp.window },
            { "sinks",    sp.sinks },
            { "mean",     enum_name(means, sp.mean) },
            { "policy",   enum_name(policies, sp.policy) },
            { "index",    enum_name(indexes, sp.index) },
            { "select",   enum_name(selects, sp.select) },
            { "min_n_kv", sp.min_n_kv },
            { "summary",  common_sparq_last_report() },
        } },
        { "squeeze", {
            { "enabled",     params.squeeze },
            { "prefix_file", params.squeeze_prefix_file },
            { "loaded_from", params.squeeze_load },
            { "keep",        sq.keep },
            { "centroids",   sq.centroids },
            { "levels",      sq.levels },
            { "var_weight",  sq.var_weight },
            { "group",       enum_name(groups, sq.group) },
            { "init",        enum_name(inits, sq.init) },
            { "prefill",     enum_name(prefills, params.squeeze_prefill) },
        } },
    };
    return j.dump();
}

int common_sparq_parse_int(const std::string & value) {
    const char * s = value.c_str();
    char * end = nullptr;
    errno = 0;
    const long v = std::strtol(s, &end, 10);
    if (value.empty() || end == s || *end != '\0') {
        throw std::invalid_argument("expected an integer, got '" + value + "'");
    }
    if (errno == ERANGE || v < INT_MIN || v > INT_MAX) {
        throw std::invalid_argument("'" + value + "' is out of range for an integer");
    }
    return (int) v;
}

float common_sparq_parse_float(const std::string & value) {
    const char * s = value.c_str();
    char * end = nullptr;
    const float f = std::strtof(s, &end);
    if (value.empty() || end == s || *end != '\0' || !std::isfinite(f)) {
        throw std::invalid_argument("expected a number, got '" + value + "'");
    }
    return f;
}

// The settings of the living common_sparq_fit_scope. Fitting runs on the thread that loads the model, before any
// context exists, and is not thread safe itself (it swaps the global log callback); a mutex keeps this consistent.
static std::mutex          g_fit_mutex;
static bool                g_fit_active = false;
static std::string         g_fit_path_model;
static llama_sparq_params  g_fit_sparq = {};

common_sparq_fit_scope::common_sparq_fit_scope(const std::string & path_model, const llama_sparq_params & sparq) {
    std::lock_guard<std::mutex> lock(g_fit_mutex);
    GGML_ASSERT(!g_fit_active && "common_sparq_fit_scope does not nest");
    g_fit_active     = true;
    g_fit_path_model = path_model;
    g_fit_sparq      = sparq;
}

common_sparq_fit_scope::~common_sparq_fit_scope() {
    std::lock_guard<std::mutex> lock(g_fit_mutex);
    g_fit_active = false;
    g_fit_path_model.clear();
}

void common_sparq_fit_probe(llama_context * ctx, const char * path_model, const llama_context_params & cparams) {
    llama_sparq_params sparq;
    {
        std::lock_guard<std::mutex> lock(g_fit_mutex);
        if (!g_fit_active || !g_fit_sparq.enabled || path_model == nullptr || g_fit_path_model != path_model ||
            cparams.ctx_type != LLAMA_CONTEXT_TYPE_DEFAULT) {
            return;
        }
        sparq = g_fit_sparq;
    }
    GGML_ASSERT(ctx != nullptr);
    if (llama_set_sparq(ctx, &sparq) != 0) {
        // the context the tool creates next gets the same settings and fails with the same reason
        LOG_WRN("%s: fitting to device memory without SparQ's derived KV state: %s\n", __func__, llama_sparq_last_error());
    }
}
