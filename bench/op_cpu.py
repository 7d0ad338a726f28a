#!/usr/bin/env python3
"""ggml_sparq_attn vs ggml_flash_attn_ext on the CPU: one decode step, same shapes, f16 KV.

Shapes: Llama-2-7B heads (32 q / 32 kv, d=128) and SmolLM2 heads (9 q / 3 kv, d=64); S in {2k, 8k, 32k};
k1 = d/4, k2 = 128; threads 1 and 2; median of N interleaved runs. Prints the measured speedup next to the
paper's data-transfer ratio and writes bench/results/op_cpu.json (machine, commit, command, raw times).

    .venv/bin/python bench/op_cpu.py [--runs 20] [--out bench/results/op_cpu.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import sparq_llama
from cuda_common import write_record
from head_shapes import HEAD_SHAPES
from sparq_llama import ops
from sparq_llama.reference import transfer_ratio
from tqdm import tqdm

SHAPES = ("llama2-7b", "smollm2")


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = ""
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "platform": platform.platform(),
            "avx512": " avx512f " in flags, "avx2": " avx2 " in flags}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seqs", default="2048,8192,32768")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layout", default="kt", choices=["kt", "default"])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "op_cpu.json")
    args = ap.parse_args()

    configs = [(shape, int(s), int(t)) for shape in args.shapes.split(",") for s in args.seqs.split(",")
               for t in args.threads.split(",")]
    rows = []
    print(f"{'shape':10s} {'S':>6s} {'thr':>3s} {'sparq ms':>9s} {'flash ms':>9s} {'speedup':>8s} {'theory':>7s}")
    for shape, n_kv, threads in tqdm(configs, desc="op_cpu", leave=False):
        sh = HEAD_SHAPES[shape].op_args()
        k1, k2 = sh["d"] // 4, 128
        sparq_us, flash_us = ops.bench_attn(**sh, n_kv=n_kv, k1=k1, k2=k2, n_runs=args.runs, n_threads=threads,
                                            layout=args.layout)
        speedup = float(np.median(flash_us) / np.median(sparq_us))
        theory = transfer_ratio(n_kv, sh["d"], k1, k2, mean=sh["n_head"] == sh["n_head_kv"])
        rows.append({"shape": shape, **sh, "n_kv": n_kv, "threads": threads, "k1": k1, "k2": k2,
                     "layout": args.layout, "kv_type": "f16", "sparq_us": sparq_us.tolist(),
                     "flash_us": flash_us.tolist(), "sparq_median_us": float(np.median(sparq_us)),
                     "flash_median_us": float(np.median(flash_us)), "speedup": speedup, "transfer_ratio": theory})
        tqdm.write(f"{shape:10s} {n_kv:6d} {threads:3d} {np.median(sparq_us) / 1e3:9.3f} "
                   f"{np.median(flash_us) / 1e3:9.3f} {speedup:7.2f}x {theory:6.2f}x")
    result = {"bench": "op_cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit(),
              "command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "machine": machine(),
              "build": sparq_llama.build_info(), "runs": args.runs, "results": rows}
    write_record(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
