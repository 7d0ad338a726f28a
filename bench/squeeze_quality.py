#!/usr/bin/env python3
"""Retrieval accuracy with a prepared fixed prefix (centroid-sparse attention) vs dense, on SmolLM2.

    python bench/squeeze_quality.py --length 4096 --n 10      # keep 30/20/10% (group max) and 10% (group mean)
    python bench/squeeze_quality.py --settings 0.1:max:0.5,0.1:max:0.5:2   # keep:group[:centroids[:levels[:var[:kc[:it]]]]]
    python bench/squeeze_quality.py --seed 1 --n 20 ...      # a held-out example set

The quality harness's retrieval task (`sparq_llama.eval.tasks`: needles with distractors in a haystack): each
example's context is the fixed prefix, prefilled densely once; per setting it is prepared (clustered and
calibrated on its own last tokens), the question runs as a user-input prefill and the answer is generated
greedily through the op; dense is the same with no prepared prefix. Writes bench/results/squeeze_quality.json
(every example's record, accuracy per setting, machine, commit, command).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from cuda_common import provenance, write_record
from sparq_llama import squeeze
from sparq_llama.eval import tasks
from sparq_llama.eval.engine import Engine, EngineConfig
from sparq_llama.models import fetch
from tqdm import tqdm


def retrieval_setup(length: int, n: int, threads: int, seed: int = 0) -> tuple[Engine, list[tasks.Example]]:
    """SmolLM2 and n retrieval examples of `length` tokens, needles at depths spread over 0.1 .. 0.9 (the seed picks
    the haystack, needles and distractors: another seed is a held-out set)."""
    engine = Engine(EngineConfig(str(fetch("smollm2")), n_ctx=length + 64, n_threads=threads))
    depths = tuple(round(0.1 + 0.8 * i / max(1, n - 1), 3) for i in range(n))
    return engine, tasks.retrieval_examples(engine, lengths=(length,), depths=depths, n_per_cell=1,
                                            n_distractors=2, seed=seed)


def run_examples(engine: Engine, examples: list[tasks.Example],
                 score_settings: Callable[[tasks.Example], dict[str, dict]]) -> list[dict]:
    """Per example: the context prefilled densely once, dense's answer, then score_settings(ex)'s records (each
    setting must leave the cache holding the context alone)."""
    records = []
    for ex in tqdm(examples, desc="examples"):
        engine.clear()
        engine.prefill(ex.context)
        rec = {"id": ex.id, "depth": ex.meta["depth"], "answer": ex.meta["answer"], "dense": tasks.score(engine, ex)}
        records.append({**rec, **score_settings(ex)})
    return records


def accuracy(records: list[dict], names: list[str]) -> dict[str, float]:
    acc = {n: sum(r[n]["correct"] for r in records) / len(records) for n in names}
    for n in names:
        rel = f" ({acc[n] / acc['dense']:.0%} of dense)" if acc["dense"] else ""
        print(f"{n:>16}: accuracy {acc[n]:.0%}{rel}")
    return acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n", type=int, default=10, help="examples (spread over depths 0.1 .. 0.9)")
    ap.add_argument("--settings", default="0.3:max,0.2:max,0.1:max,0.1:mean",
                    help="comma-separated keep:group[:centroids[:levels[:var[:kc[:it[:init]]]]]] (centroids default "
                         "--centroids, levels 1, var: the kept rule's var_weight, kc: keep_coarse (0: the default), "
                         "it: k-means iterations at most, init: even or kpp; defaults SqueezeConfig's)")
    ap.add_argument("--centroids", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="example set (0: the set the defaults were chosen on)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "squeeze_quality.json")
    args = ap.parse_args()

    settings = []
    for spec in args.settings.split(","):
        keep, group, *rest = spec.split(":")
        cent = float(rest[0]) if rest else args.centroids
        levels = int(rest[1]) if len(rest) > 1 else 1
        var = {"var_weight": float(rest[2])} if len(rest) > 2 else {}
        if len(rest) > 3 and float(rest[3]) > 0:
            var["keep_coarse"] = float(rest[3])
        if len(rest) > 4:
            var["n_iter"] = int(rest[4])
        if len(rest) > 5:
            var["init"] = rest[5]
        settings.append((spec if rest else f"keep{float(keep):g}-{group}",
                         squeeze.SqueezeConfig(centroids=cent, keep=float(keep), group=group, levels=levels, **var)))
    engine, examples = retrieval_setup(args.length, args.n, args.threads, args.seed)

    def score_settings(ex: tasks.Example) -> dict[str, dict]:
        out = {}
        for name, config in settings:
            engine.truncate(len(ex.context))
            info = squeeze.prepare(engine.ctx, ex.context, config)
            out[name] = {**tasks.score(engine, ex), "kept_calib": info.kept_calib}
            engine.truncate(len(ex.context))
            squeeze.clear(engine.ctx)
        return out

    t0 = time.time()
    records = run_examples(engine, examples, score_settings)
    names = ["dense"] + [name for name, _ in settings]
    acc = accuracy(records, names)
    rel = {n: (acc[n] / acc["dense"] if acc["dense"] else None) for n in names}
    write_record(args.out, {**provenance(), "model": "smollm2", "length": args.length, "n": len(records),
                            "settings": {name: config.__dict__ for name, config in settings},
                            "threads": args.threads, "seed": args.seed, "accuracy": acc, "relative_to_dense": rel,
                            "wall_s": round(time.time() - t0, 1), "examples": records})
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
