#!/usr/bin/env python3
"""A selection threshold carried from one decode step to the next, in numpy on real queries and keys: how often the
previous step's boundary score would let the next step's exact top-k2 be found among few candidates.

SparQ's selection (docs/design.md, "SparQ: op semantics", step 3) keeps the window and the need = k2 - window best
other cells by the group score sum_g p_hat_g. On the GPU that exact top waits for every score of the row (kernel PBS:
~23 us of the chain at 32k). With a threshold T carried from the previous step of the same row, the scoring pass could
count (and collect) the cells scoring >= T as it goes; the exact top is then a selection among those candidates, valid
whenever at least `need` of them pass, and cheap while they are few (at most `cap`). This measures that condition
before any kernel is built.

The rows are consecutive decode steps: the last `rows` positions of a dense prefill of a retrieval example (the
quality harness's haystack with needles, `sparq_llama.eval.tasks`), each with every earlier cell visible, on a
capture context (`eval.agreement.QKCapture`: each layer's roped Q and K). Per SparQ layer, KV head and row p, the
group scores s_p over cells 0..p with the defaults (q8 index of the visible keys, select qsigma, k1 = d/2; the
float64 reference's p_hat); T_p = the need-th largest score of the non-window cells; for the next row,
count = |{non-window cells j of row p+1: s_{p+1}(j) >= T_p * (1 - margin)}|. Reported per margin: the share of
steps with count >= need (the carried threshold is usable), with need <= count <= cap (usable and cheap), too few
(count < need: the step falls back to the full selection) and too many (> cap), and the median count / need.

    python bench/carry_threshold.py --model smollm2 --length 4096
    python bench/carry_threshold.py --model gemma3 --length 4096 --append
Writes bench/results/carry_threshold.json (per model and margin the shares, per layer the same).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
from captured_rows import captured_rows
from record import RESULTS, append_run, provenance, write_record
from sparq_llama import reference as ref

MARGINS = (0.0, 0.1, 0.25, 0.5, 0.75)
CAPS = (2, 4, 8)  # the candidate cap, in units of k2


def head_logits(qg: np.ndarray, keys: np.ndarray, k1: int, scale: float) -> np.ndarray:
    """The approximate logits [G, n] that p_hat softmaxes over keys [n, d] for the group's queries qg [G, d], with the
    defaults (q8 index, qsigma), as the float64 reference computes them."""
    i1, spread = ref._components(qg, keys, k1, "qsigma")
    return ref._approx_logits(qg, ref._index_keys(keys, "q8"), i1, scale, spread)


def log_norm(logits: np.ndarray) -> np.ndarray:
    """Per head log sum_j exp(logit_j): p_hat_g = exp(logit - log_norm_g)."""
    m = logits.max(axis=1)
    return m + np.log(np.exp(logits - m[:, None]).sum(axis=1))


def carried_counts(q: np.ndarray, k: np.ndarray, first: int, k2: int, window: int, margins: tuple[float, ...]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows first+1 .. last of one KV head (q [rows, G, d] from row `first`, k [n, d]), per margin:
    counts [steps, margins], the non-window cells whose group score (with the row's own normalisers) is >= the previous
    row's boundary score times (1 - margin); and for counting while scoring, before the row's normalisers exist,
    with the previous row's: early [steps, margins] the counts, and exact [steps, margins] whether those candidates
    provably hold the row's exact top (need of them pass, and the need-th best of them by the true score is at least
    the threshold divided by the smallest ratio of a head's new normaliser to its old one, which bounds the true score
    of every cell left out)."""
    d = k.shape[1]
    k1, scale, need = d // 2, 1.0 / math.sqrt(d), k2 - window
    counts, early, exact = [], [], []
    prev_t = prev_lz = None
    for r in range(q.shape[0]):
        p = first + r
        lg = head_logits(q[r].astype(np.float64), k[: p + 1].astype(np.float64), k1, scale)
        lz = log_norm(lg)
        s = np.exp(lg - lz[:, None]).sum(axis=0)[: p + 1 - window]  # the window: the most recent cells, forced
        if prev_t is not None:
            est = np.exp(lg[:, : p + 1 - window] - prev_lz[:, None]).sum(axis=0)
            min_ratio = float(np.exp(lz - prev_lz).min())  # true score >= est * min_ratio: left-out cells < thr / it
            row_c, row_e, row_x = [], [], []
            for m in margins:
                thr = prev_t * (1.0 - m)
                row_c.append(int((s >= thr).sum()))
                cand = s[est >= thr]
                row_e.append(len(cand))
                row_x.append(bool(len(cand) >= need and
                                  np.partition(cand, len(cand) - need)[len(cand) - need] >= thr / min_ratio))
            counts.append(row_c)
            early.append(row_e)
            exact.append(row_x)
        prev_t = np.partition(s, len(s) - need)[len(s) - need] if len(s) >= need else None
        prev_lz = lz
    shape = (-1, len(margins))
    return (np.asarray(counts, dtype=np.int64).reshape(shape), np.asarray(early, dtype=np.int64).reshape(shape),
            np.asarray(exact, dtype=bool).reshape(shape))


def shares(counts: np.ndarray, early: np.ndarray, exact: np.ndarray, need: int, k2: int) -> dict[str, dict[str, float]]:
    out = {}
    for i, m in enumerate(MARGINS):
        c, e, x = counts[:, i], early[:, i], exact[:, i]
        out[f"margin {m}"] = dict(
            usable=float(np.mean(c >= need)), too_few=float(np.mean(c < need)),
            median_count_over_need=float(np.median(c) / need),
            **{f"usable_cap_{n}k2": float(np.mean((c >= need) & (c <= n * k2))) for n in CAPS},
            early_exact=float(np.mean(x)), early_median_count_over_need=float(np.median(e) / need),
            **{f"early_exact_cap_{n}k2": float(np.mean(x & (e <= n * k2))) for n in CAPS})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=48, help="consecutive decode rows at the end of each example")
    ap.add_argument("--n", type=int, default=2, help="examples")
    ap.add_argument("--seed", type=int, default=61)
    ap.add_argument("--k2", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "carry_threshold.json")
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()
    window = args.k2 // 4  # the op's default window
    need = args.k2 - window

    per_layer: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    t0 = time.time()
    for il, q, k, first in captured_rows(args.model, args.length, args.rows, args.n, args.seed, args.threads):
        per_layer.setdefault(il, []).append(carried_counts(q, k, first, args.k2, window, MARGINS))
    def joined(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        return [np.concatenate([pt[i] for pt in parts]) for i in range(3)]

    everything = joined([pt for parts in per_layer.values() for pt in parts])
    summary = shares(*everything, need, args.k2)
    layers_out = {il: shares(*joined(parts), need, args.k2) for il, parts in per_layer.items()}
    print(f"{args.model}, {args.n} examples of {args.length} tokens, {args.rows} rows each, k2 {args.k2}, "
          f"window {window}: {len(everything[0])} steps over {len(per_layer)} layers ({time.time() - t0:.0f} s)")
    print(f"{'margin':>8} {'usable':>7} {'too few':>8} {'<=2k2':>6} {'<=4k2':>6} {'<=8k2':>6} {'median/need':>12} | "
          f"while scoring: {'exact':>6} {'<=4k2':>6} {'median/need':>12}")
    for name, s in summary.items():
        print(f"{name.split()[1]:>8} {s['usable']:>7.3f} {s['too_few']:>8.3f} {s['usable_cap_2k2']:>6.3f} "
              f"{s['usable_cap_4k2']:>6.3f} {s['usable_cap_8k2']:>6.3f} {s['median_count_over_need']:>12.2f} | "
              f"{'':>14} {s['early_exact']:>6.3f} {s['early_exact_cap_4k2']:>6.3f} "
              f"{s['early_median_count_over_need']:>12.2f}")
    (append_run if args.append else write_record)(args.out, dict(
        provenance("carry_threshold"),
        params=dict(model=args.model, length=args.length, rows=args.rows, n=args.n, seed=args.seed, k2=args.k2,
                    window=window, index="q8", select="qsigma", margins=MARGINS, caps_k2=CAPS),
        n_steps=int(len(everything[0])), summary=summary, per_layer=layers_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
