/* LD_PRELOAD helper for the device machine (no gdb there): on SIGSEGV/SIGABRT/SIGBUS print the native call stack
 * (shared-library symbols and offsets) to stderr, then die with the signal as before.
 * Build: cc -shared -fPIC -O1 -o /tmp/segv_backtrace.so bench/tools/segv_backtrace.c
 * Use:   LD_PRELOAD=/tmp/segv_backtrace.so python3 ...
 * Offsets of hidden symbols resolve with `addr2line -f -C -e LIB 0xOFFSET` on a build with symbols. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char alt_stack[1 << 16];

static void on_fatal_signal(int sig) {
    static const char head[] = "\n=== segv_backtrace: fatal signal, native stack:\n";
    void * frames[64];
    const int n_frames = backtrace(frames, 64);
    if (write(STDERR_FILENO, head, sizeof(head) - 1) < 0) { /* nothing to do: stderr is gone */ }
    backtrace_symbols_fd(frames, n_frames, STDERR_FILENO);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install_handlers(void) {
    stack_t ss = { .ss_sp = alt_stack, .ss_size = sizeof(alt_stack), .ss_flags = 0 };
    sigaltstack(&ss, NULL);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_fatal_signal;
    sa.sa_flags = SA_ONSTACK;
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
    sigaction(SIGABRT, &sa, NULL);
}
