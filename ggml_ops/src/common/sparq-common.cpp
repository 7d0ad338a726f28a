// sparq-llama: see sparq-common.h.
#include "sparq-common.h"

#include "log.h"
#include "sparq-llama.h"

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
