"""Summaries with standard errors (the uncertainty from a finite set of examples).

Per setting and task, from the per-example records:

* ppl: perplexity exp(sum NLL / sum tokens) and bits per character sum NLL / ln 2 / sum chars; their
  standard errors from the spread of the per-window values (windows are the independent samples, tokens
  inside one are not). `rel` is the paired ratio to dense: mean over windows of the per-window log ratio,
  so the (large) variation between texts cancels.
* retrieval: accuracy and its binomial standard error sqrt(p (1 - p) / n).
* repetition: mean matched characters and std / sqrt(n).

`rel` (every task): the setting's score relative to dense's on the same examples, with a paired SE.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Summary:
    task: str
    setting: str
    n: int                  # examples
    value: float            # ppl | accuracy | mean matched chars
    se: float
    rel: float              # value / dense value on the same examples (1 = dense)
    rel_se: float
    bpc: float | None = None
    bpc_se: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _se(x: np.ndarray) -> float:
    return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")


def summarize(task: str, setting: str, records: Sequence[dict[str, Any]],
              dense: Sequence[dict[str, Any]]) -> Summary:
    """`records` and `dense` hold the same examples in the same order."""
    if len(records) != len(dense) or not records:
        raise ValueError(f"{task}/{setting}: {len(records)} records vs {len(dense)} dense ones")
    n = len(records)
    if task == "ppl":
        nll = np.array([r["nll"] for r in records])
        tok = np.array([r["n_tokens"] for r in records], dtype=float)
        chars = np.array([r["n_chars"] for r in records], dtype=float)
        d_nll = np.array([r["nll"] for r in dense])
        mean_nll = nll.sum() / tok.sum()
        ppl = math.exp(mean_nll)
        se = ppl * _se(nll / tok)                            # delta method on exp
        bpc_w = nll / math.log(2) / chars
        diff = (nll - d_nll) / tok                           # per-window log ratio of perplexities
        rel = math.exp((nll.sum() - d_nll.sum()) / tok.sum())
        return Summary(task, setting, n, ppl, se, rel, rel * _se(diff),
                       float(nll.sum() / math.log(2) / chars.sum()), _se(bpc_w))
    if task == "retrieval":
        x = np.array([r["correct"] for r in records], dtype=float)
        d = np.array([r["correct"] for r in dense], dtype=float)
        p = float(x.mean())
        se = math.sqrt(p * (1 - p) / n)
    elif task == "repetition":
        x = np.array([r["matched_chars"] for r in records], dtype=float)
        d = np.array([r["matched_chars"] for r in dense], dtype=float)
        p, se = float(x.mean()), _se(x)
    else:
        raise ValueError(f"unknown task {task!r}")
    d_mean = float(d.mean())
    if d_mean > 0:
        rel, rel_se = p / d_mean, _se(x - d) / d_mean
    else:
        rel, rel_se = float("nan"), float("nan")
    return Summary(task, setting, n, p, se, rel, rel_se)
