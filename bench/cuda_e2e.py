#!/usr/bin/env python3
"""Benchmark (b): end-to-end decode speed on CUDA, dense flash attention vs SparQ, with llama-bench.

Random-weight GGUFs of the Llama-2-7B and Llama-3-8B shapes (Q8_0 weights, f16 KV; sparq_llama.eval.random_gguf),
llama-bench tg32 at depths 4k / 8k / 16k / 32k / 64k, -fa 1 -ngl 99, SparQ at the default index (q8 + qsigma, k1 = d/2:
1/8 of dense bytes), k2 = 128 on every layer
(-sparq-min-kv 0). Writes bench/results/cuda_e2e.json: rows {model_shape, depth, dense_tps, sparq_tps, speedup},
the targets, and llama-bench's raw JSON.

    python bench/cuda_e2e.py --bin build/cuda/bin --models /tmp/models [--reps 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from record import RESULTS, provenance, write_record
from sparq_llama.eval.random_gguf import SHAPES, write_model

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO / "vendor" / "llama.cpp" / "models"  # the pinned tree's tokenizers (present after a build)
SPARQ_ARGS = ["-k2", "128", "-sparq-min-kv", "0"]  # default index and k1; the kernel at every depth, not the GPU default
TARGETS = {("llama2-7b", 32768): 1.9, ("llama2-7b", 65536): 2.5, ("llama3-8b", 32768): 1.3, ("llama3-8b", 65536): 1.55}


def model_path(models: Path, shape: str) -> Path:
    """The random-weight Q8_0 model of `shape` in `models`, written on first use."""
    path = models / f"random-{shape}-q8_0.gguf"
    if not path.exists():
        t0 = time.time()
        write_model(SHAPES[shape], path, VOCAB)
        print(f"made {path} in {time.time() - t0:.0f} s", flush=True)
    return path


def run_tool(cmd: list[str], timeout: int) -> str:
    """Runs one llama.cpp tool; its stdout, or an error with the end of its stderr."""
    print("running:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def measure(bin_dir: Path, models: Path, depths: list[int], reps: int) -> dict[str, Any]:
    rows, raw = [], {}
    for shape in ("llama2-7b", "llama3-8b"):
        model = model_path(models, shape)
        cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-ngl", "99", "-fa", "1", "-ctk", "f16", "-ctv", "f16",
               "-p", "0", "-n", "32", "-r", str(reps), "-d", ",".join(map(str, depths)), "-sparq", "0,1",
               *SPARQ_ARGS, "-o", "json"]
        out = json.loads(run_tool(cmd, timeout=3000))
        raw[shape] = {"command": " ".join(cmd), "output": out}
        tps = {(int(r["n_depth"]), bool(r["sparq"])): float(r["avg_ts"]) for r in out}
        for depth in depths:
            dense, sparq = tps[(depth, False)], tps[(depth, True)]
            device = next((r.get("gpu_info") for r in out if r.get("gpu_info")), "")
            rows.append(dict(model_shape=shape, depth=depth, dense_tps=dense, sparq_tps=sparq, speedup=sparq / dense,
                             device=device))
            print(f"{shape} depth {depth}: dense {dense:.1f} t/s, SparQ {sparq:.1f} t/s, {sparq / dense:.2f}x",
                  flush=True)
    targets = []
    for (shape, depth), want in TARGETS.items():
        row = next((r for r in rows if r["model_shape"] == shape and r["depth"] == depth), None)
        targets.append(dict(model_shape=shape, depth=depth, target=want,
                            measured=row["speedup"] if row else None, met=bool(row and row["speedup"] >= want)))
    return dict(rows=rows, targets=targets, raw=raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, required=True, help="directory with llama-bench")
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--depths", default="4096,8192,16384,32768,65536")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda_e2e.json")
    args = ap.parse_args()
    record = provenance("cuda_e2e")
    record.update(measure(args.bin, args.models, [int(x) for x in args.depths.split(",")], args.reps))
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
