#!/usr/bin/env python3
"""Where keep 1 and dense answer a retrieval example differently: the greedy steps of both with each step's two best
tokens and the logit margin between them (a near tie at the step where they part is rounding, not selection).

    python bench/squeeze_tie.py --model gemma3 --length 4096 --seed 41 --n 20 --depth 0.9

The example is squeeze_quality.py's (same seed, count and depth spread); keep 1 is the prepared prefix read through
the centroid op over every cluster, dense the same cache without it. Record: bench/results/squeeze_tie.json (--append:
one more run in it).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from record import RESULTS, append_run, provenance, write_record
from sparq_llama import squeeze
from squeeze_quality import retrieval_setup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--depth", type=float, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "squeeze_tie.json")
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()

    engine, examples = retrieval_setup(args.length, args.n, args.threads, args.seed, args.model)
    ex = next(e for e in examples if abs(e.meta["depth"] - args.depth) < 1e-6)

    def steps(keep_one: bool) -> list[dict]:
        engine.clear()
        engine.prefill(ex.context)
        if keep_one:
            squeeze.prepare(engine.ctx, ex.context, squeeze.SqueezeConfig(keep=1.0))
        logits = engine._decode(ex.tail, [False] * (len(ex.tail) - 1) + [True])[-1]
        out = []
        for _ in range(args.steps):
            x = logits.astype(np.float64)
            best, second = (int(t) for t in np.argsort(-x)[:2])
            out.append({"token": engine.detokenize([best]), "second": engine.detokenize([second]),
                        "margin": float(x[best] - x[second])})
            logits = engine._decode([best], [True])[0]
        if keep_one:
            squeeze.clear(engine.ctx)
        return out

    dense, keep_one = steps(False), steps(True)
    for name, s in (("dense", dense), ("keep 1", keep_one)):
        print(f"{name:>7}: " + " ".join(f"{x['token']!r} ({x['margin']:.3f} over {x['second']!r})" for x in s))
    record = {**provenance("squeeze_tie"), "model": args.model, "length": args.length, "seed": args.seed, "n": args.n,
              "depth": args.depth, "answer": ex.meta["answer"], "dense": dense, "keep_1": keep_one}
    (append_run if args.append else write_record)(args.out, record)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
