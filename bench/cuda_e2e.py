#!/usr/bin/env python3
"""Benchmarks (b) and (c) of issue 6: end-to-end decode speed on CUDA, dense flash attention vs SparQ.

Random-weight GGUFs of the Llama-2-7B and Llama-3-8B shapes (Q8_0 weights, f16 KV; bench/random_gguf.py).
  (b) llama-bench tg at depths 4k / 16k / 32k / 64k, -fa 1 -ngl 99, SparQ k1 = 32, k2 = 128
      -> bench/results/cuda_e2e.json, rows {model_shape, depth, dense_tps, sparq_tps, speedup, device}
  (c) llama-batched-bench -fa on -ngl 99 -ntg 32 -npl 1,4,8 (8k prompts for Llama-2, 16k for Llama-3)
      -> bench/results/cuda_batched.json, aggregate generation tokens/s per batch size

    python bench/cuda_e2e.py --bin build/cuda/bin --models /tmp/models [--part b|c|both]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_common import provenance, write_record  # noqa: E402
from random_gguf import SHAPES, write_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SPARQ_ARGS = ["-k1", "32", "-k2", "128", "-sparq-min-kv", "0"]  # the kernel at every depth, not the GPU default
TARGETS_B = {("llama2-7b", 65536): 2.5, ("llama2-7b", 32768): 1.9, ("llama3-8b", 65536): 1.55}
TARGETS_C = {"llama2-7b": 3.0, "llama3-8b": 2.4}
PROMPT_C = {"llama2-7b": 8192, "llama3-8b": 16384}


def model_path(models: Path, shape: str) -> Path:
    path = models / f"random-{shape}-q8_0.gguf"
    if not path.exists():
        t0 = time.time()
        write_model(SHAPES[shape], path)
        print(f"made {path} in {time.time() - t0:.0f} s", flush=True)
    return path


def run(cmd: list[str], timeout: int) -> str:
    print("running:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def part_b(bin_dir: Path, models: Path, depths: list[int], reps: int, dev: str) -> dict[str, Any]:
    rows, raw = [], {}
    for shape in ("llama2-7b", "llama3-8b"):
        model = model_path(models, shape)
        cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-ngl", "99", "-fa", "1", "-ctk", "f16", "-ctv", "f16",
               "-p", "0", "-n", "32", "-r", str(reps), "-d", ",".join(map(str, depths)), "-sparq", "0,1",
               *SPARQ_ARGS, "-o", "json"]
        out = json.loads(run(cmd, timeout=3000))
        raw[shape] = {"command": " ".join(cmd), "output": out}
        tps = {(int(r["n_depth"]), bool(r["sparq"])): float(r["avg_ts"]) for r in out}
        for depth in depths:
            dense, sparq = tps[(depth, False)], tps[(depth, True)]
            rows.append(dict(model_shape=shape, depth=depth, dense_tps=dense, sparq_tps=sparq,
                             speedup=sparq / dense, device=dev))
            print(f"{shape} depth {depth}: dense {dense:.1f} t/s, SparQ {sparq:.1f} t/s, {sparq / dense:.2f}x", flush=True)
    targets = []
    for (shape, depth), want in TARGETS_B.items():
        row = next((r for r in rows if r["model_shape"] == shape and r["depth"] == depth), None)
        targets.append(dict(model_shape=shape, depth=depth, target=want,
                            measured=row["speedup"] if row else None, met=bool(row and row["speedup"] >= want)))
    return dict(rows=rows, targets=targets, raw=raw)


_BATCHED_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


def parse_batched(text: str) -> list[dict[str, float]]:
    """The table llama-batched-bench prints: PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, T, S."""
    rows = []
    for line in text.splitlines():
        m = _BATCHED_ROW.match(line.strip())
        if m:
            pp, tg, b, n_kv = (int(m.group(i)) for i in range(1, 5))
            t_pp, s_pp, t_tg, s_tg, t, s = (float(m.group(i)) for i in range(5, 11))
            rows.append(dict(pp=pp, tg=tg, B=b, n_kv=n_kv, t_pp=t_pp, s_pp=s_pp, t_tg=t_tg, s_tg=s_tg, t=t, s=s))
    if not rows:
        raise RuntimeError(f"no table in llama-batched-bench output:\n{text[-2000:]}")
    return rows


def part_c(bin_dir: Path, models: Path, batches: list[int], dev: str) -> dict[str, Any]:
    rows, raw, targets = [], {}, []
    for shape in ("llama2-7b", "llama3-8b"):
        model = model_path(models, shape)
        pp = PROMPT_C[shape]
        n_ctx = max(batches) * (pp + 32)
        base = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
                "-ngl", "99", "-fa", "on", "-npp", str(pp), "-ntg", "32", "-npl", ",".join(map(str, batches))]
        tables = {}
        for mode, extra in (("dense", []), ("sparq", ["--sparq", "--k1", "32", "--k2", "128", "--sparq-min-kv", "0"])):
            out = run(base + extra, timeout=3000)
            tables[mode] = parse_batched(out)
            raw[f"{shape}/{mode}"] = {"command": " ".join(base + extra), "output": out}
        for b in batches:
            dense = next(r["s_tg"] for r in tables["dense"] if r["B"] == b)
            sparq = next(r["s_tg"] for r in tables["sparq"] if r["B"] == b)
            rows.append(dict(model_shape=shape, prompt=pp, B=b, dense_tg_tps=dense, sparq_tg_tps=sparq,
                             speedup=sparq / dense, device=dev))
            print(f"{shape} pp {pp} B {b}: dense {dense:.1f} t/s, SparQ {sparq:.1f} t/s, {sparq / dense:.2f}x", flush=True)
        row = next((r for r in rows if r["model_shape"] == shape and r["B"] == 8), None)
        targets.append(dict(model_shape=shape, B=8, target=TARGETS_C[shape],
                            measured=row["speedup"] if row else None, met=bool(row and row["speedup"] >= TARGETS_C[shape])))
    return dict(rows=rows, targets=targets, raw=raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, required=True, help="directory with llama-bench and llama-batched-bench")
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--part", choices=["b", "c", "both"], default="both")
    ap.add_argument("--depths", default="4096,16384,32768,65536")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    prov = provenance()
    dev = (prov["gpu"].get("gpus") or [{"name": "unknown"}])[0]["name"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.part in ("b", "both"):
        res = part_b(args.bin, args.models, [int(x) for x in args.depths.split(",")], args.reps, dev)
        write_record(RESULTS / "cuda_e2e.json", dict(prov, **res))
    if args.part in ("c", "both"):
        res = part_c(args.bin, args.models, [int(x) for x in args.batches.split(",")], dev)
        write_record(RESULTS / "cuda_batched.json", dict(prov, **res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
