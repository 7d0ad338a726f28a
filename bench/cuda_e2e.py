#!/usr/bin/env python3
"""Benchmark (b): end-to-end decode speed on CUDA, dense flash attention vs SparQ, with llama-bench.

Random-weight GGUFs of the Llama-2-7B and Llama-3-8B shapes (Q8_0 weights, f16 KV; sparq_llama.eval.random_gguf),
llama-bench tg32 at depths 4k / 8k / 16k / 32k / 64k, -fa 1 -ngl 99, SparQ at the default index (q8 + qsigma, k1 = d/2:
1/8 of dense bytes), k2 = 128 on every layer
(-sparq-min-kv 0). Writes bench/results/cuda_e2e.json: rows {model_shape, depth, dense_tps, sparq_tps, speedup},
the targets, and llama-bench's raw JSON.

    python bench/cuda_e2e.py --bin build/cuda/bin --models /tmp/models [--reps 2]

With --base-bin (another build's llama-bench, e.g. the base commit of bench/device.sh) it compares two builds
instead: the same runs for both, interleaved in rounds so that a drift of the machine hits both, written to
bench/results/cuda_e2e_ab.json: rows {model_shape, depth, build, round, dense_tps, sparq_tps} and per shape and depth
the medians' ratio head / base, for SparQ and for dense (the control: code that only SparQ runs leaves it at ~1).

    python bench/cuda_e2e.py --bin build/cuda/bin --base-bin build/base-src/build/cuda/bin --rounds 2

With --indexes (e.g. q8,q4) SparQ runs once per index in the same llama-bench call (dense once), written to
bench/results/cuda_e2e_index.json: the rows above with the index named, and per shape and depth each index's
speedup.

    python bench/cuda_e2e.py --bin build/cuda/bin --indexes q8,q4 --depths 32768,65536
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from record import RESULTS, Checkpoint, checkpointer, provenance, write_record
from sparq_llama.eval.random_gguf import SHAPES, write_model

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO / "vendor" / "llama.cpp" / "models"  # the pinned tree's tokenizers (present after a build)
SPARQ_ARGS = ["-k2", "128", "-sparq-min-kv", "0"]  # default index and k1; the kernel at every depth, not the GPU default
TARGETS = {("llama2-7b", 32768): 1.9, ("llama2-7b", 65536): 2.5, ("llama3-8b", 32768): 1.3, ("llama3-8b", 65536): 1.55}


def model_path(models: Path, shape: str, layers: int | None = None) -> Path:
    """The random-weight Q8_0 model of `shape` in `models` (cut to its first `layers` layers where given), written on
    first use."""
    path = models / f"random-{shape}-{f'{layers}l-' if layers else ''}q8_0.gguf"
    if not path.exists():
        t0 = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(dataclasses.replace(SHAPES[shape], n_layer=layers) if layers else SHAPES[shape], path, VOCAB)
        print(f"made {path} in {time.time() - t0:.0f} s", flush=True)
    return path


def run_tool(cmd: list[str], timeout: int) -> str:
    """Runs one llama.cpp tool; its stdout, or an error with the end of its stderr."""
    print("running:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def llama_bench(bin_dir: Path, model: Path, depths: list[int], reps: int,
                indexes: list[str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """tg32 at each depth, dense and SparQ (with each of `indexes` where given): the command and llama-bench's JSON
    rows."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-ngl", "99", "-fa", "1", "-ctk", "f16", "-ctv", "f16",
           "-p", "0", "-n", "32", "-r", str(reps), "-d", ",".join(map(str, depths)), "-sparq", "0,1",
           *SPARQ_ARGS, *(["-sparq-index", ",".join(indexes)] if indexes else []), "-o", "json"]
    return " ".join(cmd), json.loads(run_tool(cmd, timeout=3000))


def tps_of(out: list[dict[str, Any]]) -> dict[tuple[int, bool], float]:
    return {(int(r["n_depth"]), bool(r["sparq"])): float(r["avg_ts"]) for r in out}


def measure(bin_dir: Path, models: Path, depths: list[int], reps: int, shapes: list[str],
            indexes: list[str] | None = None, checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """Dense and SparQ per shape and depth in one llama-bench call per shape; with `indexes`, SparQ with each of them
    (rows name their index; no targets: those are the default's). The rows so far go to checkpoint after each shape."""
    rows, raw = [], {}
    for shape in shapes:
        command, out = llama_bench(bin_dir, model_path(models, shape), depths, reps, indexes)
        raw[shape] = {"command": command, "output": out}
        dense_tps = {int(r["n_depth"]): float(r["avg_ts"]) for r in out if not r["sparq"]}
        sparq_tps = {(int(r["n_depth"]), r.get("sparq_index") if indexes else None): float(r["avg_ts"])
                     for r in out if r["sparq"]}
        device = next((r.get("gpu_info") for r in out if r.get("gpu_info")), "")
        for depth in depths:
            dense = dense_tps[depth]
            for index in indexes or [None]:
                sparq = sparq_tps[(depth, index)]
                named = dict(index=index) if index else {}
                rows.append(dict(model_shape=shape, depth=depth, **named, dense_tps=dense, sparq_tps=sparq,
                                 speedup=sparq / dense, device=device))
                print(f"{shape} depth {depth}{' ' + index if index else ''}: dense {dense:.1f} t/s, "
                      f"SparQ {sparq:.1f} t/s, {sparq / dense:.2f}x", flush=True)
        if checkpoint:
            checkpoint(dict(rows=rows, raw=raw), f"{len(raw)} of {len(shapes)} shapes measured")
    if indexes:
        return dict(rows=rows, raw=raw)
    targets = []
    for (shape, depth), want in TARGETS.items():
        row = next((r for r in rows if r["model_shape"] == shape and r["depth"] == depth), None)
        targets.append(dict(model_shape=shape, depth=depth, target=want,
                            measured=row["speedup"] if row else None, met=bool(row and row["speedup"] >= want)))
    return dict(rows=rows, targets=targets, raw=raw)


def measure_ab(builds: dict[str, Path], models: Path, depths: list[int], reps: int, rounds: int,
               shapes: list[str], checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """The same runs on each build, the builds interleaved within every round; the rows so far go to checkpoint after
    each llama-bench call."""
    rows, raw = [], []
    for rnd in range(1, rounds + 1):
        for shape in shapes:
            for build, bin_dir in builds.items():
                command, out = llama_bench(bin_dir, model_path(models, shape), depths, reps)
                raw.append({"build": build, "round": rnd, "model_shape": shape, "command": command, "output": out})
                tps = tps_of(out)
                for depth in depths:
                    rows.append(dict(model_shape=shape, depth=depth, build=build, round=rnd,
                                     dense_tps=tps[(depth, False)], sparq_tps=tps[(depth, True)]))
                if checkpoint:
                    checkpoint(dict(rows=rows, raw=raw),
                               f"{len(raw)} of {rounds * len(shapes) * len(builds)} llama-bench runs measured")
    summary = []
    for shape in shapes:
        for depth in depths:
            med = {(b, k): statistics.median(r[k] for r in rows if r["model_shape"] == shape and r["depth"] == depth
                                             and r["build"] == b)
                   for b in builds for k in ("dense_tps", "sparq_tps")}
            row = dict(model_shape=shape, depth=depth,
                       **{f"{b}_{k}": med[(b, k)] for b in builds for k in ("dense_tps", "sparq_tps")},
                       sparq_head_over_base=med[("head", "sparq_tps")] / med[("base", "sparq_tps")],
                       dense_head_over_base=med[("head", "dense_tps")] / med[("base", "dense_tps")])
            summary.append(row)
            print(f"{shape} depth {depth}: SparQ head / base {row['sparq_head_over_base']:.3f}, "
                  f"dense {row['dense_head_over_base']:.3f}", flush=True)
    return dict(rows=rows, summary=summary, raw=raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, required=True, help="directory with llama-bench")
    ap.add_argument("--base-bin", type=Path, help="another build's directory with llama-bench: compare the two")
    ap.add_argument("--rounds", type=int, default=2, help="with --base-bin: rounds of both builds")
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--depths", default="4096,8192,16384,32768,65536")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--indexes", help="SparQ indexes to compare in one run (of f16, q8, q4), e.g. q8,q4")
    ap.add_argument("--out", type=Path, help="default: bench/results/cuda_e2e.json (cuda_e2e_ab.json with --base-bin, "
                                             "cuda_e2e_index.json with --indexes)")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    depths = [int(x) for x in args.depths.split(",")]
    indexes = args.indexes.split(",") if args.indexes else []
    if unknown := [x for x in indexes if x not in ("f16", "q8", "q4")]:
        ap.error(f"--indexes: unknown {', '.join(unknown)} (known: f16, q8, q4)")
    if indexes and args.base_bin:
        ap.error("--indexes and --base-bin: one comparison a run")
    name = "cuda_e2e_index" if indexes else "cuda_e2e_ab" if args.base_bin else "cuda_e2e"
    out = args.out or RESULTS / f"{name}.json"
    record = provenance(name)
    checkpoint = checkpointer(out, record)
    if args.base_bin:
        record.update(measure_ab({"head": args.bin, "base": args.base_bin}, args.models, depths, args.reps,
                                 args.rounds, shapes, checkpoint))
    else:
        record.update(measure(args.bin, args.models, depths, args.reps, shapes, indexes or None, checkpoint))
    write_record(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
