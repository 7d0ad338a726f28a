#!/usr/bin/env python3
"""ggml_sparq_attn vs ggml_flash_attn_ext on the CPU: one decode step, same shapes, f16 KV.

Shapes: Llama-2-7B heads (32 q / 32 kv, d=128) and SmolLM2 heads (9 q / 3 kv, d=64); S in {2k, 8k, 32k};
the f16 index at k1 = d/4 (the paper's), k2 = 128; threads 1 and 2; median of N interleaved runs. Prints the measured
speedup next to the paper's data-transfer ratio and writes bench/results/op_cpu.json (machine, commit, command, raw
times). `--index q8,q4` measures those indexes instead (each at its default k1, select qsigma where it chooses
components), one after another per configuration, so their ratio is taken in one run.

    .venv/bin/python bench/op_cpu.py [--runs 30] [--out bench/results/op_cpu.json]
    .venv/bin/python bench/op_cpu.py --index q8,q4 --threads 2 --out bench/results/op_cpu_index.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from head_shapes import HEAD_SHAPES
from record import RESULTS, append_run, provenance, write_record
from sparq_llama import ops
from sparq_llama.sparq import INDEXES, default_k1, transfer_ratio
from tqdm import tqdm

SHAPES = ("llama2-7b", "smollm2")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seqs", default="2048,8192,32768")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layout", default="kt", choices=["kt", "default"])
    ap.add_argument("--index", default="f16", help=f"comma-separated indexes of {INDEXES} (f16: k1 = d/4, select q)")
    ap.add_argument("--out", type=Path, default=RESULTS / "op_cpu.json")
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()

    indexes = args.index.split(",")
    if any(i not in INDEXES for i in indexes):
        ap.error(f"--index takes {INDEXES}, got {args.index!r}")
    configs = [(shape, int(s), int(t), i) for shape in args.shapes.split(",") for s in args.seqs.split(",")
               for t in args.threads.split(",") for i in indexes]
    rows = []
    print(f"{'shape':10s} {'S':>6s} {'thr':>3s} {'index':>5s} {'sparq ms':>9s} {'flash ms':>9s} {'speedup':>8s} "
          f"{'theory':>7s}")
    for shape, n_kv, threads, index in tqdm(configs, desc="op_cpu", leave=False):
        sh = HEAD_SHAPES[shape].op_args()
        k1, k2 = (sh["d"] // 4 if index == "f16" else default_k1(sh["d"], index)), 128
        select = "q" if index == "f16" else "qsigma"
        sparq_us, flash_us = ops.bench_attn(**sh, n_kv=n_kv, k1=k1, k2=k2, n_runs=args.runs, n_threads=threads,
                                            layout=args.layout, index=index, select=select)
        speedup = float(np.median(flash_us) / np.median(sparq_us))
        theory = transfer_ratio(n_kv, sh["d"], k1, k2, mean=sh["n_head"] == sh["n_head_kv"], index=index)
        rows.append({"shape": shape, **sh, "n_kv": n_kv, "threads": threads, "index": index, "select": select,
                     "k1": k1, "k2": k2,
                     "layout": args.layout, "kv_type": "f16", "sparq_us": sparq_us.tolist(),
                     "flash_us": flash_us.tolist(), "sparq_median_us": float(np.median(sparq_us)),
                     "flash_median_us": float(np.median(flash_us)), "speedup": speedup, "transfer_ratio": theory})
        tqdm.write(f"{shape:10s} {n_kv:6d} {threads:3d} {index:>5s} {np.median(sparq_us) / 1e3:9.3f} "
                   f"{np.median(flash_us) / 1e3:9.3f} {speedup:7.2f}x {theory:6.2f}x")
    record = {**provenance("op_cpu"), "runs": args.runs, "results": rows}
    (append_run if args.append else write_record)(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
