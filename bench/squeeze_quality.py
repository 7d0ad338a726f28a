#!/usr/bin/env python3
"""Retrieval accuracy with a prepared fixed prefix (centroid-sparse attention) vs dense, on SmolLM2 (`--model gemma3`:
Gemma-3-270M).

    python bench/squeeze_quality.py --length 4096 --n 10      # keep 30/20/10% (group max) and 10% (group mean)
    python bench/squeeze_quality.py --settings 0.1:max:0.5,0.1:max:0.5:2   # keep:group[:centroids[:levels[:var[:kc[:it]]]]]
    python bench/squeeze_quality.py --seed 22 --n 20 --settings 0.1:max:0.05,0.1:max:0.1   # a new held-out set
    python bench/squeeze_quality.py --model gemma3 --haystack verse --seed 51 --n 20 --settings 0.1:max:0.1   # in verse
    python bench/squeeze_quality.py --merge set.json [--purpose selection]   # add saved sets, run nothing
    python bench/squeeze_quality.py --summary                # recompute and print the pooled summary only

The quality harness's retrieval task (`sparq_llama.eval.tasks`: needles with distractors in a haystack): each
example's context is the fixed prefix, prefilled densely once; per setting it is prepared (clustered and
calibrated on its own last tokens), the question runs as a user-input prefill and the answer is generated
greedily through the op; dense is the same with no prepared prefix.

bench/results/squeeze_quality.json holds every example set ever run, each as its own record (machine, commit,
command, settings, every example's answers) under "sets", and a summary computed from them (`summarise`). A run
appends its set there. Each set has a purpose: "held-out" (a seed nothing was chosen on: the evidence), "selection"
(a set a setting was chosen or tuned on, e.g. picked for the defaults' misses), "development" (seed 0, where the
defaults were developed) or "rejected-variant" (code that was not kept). The summary pools, per setting, the held-out
sets, leaving out seeds on which that same setting was also run for selection; it counts the examples dense answers,
how many of those the setting answers too ("of dense"), and all it answers.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from record import RESULTS, provenance, write_record
from sparq_llama import squeeze
from sparq_llama.eval import tasks
from sparq_llama.eval.engine import Engine, EngineConfig
from sparq_llama.models import fetch
from tqdm import tqdm


def retrieval_setup(length: int, n: int, threads: int, seed: int = 0, model: str = "smollm2",
                    haystack: str = "plays") -> tuple[Engine, list[tasks.Example]]:
    """The model and n retrieval examples of `length` tokens, needles at depths spread over 0.1 .. 0.9 (the seed picks
    the haystack, needles and distractors: another seed is a held-out set) in haystacks of one kind of text
    (tasks.HAYSTACKS: the comedies, or verse)."""
    engine = Engine(EngineConfig(str(fetch(model)), n_ctx=length + 64, n_threads=threads))
    depths = tuple(round(0.1 + 0.8 * i / max(1, n - 1), 3) for i in range(n))
    return engine, tasks.retrieval_examples(engine, lengths=(length,), depths=depths, n_per_cell=1,
                                            n_distractors=2, seed=seed, works=tasks.HAYSTACKS[haystack])


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


PURPOSES = ("held-out", "selection", "development", "rejected-variant")
# the fine level's kept rule of the code that runs: "budget" (each row its best clusters up to keep of the clustered
# cells); sets without the field ran the calibrated threshold ("threshold")
RULE = "budget"


def clustering_of(model: str) -> str:
    """How the code that runs clusters a prefix's keys on this model: centred, and on a model with a query norm
    (QK-norm) also weighted by its weights ("q-norm"). Sets without the field ran "centred" (or, before the
    per-row budget, the raw keys)."""
    import gguf
    from sparq_llama.models import fetch
    tensors = gguf.GGUFReader(str(fetch(model))).tensors
    return "q-norm" if any(t.name.endswith(".attn_q_norm.weight") for t in tensors) else "centred"


def setting_label(cfg: dict[str, Any]) -> str:
    """A setting by what it is (the SqueezeConfig fields), whatever a run named it. Fields a set's record lacks take
    the value the code had when it ran: var_weight 0 (before the variance rule), 8 iterations, even seeds, the
    calibrated threshold (before the per-row budget)."""
    label = f"keep {cfg['keep']:g}, {cfg['group']}, {cfg['centroids']:g} clusters, w {cfg.get('var_weight', 0.0):g}"
    if cfg.get("rule", "threshold") == "budget":
        label += ", per-row budget"
    if cfg.get("clustering") == "q-norm":
        label += ", q-norm clustering"
    if cfg.get("levels", 1) == 2:
        kc = cfg.get("keep_coarse")
        label += f", 2 levels ({cfg.get('centroids_coarse', 0.01):g} coarse, keep_coarse {'default' if kc is None else f'{kc:g}'})"
    if cfg.get("n_iter", 8) != 8:
        label += f", {cfg['n_iter']} iterations"
    if cfg.get("init", "even") != "even":
        label += f", {cfg['init']} seeds"
    return label


def set_settings(rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> SqueezeConfig fields of one set. The earliest records carry no "settings": their names were
    keep<k>-<group>, at the record's "centroids" and the centroid-only rule."""
    if "settings" in rec:
        return rec["settings"]
    names = [n for n in rec["examples"][0] if n.startswith("keep")]
    return {n: {"keep": float(n[4:].split("-")[0]), "group": n.split("-")[1], "centroids": rec["centroids"],
                "levels": 1, "var_weight": 0.0} for n in names}


def summarise(sets: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting (and prefix length): the held-out sets pooled, seeds run for selection of that setting left out."""
    selected: set[tuple[str, int, int]] = set()
    for rec in sets:
        if rec["purpose"] == "selection":
            for cfg in set_settings(rec).values():
                selected.add((setting_label(cfg), rec["length"], rec["seed"]))
    pooled: dict[str, dict[str, Any]] = {}
    for rec in sets:
        if rec["purpose"] != "held-out":
            continue
        dense_ok = [ex["dense"]["correct"] for ex in rec["examples"]]
        for name, cfg in set_settings(rec).items():
            label = setting_label(cfg)
            if (label, rec["length"], rec["seed"]) in selected:
                continue
            haystack = rec.get("haystack", "plays")
            key = f"{label}; {rec['length']} tokens" + ("" if haystack == "plays" else f", {haystack}")
            p = pooled.setdefault(key, {"seeds": [], "examples": 0, "dense": 0, "of_dense": 0, "correct": 0})
            if rec["seed"] in p["seeds"]:
                p.setdefault("repeated_seeds", []).append(rec["seed"])  # counted once: the first set recorded
                continue
            ok = [ex[name]["correct"] for ex in rec["examples"]]
            p["seeds"].append(rec["seed"])
            p["examples"] += len(ok)
            p["dense"] += sum(dense_ok)
            p["of_dense"] += sum(1 for d, o in zip(dense_ok, ok) if d and o)
            p["correct"] += sum(ok)
    for p in pooled.values():
        p["sets"] = len(p["seeds"])
        p["share_of_dense"] = p["of_dense"] / p["dense"] if p["dense"] else None
    from sparq_llama.squeeze import SqueezeConfig  # the defaults as the code has them now

    defaults = {**SqueezeConfig().__dict__, "rule": RULE}
    # the clustering the code runs now, as the newest set recorded it (one model per file; older sets: centred)
    recorded = [cfg["clustering"] for rec in sets for cfg in set_settings(rec).values() if "clustering" in cfg]
    if recorded:
        defaults["clustering"] = recorded[-1]
    return {"defaults": setting_label(defaults),
            "target": "share_of_dense >= 0.95 at keep 0.1",
            "by_setting": dict(sorted(pooled.items()))}


def load_sets(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["sets"] if path.exists() else []


def save_sets(path: Path, sets: list[dict[str, Any]]) -> dict[str, Any]:
    summary = summarise(sets)
    models = sorted({s.get("model", "smollm2") for s in sets})  # sets before --model existed ran SmolLM2
    write_record(path, {"bench": "squeeze_quality", "model": ", ".join(models),
                        "task": "needle retrieval with 2 distractors", "summary": summary, "sets": sets})
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    for key, p in summary["by_setting"].items():
        mark = "  (defaults)" if key.startswith(summary["defaults"] + ";") else ""
        share = f"{p['share_of_dense']:.1%}" if p["share_of_dense"] is not None else "-"
        print(f"{key}: {p['sets']} sets, {p['of_dense']} of dense's {p['dense']} ({share}), {p['correct']} correct "
              f"of {p['examples']}{mark}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n", type=int, default=10, help="examples (spread over depths 0.1 .. 0.9)")
    ap.add_argument("--settings", default="0.3:max,0.2:max,0.1:max,0.1:mean",
                    help="comma-separated keep:group[:centroids[:levels[:var[:kc[:it[:init]]]]]] (centroids default "
                         "--centroids, levels 1, var: the kept rule's var_weight, kc: keep_coarse (0: the default), "
                         "it: k-means iterations at most, init: even or kpp; defaults SqueezeConfig's)")
    ap.add_argument("--centroids", type=float, default=squeeze.SqueezeConfig().centroids,
                    help="cluster fraction of settings that name none (default: SqueezeConfig's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2", help="a model of sparq_llama.models (smollm2, gemma3)")
    ap.add_argument("--haystack", choices=sorted(tasks.HAYSTACKS), default="plays",
                    help="the kind of text the needles hide in (sets without the field: plays)")
    ap.add_argument("--seed", type=int, default=0, help="example set (0: the set the defaults were chosen on)")
    ap.add_argument("--out", type=Path, default=RESULTS / "squeeze_quality.json", help="the file of all sets")
    ap.add_argument("--purpose", choices=PURPOSES, default=None,
                    help="of the set run or merged (default: held-out for seeds >= 1, development for seed 0)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="SET_JSON",
                    help="append these sets (a set's record, or the sets of another run's --out file) to --out "
                         "instead of running")
    ap.add_argument("--summary", action="store_true", help="recompute and print the summary of --out, run nothing")
    args = ap.parse_args()

    sets = load_sets(args.out)
    if args.summary or args.merge:
        for path in args.merge or []:
            rec = json.loads(path.read_text())
            for one in rec["sets"] if "sets" in rec else [rec]:  # another run's --out file, or one set's record
                one.setdefault("seed", 0)  # runs before --seed existed used seed 0's examples
                purpose = args.purpose or one.pop("purpose", None) or ("held-out" if one["seed"] else "development")
                sets.append({"purpose": purpose, **one})
        print_summary(save_sets(args.out, sets) if args.merge else summarise(sets))
        return 0

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
    engine, examples = retrieval_setup(args.length, args.n, args.threads, args.seed, args.model, args.haystack)

    def score_settings(ex: tasks.Example) -> dict[str, dict]:
        out = {}
        for name, config in settings:
            engine.truncate(len(ex.context))
            info = squeeze.prepare(engine.ctx, ex.context, config)
            out[name] = {**tasks.score(engine, ex), "n_layers": info.n_layers}
            engine.truncate(len(ex.context))
            squeeze.clear(engine.ctx)
        return out

    t0 = time.time()
    records = run_examples(engine, examples, score_settings)
    names = ["dense"] + [name for name, _ in settings]
    acc = accuracy(records, names)
    rel = {n: (acc[n] / acc["dense"] if acc["dense"] else None) for n in names}
    sets.append({"purpose": args.purpose or ("held-out" if args.seed else "development"),
                 **provenance("squeeze_quality"), "model": args.model, "length": args.length, "n": len(records),
                 "haystack": args.haystack,
                 "settings": {name: {**config.__dict__, "rule": RULE, "clustering": clustering_of(args.model)}
                              for name, config in settings},
                 "threads": args.threads, "seed": args.seed, "accuracy": acc, "relative_to_dense": rel,
                 "wall_s": round(time.time() - t0, 1), "examples": records})
    print_summary(save_sets(args.out, sets))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
