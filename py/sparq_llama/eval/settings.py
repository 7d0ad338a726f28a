"""The attention settings the quality evaluation compares, and the paper's recipe for k1.

Every setting is one `SparqConfig` for the engine (or dense attention), named so that tables and plots can
be read without this file:

    dense                 llama.cpp's flash attention over every cell
    sparq-1/2 ...-1/8     SparQ, k2 = 128, window k2/4, k1 picked so that the attention bytes moved per
                          step are at most that fraction of dense at the task's context length (the paper's
                          recipe: fix k = 128, tune r), the index's bytes counted: the q8 index reads about
                          half the f16 one's bytes per component, so it gets about twice the k1; the q4 index
                          reads every component (k1 = head_dim, 18/32 bytes each), so a ratio it cannot reach
                          at that context is left out
    sparq-1/8-mean-on     the same with mean-value reallocation forced to the other state than auto picks
    sparq-1/8-no-window   ... with no recent window (window 0: all k2 cells by score)
    sparq-1/8-sinks16     ... with 16 sink cells as well as the window
    sparq-1/8-swa         ... with sliding-window layers sparsified too (models that have them)
    sparq-1/8-k2-64/256   the same 1/8 budget with k2 = 64 or 256 (k1 by the recipe): is 128 the right split?
    sparq-1/4-f16-q ...   the same ratio (1/4, 1/8) with the paper's index: f16 K^T, components of largest |q|
                          (k1 by the recipe for f16 bytes): the index the defaults replaced
    exact                 the oracle: top-k2 of the true scores (reads all of K: FlexGen, >= 1/2 of dense)
    window                sinks + recent only at the same k2 (LM-Infinite: 16 sinks, k2 - 16 recent)

A ratio k2 alone exceeds (k2 = 128 already moves 2*k2*d cache elements) is not reachable at short contexts: the
setting is then left out for that length, and the report says so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from ..sparq import DEFAULT_INDEX, DEFAULT_SELECT, KV_TYPE_BYTES, SparqConfig, index_bytes, transfer_ratio

K2 = 128
WINDOW_BASELINE_SINKS = 16          # LM-Infinite keeps the first 16 positions (the paper's baseline)
TARGET_RATIOS = (Fraction(1, 2), Fraction(1, 4), Fraction(1, 8))
HEADLINE = Fraction(1, 8)           # the ratio the targets are stated at
ABLATIONS = ("mean", "no-window", "sinks16", "swa")      # the defaults' ablations (full mode)
BUDGET_K2 = (64, 256)               # the "k2" study: the 1/8 budget spent on fewer / more kept cells
PAPER_INDEX = ("f16", "q")          # the "f16-q" comparison: (index, select) of the paper
PAPER_INDEX_RATIOS = (Fraction(1, 4), Fraction(1, 8))
KNOWN_ABLATIONS = (*ABLATIONS, "k2", "f16-q", "q4")  # q4: the q4 index (every component, its own ratio)


@dataclass(frozen=True)
class ModelShape:
    """What the settings depend on: head dim, whether heads are grouped, whether some layers are SWA."""

    head_dim: int
    n_head: int
    n_head_kv: int
    has_swa: bool = False

    @property
    def gqa(self) -> bool:
        return self.n_head != self.n_head_kv

    @property
    def mean_auto(self) -> bool:
        """Mean reallocation under `mean="auto"`: on for MHA, off for GQA (the paper's finding)."""
        return not self.gqa


@dataclass(frozen=True)
class Setting:
    """One row of the comparison: a name, the engine's SparQ config (None: dense) and its transfer ratio."""

    name: str
    config: SparqConfig | None
    transfer: float                 # SparQ / dense attention bytes moved per KV head and step (1 = dense)
    family: str                     # dense | sparq | ablation | exact | window
    target: Fraction | None = None  # the ratio a sparq setting was picked for


def k1_for_ratio(target: Fraction, n_kv: int, head_dim: int, k2: int = K2, mean: bool = False, *,
                 index: str = DEFAULT_INDEX, kv_type: str = "f16") -> int | None:
    """The paper's recipe: the largest r (<= head_dim) whose SparQ transfer in bytes (`transfer_ratio` with
    this index and cache type) is at most `target` of dense at `n_kv` cells; None when k2 rows alone already
    exceed it. The q4 index takes only r = head_dim: head_dim if that is within the target, else None."""
    b_idx, b_kv = index_bytes(index, kv_type), KV_TYPE_BYTES[kv_type]
    dense = (2 * n_kv * head_dim + 2 * head_dim) * b_kv
    fixed = (2 * k2 * head_dim + (4 if mean else 2) * head_dim) * b_kv
    r = int((target * dense - fixed) // (n_kv * b_idx))
    if index == "q4":
        return head_dim if r >= head_dim else None
    return min(r, head_dim) if r >= 1 else None


def sparq_transfer(n_kv: int, shape: ModelShape, k1: int, k2: int, mean: bool, index: str = DEFAULT_INDEX) -> float:
    """SparQ / dense bytes moved (the inverse of `transfer_ratio`)."""
    return 1.0 / transfer_ratio(n_kv, shape.head_dim, k1, k2, mean=mean, index=index)


def ratio_label(target: Fraction) -> str:
    return f"{target.numerator}/{target.denominator}"


def settings_for(n_kv: int, shape: ModelShape, *, ablations: tuple[str, ...] = ABLATIONS,
                 k2: int = K2, index: str = DEFAULT_INDEX) -> tuple[list[Setting], list[tuple[str, str]]]:
    """The settings compared at a context of `n_kv` cells (SparQ reading `index`), and (name, reason) of the ones
    left out."""
    d = shape.head_dim
    base = SparqConfig(enabled=True, k2=k2, prefill=True, min_n_kv=0, index=index, select=DEFAULT_SELECT)
    out = [Setting("dense", None, 1.0, "dense")]
    skipped: list[tuple[str, str]] = []
    mean = shape.mean_auto
    headline_k1 = None
    for target in TARGET_RATIOS:
        k1 = k1_for_ratio(target, n_kv, d, k2, mean, index=index)
        label = ratio_label(target)
        if k1 is None:
            skipped.append((f"sparq-{label}", f"unreachable with k2={k2}, d={d} (k2 rows alone move more)"))
            continue
        out.append(Setting(f"sparq-{label}", replace(base, k1=k1), sparq_transfer(n_kv, shape, k1, k2, mean, index),
                           "sparq", target))
        if target == HEADLINE:
            headline_k1 = k1
        if "f16-q" in ablations and target in PAPER_INDEX_RATIOS:
            paper_index, paper_select = PAPER_INDEX
            k1_paper = k1_for_ratio(target, n_kv, d, k2, mean, index=paper_index)
            if k1_paper is None:
                skipped.append((f"sparq-{label}-f16-q", f"unreachable with k2={k2}, d={d} and the f16 index"))
            else:
                out.append(Setting(f"sparq-{label}-f16-q", replace(base, k1=k1_paper, index=paper_index,
                                                                   select=paper_select),
                                   sparq_transfer(n_kv, shape, k1_paper, k2, mean, paper_index), "ablation", target))
    if "q4" in ablations and d % 8 == 0:
        # every component: its ratio is the index's (6% more bytes than the default's at 1/8 on long contexts)
        out.append(Setting("sparq-q4", replace(base, k1=None, index="q4"), sparq_transfer(n_kv, shape, d, k2, mean, "q4"),
                           "ablation", HEADLINE))
    if headline_k1 is not None:
        k1, h = headline_k1, ratio_label(HEADLINE)
        if "mean" in ablations:
            other = not mean
            out.append(Setting(f"sparq-{h}-mean-{'on' if other else 'off'}",
                               replace(base, k1=k1, mean="on" if other else "off"),
                               sparq_transfer(n_kv, shape, k1, k2, other, index), "ablation", HEADLINE))
        if "no-window" in ablations:
            out.append(Setting(f"sparq-{h}-no-window", replace(base, k1=k1, window=0),
                               sparq_transfer(n_kv, shape, k1, k2, mean, index), "ablation", HEADLINE))
        if "sinks16" in ablations:
            out.append(Setting(f"sparq-{h}-sinks16", replace(base, k1=k1, sinks=WINDOW_BASELINE_SINKS),
                               sparq_transfer(n_kv, shape, k1, k2, mean, index), "ablation", HEADLINE))
        if "k2" in ablations:
            for other_k2 in BUDGET_K2:
                k1_other = k1_for_ratio(HEADLINE, n_kv, d, other_k2, mean, index=index)
                name = f"sparq-{h}-k2-{other_k2}"
                if k1_other is None:
                    skipped.append((name, f"unreachable with k2={other_k2}, d={d}"))
                    continue
                out.append(Setting(name, replace(base, k1=k1_other, k2=other_k2),
                                   sparq_transfer(n_kv, shape, k1_other, other_k2, mean, index), "ablation", HEADLINE))
        if "swa" in ablations and shape.has_swa:
            out.append(Setting(f"sparq-{h}-swa", replace(base, k1=k1, swa=True),
                               sparq_transfer(n_kv, shape, k1, k2, mean, index), "ablation", HEADLINE))
    exact_transfer = (n_kv * d + k2 * d + 2 * d) / (2 * n_kv * d + 2 * d)
    out.append(Setting("exact", replace(base, policy="exact"), exact_transfer, "exact"))
    window_transfer = (2 * k2 * d + 2 * d) / (2 * n_kv * d + 2 * d)
    out.append(Setting("window", replace(base, policy="window", sinks=WINDOW_BASELINE_SINKS,
                                         window=k2 - WINDOW_BASELINE_SINKS), window_transfer, "window"))
    return out, skipped
