"""The main job: dense vs SparQ decoding on the default model after a long prompt of real text.

One model load; two runs on the same prompt, greedy, each from an empty KV cache (the prompt is prefilled
again, densely, before each run). Only the decode steps are timed (llama.cpp's own perf counters, reset
after the prefill), so the tokens/s compare what SparQ changes: how much of the KV cache a decode step reads.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from . import models, texts
from .shape import AttentionShape, attention_shape
from .sparq import DEFAULT_INDEX, DEFAULT_SELECT, INDEXES, SELECTS, transfer_ratio

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    model: str = models.DEFAULT_MODEL
    text: str = "hamlet_gut"        # a work from sparq_llama.texts
    prompt_tokens: int = 6000       # length of the long prompt (SmolLM2 was trained at 8k)
    max_tokens: int = 64            # tokens to generate per run
    n_ctx: int = 8192               # must hold prompt + generation
    n_threads: int | None = None    # None: all cores
    seed: int = 1234
    k1: int | None = 16             # query components for SparQ's approximate scores; None: by the index
    k2: int = 128                   # KV cells kept per head and decode step
    index: str | None = None        # SparQ's key index, "f16" or "q8"; None: the library's default
    select: str = DEFAULT_SELECT    # how the k1 components are chosen, "q" or "qsigma"

    def check(self) -> None:
        """ValueError if the settings cannot work (before anything is loaded)."""
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


@dataclass
class DemoResult:
    prompt_tokens: int
    shape: AttentionShape
    k1: int
    k2: int
    n_threads: int
    dense: RunResult
    sparq: RunResult
    prompt_tail: str = ""           # the last lines of the prompt, to read the continuations against
    index: str = DEFAULT_INDEX      # the SparQ run's key index and selection, as llama.cpp held them
    select: str = DEFAULT_SELECT

    @property
    def speedup(self) -> float:
        """SparQ's decode tokens/s over dense's."""
        return self.sparq.decode_tokens_per_s / self.dense.decode_tokens_per_s

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

    Every generated token is decoded (max_tokens decode steps, as llama-bench's -n), and only those steps
    are timed: the perf counters are reset between prefill and decode."""
    from llama_cpp import llama_cpp as lc

    _clear_kv(llm)
    lc.llama_perf_context_reset(llm.ctx)
    log.info("%s: prefilling %d tokens", label, len(prompt))
    llm.eval(prompt)
    lc.llama_synchronize(llm.ctx)
    perf = lc.llama_perf_context(llm.ctx)
    prefill = _per_s(perf.n_p_eval + perf.n_eval, perf.t_p_eval_ms + perf.t_eval_ms)

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
    """Load the model once, generate densely, then with SparQ, from the same prompt."""
    from .llama import Llama

    cfg.check()
    path = models.fetch(cfg.model)
    n_threads = cfg.n_threads or os.cpu_count() or 1
    if not hasattr(Llama, "set_sparq"):
        raise RuntimeError("this build of sparq-llama has no SparQ in llama.cpp's decode path "
                           "(Llama.set_sparq is missing); rebuild with `make install`")
    # Dense first; the SparQ settings are stored now and switched on later with set_sparq. Flash attention
    # in both runs: SparQ needs it, and the dense baseline is then llama.cpp's fastest path.
    llm = Llama(str(path), n_ctx=cfg.n_ctx, n_batch=512, flash_attn=True, seed=cfg.seed,
                n_threads=n_threads, verbose=False, sparq=False, k1=cfg.k1, k2=cfg.k2, index=cfg.index,
                select=cfg.select)
    try:
        shape = attention_shape(llm)
        index = llm.sparq.index
        k1 = cfg.k1 if cfg.k1 is not None else shape.head_dim // (2 if index == "q8" else 4)
        prompt = build_prompt(llm, cfg)
        tail = llm.detokenize(prompt[-48:], prev_tokens=prompt[:-48]).decode("utf-8", errors="replace")

        llm.set_sparq(enabled=False)
        dense = generate(llm, prompt, cfg.max_tokens, "dense")
        held = llm.set_sparq(enabled=True, k1=k1, k2=cfg.k2)
        sparq = generate(llm, prompt, cfg.max_tokens, f"SparQ k1={k1} k2={cfg.k2} index={held.index} "
                                                      f"select={held.select}")
        llm.set_sparq(enabled=False)
    finally:
        llm.close()
    return DemoResult(prompt_tokens=len(prompt), shape=shape, k1=k1, k2=cfg.k2, n_threads=n_threads,
                      dense=dense, sparq=sparq, prompt_tail=tail, index=held.index, select=held.select)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.strip("\n").splitlines()) or "  (nothing)"


def report(cfg: DemoConfig, res: DemoResult) -> str:
    s = res.shape
    mean = "off" if s.gqa else "on"
    rows = [("dense", res.dense), (f"SparQ (k1={res.k1}, k2={res.k2})", res.sparq)]
    lines = [
        (f"model {cfg.model} ({s.n_head} q / {s.n_head_kv} kv heads, head_dim {s.head_dim}), "
         f"{res.n_threads} threads, greedy"),
        f"prompt: {res.prompt_tokens} tokens of {cfg.text}",
        f"SparQ: k1 {res.k1}, k2 {res.k2}, index {res.index}, select {res.select}",
        "",
        f"{'':24s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'generated':>10s}",
    ]
    for name, r in rows:
        lines.append(f"{name:24s} {r.prefill_tokens_per_s:14.1f} {r.decode_tokens_per_s:13.2f} "
                     f"{r.generated_tokens:10d}")
    lines += [
        "",
        f"decode speedup (SparQ / dense): {res.speedup:.2f}x",
        (f"transfer ratio (dense / SparQ KV bytes read per step at n_kv={res.prompt_tokens}, d={s.head_dim}, "
         f"k1={res.k1}, k2={res.k2}, mean {mean}, index {res.index}): {res.transfer_ratio:.2f}x"),
        f"first {res.agreeing_tokens} of {res.dense.generated_tokens} generated tokens identical",
    ]
    lines += ["", "--- end of the prompt ---", _indent("\n".join(res.prompt_tail.splitlines()[-4:]))]
    for name, r in rows:
        lines += ["", f"--- {name} continuation ---", _indent(r.text)]
    return "\n".join(lines)
