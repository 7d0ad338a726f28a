#!/usr/bin/env python3
"""Cells a selection can skip from per-block maxima, in numpy on real queries and keys: how few cells of a row can
hold its exact top, given each block's largest logit per head.

SparQ's selection (docs/design.md, "SparQ: op semantics", step 3) keeps the window and the need = k2 - window best
other cells by the group score s(j) = sum_g p_hat_g(j), p_hat_g(j) = exp(l_g(j) - log Z_g). On the GPU, kernel PBS
computes every cell's group score and key before its radix passes (its keys pass: 30-44% of its phases,
docs/performance.md "Per-kernel times"). The scoring kernel could also write, per block of B cells and head, the
largest approximate logit m_g(b). After the normalisers are merged, each block then bounds its cells' scores:
    U(b) = sum_g exp(m_g(b) - log Z_g) >= s(j) for every cell j of b, and
    L(b) = max_g exp(m_g(b) - log Z_g) <= s(j*) for the cell j* of b that holds that head's maximum.
The L(b) of need distinct blocks name need distinct cells scoring at least their minimum, so T = the need-th largest
L(b) is at most the need-th best score: a block with U(b) < T holds no selected cell, and only the cells of the other
blocks need a score and a key. Blocks that hold window cells give no L(b) and are always kept. With every head's
group score in one place (not so in the scoring kernel, which lacks the normalisers) U(b) = L(b) = max_j s(j): the
"exact" columns, which keep need blocks by construction.

Rows as bench/carry_threshold.py (`captured_rows`): the last `rows` positions of retrieval examples, every earlier
cell visible, the defaults (q8 index, qsigma, k1 = d/2; the float64 reference's logits). Per block size the share of
non-window cells kept (median, 90th percentile), kept cells over need, and the steps where nothing is skipped. Every
step checks that the kept cells hold the exact top.

    python bench/block_bound.py --model smollm2
    python bench/block_bound.py --model gemma3 --append
Writes bench/results/block_bound.json (per model and block size the shares).

The rows the timings run on, for comparison with the real ones: `--model random:<shape>` prefills a random-weight
model of bench/cuda_e2e.py's shapes (`sparq_llama.eval.random_gguf`, cut to --layers layers) with random tokens, as
llama-bench fills its depth; `--model opbench:<heads>` draws the op bench's rows (bench/cuda_op.py: normal keys,
heavy-tailed queries z (1 + 0.3 z^2), as sparq-ops-eval.cpp fills them).

    python bench/block_bound.py --model random:llama3-8b --layers 6 --length 8192 --n 1 --rows 8 --append
    python bench/block_bound.py --model opbench:llama3-8b --length 8192 --n 1 --rows 8 --append
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from captured_rows import captured_rows, prefill_rows
from carry_threshold import head_logits, log_norm
from cuda_e2e import model_path
from head_shapes import HEAD_SHAPES
from record import RESULTS, append_run, provenance, write_record
from sparq_llama.eval.engine import Engine, EngineConfig

BLOCKS = (8, 16, 32)  # the record's block sizes


def kept_cells(p: np.ndarray, window: int, need: int, block: int) -> tuple[int, int]:
    """Non-window cells kept by the per-head block bound and by the exact block maximum, for one row's per-head
    probabilities p [G, n] (the last `window` cells forced)."""
    G, n = p.shape
    nw = n - window
    n_full = nw // block  # blocks wholly outside the window: the ones that give L(b) and can be skipped
    tail = nw - n_full * block  # non-window cells of the blocks that reach the window: always kept
    if n_full < need:
        return nw, nw
    hm = p[:, : n_full * block].reshape(G, n_full, block).max(axis=2)  # [G, blocks]: exp(m_g(b) - log Z_g)
    upper, lower = hm.sum(axis=0), hm.max(axis=0)
    t = np.partition(lower, n_full - need)[n_full - need]
    s_max = p[:, : n_full * block].sum(axis=0).reshape(n_full, block).max(axis=1)
    t_exact = np.partition(s_max, n_full - need)[n_full - need]
    kept, kept_exact = int((upper >= t).sum()) * block + tail, int((s_max >= t_exact).sum()) * block + tail

    # the oracle: every cell of the exact top lies in a kept block
    s = p.sum(axis=0)[:nw]
    top = np.argpartition(s, nw - need)[nw - need:]
    top = top[top < n_full * block] // block
    assert (upper[top] >= t).all() and (s_max[top] >= t_exact).all(), "a block bound dropped a selected cell"
    return kept, kept_exact


def row_counts(q: np.ndarray, k: np.ndarray, first: int, k2: int, window: int, blocks: tuple[int, ...]) -> np.ndarray:
    """[rows, blocks, 3]: per row and block size the non-window cells, those kept by the head bound, by the exact
    maximum."""
    d = k.shape[1]
    k1, scale, need = d // 2, 1.0 / math.sqrt(d), k2 - window
    out = []
    for r in range(q.shape[0]):
        n = first + r + 1
        lg = head_logits(q[r].astype(np.float64), k[:n].astype(np.float64), k1, scale)
        p = np.exp(lg - log_norm(lg)[:, None])
        out.append([(n - window, *kept_cells(p, window, need, b)) for b in blocks])
    return np.asarray(out, dtype=np.int64)


def shares(counts: np.ndarray, need: int, blocks: tuple[int, ...]) -> dict[str, dict[str, float]]:
    out = {}
    for i, b in enumerate(blocks):
        nw, kept, exact = counts[:, i, 0], counts[:, i, 1], counts[:, i, 2]
        out[f"block {b}"] = dict(
            kept_share_median=float(np.median(kept / nw)), kept_share_p90=float(np.percentile(kept / nw, 90)),
            kept_over_need_median=float(np.median(kept / need)), none_skipped=float(np.mean(kept >= nw)),
            exact_kept_share_median=float(np.median(exact / nw)),
            exact_kept_share_p90=float(np.percentile(exact / nw, 90)))
    return out


def random_model_rows(shape: str, layers: int, length: int, rows: int, n: int, seed: int, threads: int,
                      models: Path = Path("/tmp/models")) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    """Rows as captured_rows yields them, from a random-weight model of `shape` cut to `layers` layers (written to
    `models` on first use) prefilled with `n` sequences of random tokens."""
    engine = Engine(EngineConfig(str(model_path(models, shape, layers)), n_ctx=length + 64, n_threads=threads))
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield from prefill_rows(engine, [int(t) for t in rng.integers(0, engine.llm.n_vocab(), length)], rows)


def op_bench_rows(heads: str, length: int, rows: int, n: int, seed: int
                  ) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    """The op bench's rows: keys of normal values, heavy-tailed queries z (1 + 0.3 z^2) (sparq-ops-eval.cpp), as one
    "layer" 0 of n KV heads. The components are chosen by these keys' own spread (about 1 in every component); the
    op bench draws its key statistics apart from its keys, so there the choice follows |q| a little less."""
    shape = HEAD_SHAPES[heads]
    G, rng = shape.n_head // shape.n_head_kv, np.random.default_rng(seed)
    for _ in range(n):
        k = rng.standard_normal((length, shape.d)).astype(np.float32)
        z = rng.standard_normal((rows, G, shape.d))
        yield 0, (z * (1.0 + 0.3 * z * z)).astype(np.float32), k, length - rows


def rows_of(args: argparse.Namespace) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    kind, _, name = args.model.rpartition(":")
    if kind == "random":
        return random_model_rows(name, args.layers, args.length, args.rows, args.n, args.seed, args.threads)
    if kind == "opbench":
        return op_bench_rows(name, args.length, args.rows, args.n, args.seed)
    if kind:
        raise SystemExit(f"--model {args.model}: expected a model name, random:<shape> or opbench:<heads>")
    return captured_rows(args.model, args.length, args.rows, args.n, args.seed, args.threads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a model of sparq_llama.models, random:<shape> or opbench:<heads>")
    ap.add_argument("--layers", type=int, default=6, help="with random:<shape>, the layers of the cut model")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=16, help="consecutive decode rows at the end of each example")
    ap.add_argument("--n", type=int, default=2, help="examples")
    ap.add_argument("--seed", type=int, default=61)
    ap.add_argument("--k2", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks", default=",".join(map(str, BLOCKS)), help="block sizes in cells")
    ap.add_argument("--out", type=Path, default=RESULTS / "block_bound.json")
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()
    window = args.k2 // 4  # the op's default window
    need = args.k2 - window
    blocks = tuple(int(b) for b in args.blocks.split(","))

    parts: dict[int, list[np.ndarray]] = {}
    t0 = time.time()
    for il, q, k, first in rows_of(args):
        parts.setdefault(il, []).append(row_counts(q, k, first, args.k2, window, blocks))
    everything = np.concatenate([c for cs in parts.values() for c in cs])
    summary = shares(everything, need, blocks)
    per_layer = {il: shares(np.concatenate(cs), need, blocks) for il, cs in parts.items()}
    print(f"{args.model}, {args.n} examples of {args.length} tokens, {args.rows} rows each, k2 {args.k2}, window "
          f"{window}: {len(everything)} steps over {len(parts)} layers ({time.time() - t0:.0f} s)")
    print(f"{'block':>6} {'kept':>7} {'p90':>7} {'kept/need':>10} {'none skipped':>13} | exact: {'kept':>7} {'p90':>7}")
    for name, s in summary.items():
        print(f"{name.split()[1]:>6} {s['kept_share_median']:>7.3f} {s['kept_share_p90']:>7.3f} "
              f"{s['kept_over_need_median']:>10.1f} {s['none_skipped']:>13.3f} | {'':>6} "
              f"{s['exact_kept_share_median']:>7.3f} {s['exact_kept_share_p90']:>7.3f}")
    (append_run if args.append else write_record)(args.out, dict(
        provenance("block_bound"),
        params=dict(model=args.model, **({"layers": args.layers} if args.model.startswith("random:") else {}),
                    length=args.length, rows=args.rows, n=args.n, seed=args.seed, k2=args.k2,
                    window=window, index="q8", select="qsigma", blocks=blocks),
        n_steps=int(len(everything)), summary=summary, per_layer=per_layer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
