"""The main job: dense vs SparQ decoding on the default model after a long prompt of real text.

One model load; rounds of two runs on the same prompt, greedy, each from an empty KV cache (the prompt is
prefilled again, densely, before each run). Only the decode steps are timed (llama.cpp's own perf counters, reset
after the prefill), so the tokens/s compare what SparQ changes: how much of the KV cache a decode step reads.

Measuring honestly on a shared machine:
- the rounds interleave the two sides (dense then SparQ, then SparQ then dense, ...), so a slow spell of the
  machine falls on both; the report gives each side's median and range, and the speedup's range over the rounds;
- threads: by default as many as there are cores not busy (cores minus the 1-minute load average before the run,
  at least 1), since on a loaded machine threads beyond the free cores wait on each other at every step;
- OMP_WAIT_POLICY=PASSIVE unless the user set it: ggml's OpenMP threads otherwise spin while they wait, which on a
  busy 2-core machine slowed every step 100-500x;
- a warning when the machine was busy (load beyond the cores the demo leaves to others) or a side's rates spread
  by more than SPREAD_WARN over the rounds.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field

from . import models, texts
from .shape import AttentionShape, attention_shape
from .sparq import DEFAULT_INDEX, DEFAULT_SELECT, INDEXES, SELECTS, check_q4_k1, default_k1, transfer_ratio

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    model: str = models.DEFAULT_MODEL
    text: str = "hamlet_gut"        # a work from sparq_llama.texts
    prompt_tokens: int = 6000       # length of the long prompt (SmolLM2 was trained at 8k)
    max_tokens: int = 64            # tokens to generate per run
    n_ctx: int = 8192               # must hold prompt + generation
    n_threads: int | None = None    # None: the cores not busy (choose_threads)
    repeats: int = 3                # interleaved rounds of a dense and a SparQ run
    seed: int = 1234
    k1: int | None = 16             # query components for SparQ's approximate scores; None: by the index (q4: None
                                    # or head_dim, every component)
    k2: int = 128                   # KV cells kept per head and decode step
    index: str | None = None        # SparQ's key index, "f16", "q8" or "q4"; None: the library's default
    select: str = DEFAULT_SELECT    # how the k1 components are chosen, "q" or "qsigma"

    def check(self) -> None:
        """ValueError if the settings cannot work (before anything is loaded)."""
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {self.n_threads}")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"prompt_tokens and max_tokens must be >= 1, got {self.prompt_tokens}, {self.max_tokens}")
        if self.prompt_tokens + self.max_tokens > self.n_ctx:
            raise ValueError(f"prompt_tokens + max_tokens = {self.prompt_tokens + self.max_tokens} "
                             f"> n_ctx = {self.n_ctx}")
        if (self.k1 is not None and self.k1 < 1) or self.k2 < 1:
            raise ValueError(f"k1 and k2 must be >= 1, got k1={self.k1}, k2={self.k2}")
        if self.index is not None and self.index not in INDEXES:
            raise ValueError(f"index must be one of {', '.join(INDEXES)}, got {self.index!r}")
        if self.select not in SELECTS:
            raise ValueError(f"select must be one of {', '.join(SELECTS)}, got {self.select!r}")


@dataclass
class RunResult:
    """One generation: dense or SparQ."""

    label: str
    tokens: list[int]
    text: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)


SPREAD_WARN = 0.10  # a side's (max - min) / median decode rate over the rounds above which the report warns


@dataclass
class Machine:
    """How the demo ran on the machine: cores, the threads and why, the wait policy, the load it saw."""

    cores: int = 0                  # 0: not known (no busy check)
    threads_reason: str = ""
    wait_policy: str = ""           # the OMP_WAIT_POLICY the run had, and who set it
    load_before: float = 0.0        # 1-minute load average before the run
    load_max: float = 0.0           # its largest value after a round (our own threads included)


@dataclass
class DemoResult:
    prompt_tokens: int
    shape: AttentionShape
    k1: int
    k2: int
    n_threads: int
    dense: RunResult                # the first round's runs (their texts are the report's)
    sparq: RunResult
    prompt_tail: str = ""           # the last lines of the prompt, to read the continuations against
    index: str = DEFAULT_INDEX      # the SparQ run's key index and selection, as llama.cpp held them
    select: str = DEFAULT_SELECT
    dense_rates: list[float] = field(default_factory=list)  # decode tokens/s per round (empty: the one run's)
    sparq_rates: list[float] = field(default_factory=list)
    machine: Machine = field(default_factory=Machine)

    def rates(self, side: str) -> list[float]:
        run = self.dense if side == "dense" else self.sparq
        return (self.dense_rates if side == "dense" else self.sparq_rates) or [run.decode_tokens_per_s]

    @property
    def speedup(self) -> float:
        """SparQ's median decode tokens/s over dense's."""
        return statistics.median(self.rates("sparq")) / statistics.median(self.rates("dense"))

    @property
    def round_speedups(self) -> list[float]:
        """SparQ over dense within each round (the two runs of a round share the machine's state)."""
        return [s / d for s, d in zip(self.rates("sparq"), self.rates("dense"))]

    @property
    def warnings(self) -> list[str]:
        return measurement_warnings(self.rates("dense"), self.rates("sparq"), self.machine.load_before,
                                    self.machine.load_max, self.n_threads, self.machine.cores)

    @property
    def transfer_ratio(self) -> float:
        """Dense / SparQ KV bytes read per decode step at n_kv = prompt length, with the run's index (mean
        reallocation off for GQA, as SparQ does by default)."""
        return transfer_ratio(self.prompt_tokens, self.shape.head_dim, self.k1, self.k2, mean=not self.shape.gqa,
                              index=self.index)

    @property
    def agreeing_tokens(self) -> int:
        """How many leading generated tokens the two runs share."""
        n = 0
        for a, b in zip(self.dense.tokens, self.sparq.tokens):
            if a != b:
                break
            n += 1
        return n


def spread(rates: list[float]) -> float:
    """(max - min) / median of a side's rates: 0 for one run."""
    return (max(rates) - min(rates)) / statistics.median(rates) if len(rates) > 1 else 0.0


def measurement_warnings(dense: list[float], sparq: list[float], load_before: float, load_max: float,
                         n_threads: int, cores: int) -> list[str]:
    """Why the measured speedup may not be the machine's: other work on the cores the demo used (the load before
    the run, or during it less the demo's own threads, beyond the cores the demo left free, with half a core of
    slack), or a side whose rates spread by more than SPREAD_WARN over the rounds."""
    out = []
    free = cores - n_threads + 0.5
    others = max(load_before, load_max - n_threads)
    if cores > 0 and others > free:
        out.append(f"the machine was busy: other work's load about {others:.1f} on {cores} cores while the demo used "
                   f"{n_threads} thread(s); the rates are the shared machine's, and the speedup can be far from an "
                   f"idle one's")
    for name, rates in (("dense", dense), ("SparQ", sparq)):
        if spread(rates) > SPREAD_WARN:
            out.append(f"{name}'s decode rate spread by {100 * spread(rates):.0f}% over {len(rates)} rounds "
                       f"(more than {100 * SPREAD_WARN:.0f}%): the machine's speed changed during the run")
    if len(dense) < 2:
        out.append("one round only: no spread measured (--repeats 3 or more)")
    return out


def choose_threads(requested: int | None, cores: int, load: float) -> tuple[int, str]:
    """The threads to use and why: the user's number, else the cores not busy (cores minus the 1-minute load
    average, rounded, at least 1)."""
    if requested is not None:
        return requested, "as asked"
    n = max(1, min(cores, round(cores - load)))
    return n, f"the cores not busy: {cores} cores, load average {load:.2f} before the run"


def wait_policy(env: dict) -> str:
    """Sets OMP_WAIT_POLICY=PASSIVE in env unless it is set; what the run has. OpenMP reads it when its runtime
    starts, so this must run before llama.cpp's libraries are loaded (see _openmp_started)."""
    if env.get("OMP_WAIT_POLICY"):
        return f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} (as set)"
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return "OMP_WAIT_POLICY=PASSIVE (set by the demo: waiting threads sleep instead of spinning)"


def _openmp_started() -> bool:
    """Whether an OpenMP runtime is already in this process (Linux; False where that cannot be read)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line or "libomp" in line for line in f)
    except OSError:
        return False


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not on this platform
        return 0.0


def build_prompt(llm, cfg: DemoConfig) -> list[int]:
    """The first `prompt_tokens` tokens of the text (BOS first)."""
    body = llm.tokenize(texts.read(cfg.text).encode(), add_bos=True)
    if len(body) < cfg.prompt_tokens:
        raise ValueError(f"{cfg.text} has only {len(body)} tokens; asked for {cfg.prompt_tokens}")
    return body[: cfg.prompt_tokens]


def _per_s(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else float("nan")


def _clear_kv(llm) -> None:
    """Empty the KV cache and llama-cpp-python's token history, so the next eval starts from nothing."""
    from llama_cpp import llama_cpp as lc

    llm.reset()
    mem = lc.llama_get_memory(llm.ctx)
    if mem is not None:
        lc.llama_memory_clear(mem, True)


def generate(llm, prompt: list[int], max_tokens: int, label: str) -> RunResult:
    """Prefill `prompt` into an empty cache, then greedy-decode up to `max_tokens` tokens.

    Every generated token is decoded (max_tokens decode steps, as llama-bench's -n); the decode rate is llama.cpp's
    perf counters over those steps alone (reset after the prefill), the prefill rate its wall time."""
    from llama_cpp import llama_cpp as lc

    _clear_kv(llm)
    log.info("%s: prefilling %d tokens", label, len(prompt))
    # wall time: llama.cpp's perf counters do not time a prompt that fits one ubatch (500 tokens read as 10 us)
    t0 = time.perf_counter()
    llm.eval(prompt)
    lc.llama_synchronize(llm.ctx)
    prefill = _per_s(len(prompt), 1e3 * (time.perf_counter() - t0))

    log.info("%s: decoding %d tokens", label, max_tokens)
    vocab = lc.llama_model_get_vocab(llm.model)
    lc.llama_perf_context_reset(llm.ctx)
    out: list[int] = []
    for _ in range(max_tokens):
        tok = llm.sample(top_k=1, temp=0.0)
        if lc.llama_vocab_is_eog(vocab, tok):
            break
        out.append(tok)
        llm.eval([tok])
    lc.llama_synchronize(llm.ctx)  # the perf counters count a step when its result is awaited
    perf = lc.llama_perf_context(llm.ctx)
    if perf.n_eval != len(out):
        log.warning("%s: llama.cpp timed %d decode steps for %d tokens", label, perf.n_eval, len(out))
    text = llm.detokenize(out, prev_tokens=prompt).decode("utf-8", errors="replace")
    return RunResult(label=label, tokens=out, text=text, prefill_tokens_per_s=prefill,
                     decode_tokens_per_s=_per_s(perf.n_eval, perf.t_eval_ms))


def run(cfg: DemoConfig) -> DemoResult:
    """Load the model once, then rounds of a dense and a SparQ generation from the same prompt."""
    cfg.check()
    # before llama.cpp's libraries load (importing .llama does), or OpenMP has read its environment already
    started = _openmp_started()
    policy = wait_policy(os.environ)
    if started and "set by the demo" in policy:
        policy = "OMP_WAIT_POLICY unset: OpenMP had started before the demo could set it (threads may spin)"
    from .llama import Llama

    path = models.fetch(cfg.model)
    cores = os.cpu_count() or 1
    load_before = _load()
    n_threads, reason = choose_threads(cfg.n_threads, cores, load_before)
    machine = Machine(cores=cores, threads_reason=reason, wait_policy=policy, load_before=load_before,
                      load_max=load_before)
    if not hasattr(Llama, "set_sparq"):
        raise RuntimeError("this build of sparq-llama has no SparQ in llama.cpp's decode path "
                           "(Llama.set_sparq is missing); rebuild with `make install`")
    # Dense first; the SparQ settings are stored now and switched on later with set_sparq. Flash attention
    # in both runs: SparQ needs it, and the dense baseline is then llama.cpp's fastest path.
    llm = Llama(str(path), n_ctx=cfg.n_ctx, n_batch=512, flash_attn=True, seed=cfg.seed,
                n_threads=n_threads, verbose=False, sparq=False, k1=None if cfg.index == "q4" else cfg.k1, k2=cfg.k2,
                index=cfg.index,
                select=cfg.select)
    try:
        shape = attention_shape(llm)
        index = llm.sparq.index
        k1 = cfg.k1 if cfg.k1 is not None else default_k1(shape.head_dim, index)
        if index == "q4":  # every component: the settings hold k1 = 0 (head_dim), the report the head dim
            check_q4_k1(k1, shape.head_dim)
        sparq_k1 = None if index == "q4" else k1
        prompt = build_prompt(llm, cfg)
        tail = llm.detokenize(prompt[-48:], prev_tokens=prompt[:-48]).decode("utf-8", errors="replace")

        runs: dict[str, list[RunResult]] = {"dense": [], "sparq": []}
        held = llm.set_sparq(enabled=True, k1=sparq_k1, k2=cfg.k2)
        label = f"SparQ k1={k1} k2={cfg.k2} index={held.index} select={held.select}"
        for i in range(cfg.repeats):
            for side in ("dense", "sparq") if i % 2 == 0 else ("sparq", "dense"):
                llm.set_sparq(enabled=side == "sparq", k1=sparq_k1, k2=cfg.k2)
                name = f"round {i + 1}/{cfg.repeats}: " + ("dense" if side == "dense" else label)
                runs[side].append(generate(llm, prompt, cfg.max_tokens, name))
            machine.load_max = max(machine.load_max, _load())
        llm.set_sparq(enabled=False)
    finally:
        llm.close()
    return DemoResult(prompt_tokens=len(prompt), shape=shape, k1=k1, k2=cfg.k2, n_threads=n_threads,
                      dense=runs["dense"][0], sparq=runs["sparq"][0], prompt_tail=tail, index=held.index,
                      select=held.select, dense_rates=[r.decode_tokens_per_s for r in runs["dense"]],
                      sparq_rates=[r.decode_tokens_per_s for r in runs["sparq"]], machine=machine)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.strip("\n").splitlines()) or "  (nothing)"


def report(cfg: DemoConfig, res: DemoResult) -> str:
    s = res.shape
    mean = "off" if s.gqa else "on"
    m = res.machine
    rows = [("dense", res.dense), (f"SparQ (k1={res.k1}, k2={res.k2})", res.sparq)]
    n_rounds = len(res.rates("dense"))
    lines = [
        (f"model {cfg.model} ({s.n_head} q / {s.n_head_kv} kv heads, head_dim {s.head_dim}), "
         f"{res.n_threads} threads, greedy"),
        *([f"threads: {res.n_threads} ({m.threads_reason}); {m.wait_policy}"] if m.threads_reason else []),
        f"prompt: {res.prompt_tokens} tokens of {cfg.text}",
        f"SparQ: k1 {res.k1}, k2 {res.k2}, index {res.index}, select {res.select}",
        f"{n_rounds} interleaved round(s) of a dense and a SparQ run; decode tok/s: median and min-max",
        "",
        f"{'':24s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'min-max':>15s} {'generated':>10s}",
    ]
    for (name, r), side in zip(rows, ("dense", "sparq")):
        rates = res.rates(side)
        span = f"{min(rates):.2f}-{max(rates):.2f}"
        lines.append(f"{name:24s} {r.prefill_tokens_per_s:14.1f} {statistics.median(rates):13.2f} {span:>15s} "
                     f"{r.generated_tokens:10d}")
    per_round = res.round_speedups
    lines += [
        "",
        (f"decode speedup (SparQ / dense): {res.speedup:.2f}x (medians; per round "
         f"{min(per_round):.2f}x-{max(per_round):.2f}x)"),
        (f"transfer ratio (dense / SparQ KV bytes read per step at n_kv={res.prompt_tokens}, d={s.head_dim}, "
         f"k1={res.k1}, k2={res.k2}, mean {mean}, index {res.index}): {res.transfer_ratio:.2f}x"),
        f"first {res.agreeing_tokens} of {res.dense.generated_tokens} generated tokens identical",
    ]
    lines += [f"WARNING: {w}" for w in res.warnings]
    lines += ["", "--- end of the prompt ---", _indent("\n".join(res.prompt_tail.splitlines()[-4:]))]
    for name, r in rows:
        lines += ["", f"--- {name} continuation ---", _indent(r.text)]
    return "\n".join(lines)
