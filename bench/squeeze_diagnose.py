#!/usr/bin/env python3
"""Why retrieval fails with a prepared prefix: the same examples under calibration variants (SmolLM2, CPU).

    python bench/squeeze_diagnose.py --n 10 --settings std:0.1,oracle:0.1,std:0.1:0.2

Each setting is mode:keep[:centroids]:
  std     the prefix is the context; the threshold is calibrated on its last n_calib tokens (haystack text);
          the question runs as a sparse user-input prefill, then greedy decoding.
  oracle  the prefix is context + question[:-1] and the threshold is calibrated on the question's own rows
          (n_calib = len(question) - 1): the question is prefilled densely, decoding is sparse with a threshold
          fitted to question-like queries. If `oracle` recovers dense's answers where `std` does not, the
          calibration queries are the problem, not the clusters.
Writes bench/results/squeeze_diagnose.json (every example's outputs, accuracy per setting, provenance).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from cuda_common import provenance, write_record
from sparq_llama import squeeze
from sparq_llama.eval import tasks
from sparq_llama.eval.engine import Engine
from squeeze_quality import accuracy, retrieval_setup, run_examples


def run_setting(engine: Engine, ex: tasks.Example, mode: str, config: squeeze.SqueezeConfig) -> dict:
    engine.truncate(len(ex.context))
    if mode == "std":
        info = squeeze.prepare(engine.ctx, ex.context, config)
        rec = tasks.score(engine, ex)
    elif mode == "oracle":
        head, last = ex.tail[:-1], ex.tail[-1:]
        engine.prefill(head)
        config = squeeze.SqueezeConfig(**{**config.__dict__, "n_calib": len(head)})
        info = squeeze.prepare(engine.ctx, ex.context + head, config)
        gen = engine.generate(last, max_tokens=8)
        text = engine.detokenize(gen, prev=ex.context + ex.tail)
        m = tasks._FIRST_NUMBER.search(text)
        rec = {"correct": int(bool(m) and int(m.group()) == ex.meta["answer"]), "output": text}
    else:
        raise ValueError(f"unknown mode {mode!r}")
    engine.truncate(len(ex.context))
    squeeze.clear(engine.ctx)
    return {**rec, "threshold": info.threshold}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n", type=int, default=10, help="examples (spread over depths 0.1 .. 0.9)")
    ap.add_argument("--settings", default="std:0.1,oracle:0.1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "squeeze_diagnose.json")
    args = ap.parse_args()

    settings = []
    for s in args.settings.split(","):
        mode, keep, *cent = s.split(":")
        settings.append((s, mode, squeeze.SqueezeConfig(keep=float(keep), centroids=float(cent[0]) if cent else 0.05)))
    engine, examples = retrieval_setup(args.length, args.n, args.threads)
    t0 = time.time()
    records = run_examples(engine, examples, lambda ex: {name: run_setting(engine, ex, mode, config)
                                                         for name, mode, config in settings})
    acc = accuracy(records, ["dense"] + [s[0] for s in settings])
    write_record(args.out, {**provenance(), "model": "smollm2", "length": args.length, "n": len(records),
                            "accuracy": acc, "wall_s": round(time.time() - t0, 1), "examples": records})
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
