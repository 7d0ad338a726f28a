"""The main job: generate from the default model after a long prompt of real text, report tokens/s."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from . import models, texts

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    model: str = models.DEFAULT_MODEL
    text: str = "hamlet_gut"        # a work from sparq_llama.texts
    prompt_tokens: int = 3000       # length of the long prompt
    max_tokens: int = 64            # tokens to generate
    n_ctx: int = 4096
    n_threads: int | None = None    # None: all cores
    seed: int = 1234


@dataclass
class DemoResult:
    text: str
    prompt_tokens: int
    generated_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def build_prompt(llm, cfg: DemoConfig) -> list[int]:
    """The first `prompt_tokens` tokens of the text, ending on a line break so generation continues it."""
    body = llm.tokenize(texts.read(cfg.text).encode(), add_bos=True)
    if len(body) < cfg.prompt_tokens:
        raise ValueError(f"{cfg.text} has only {len(body)} tokens; asked for {cfg.prompt_tokens}")
    return body[: cfg.prompt_tokens]


def run(cfg: DemoConfig) -> DemoResult:
    from .llama import Llama

    if cfg.prompt_tokens + cfg.max_tokens > cfg.n_ctx:
        raise ValueError(f"prompt_tokens + max_tokens = {cfg.prompt_tokens + cfg.max_tokens} > n_ctx = {cfg.n_ctx}")
    path = models.fetch(cfg.model)
    llm = Llama(str(path), n_ctx=cfg.n_ctx, n_batch=512, flash_attn=True, seed=cfg.seed,
                n_threads=cfg.n_threads or os.cpu_count(), verbose=False)
    from llama_cpp import llama_cpp as lc

    prompt = build_prompt(llm, cfg)
    lc.llama_perf_context_reset(llm.ctx)
    out = llm.create_completion(prompt, max_tokens=cfg.max_tokens, temperature=0.0, top_k=1)
    perf = lc.llama_perf_context(llm.ctx)
    llm.close()
    return DemoResult(
        text=out["choices"][0]["text"],
        prompt_tokens=out["usage"]["prompt_tokens"],
        generated_tokens=out["usage"]["completion_tokens"],
        prefill_tokens_per_s=1e3 * perf.n_p_eval / perf.t_p_eval_ms if perf.t_p_eval_ms > 0 else float("nan"),
        decode_tokens_per_s=1e3 * perf.n_eval / perf.t_eval_ms if perf.t_eval_ms > 0 else float("nan"),
    )


def report(cfg: DemoConfig, res: DemoResult) -> str:
    return (f"--- generated after {res.prompt_tokens} prompt tokens of {cfg.text} ---\n{res.text}\n---\n"
            f"model {cfg.model}: prefill {res.prefill_tokens_per_s:.1f} tokens/s, "
            f"decode {res.decode_tokens_per_s:.1f} tokens/s ({res.generated_tokens} tokens, dense attention)")
