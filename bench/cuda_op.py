#!/usr/bin/env python3
"""Benchmark (a): ggml_sparq_attn vs ggml_flash_attn_ext on CUDA, one decode step.

Llama-2-7B heads (32 q / 32 kv, d = 128; `--heads llama3-8b`: 32 q / 8 kv), f16 KV, the default index and selection
(q8 + qsigma; `--index f16 --select q`: the paper's), k1 = the index's default (1/8 of dense bytes: d/2 for q8, d/4 for
f16), k2 = 128, S in {4k, 8448, 32k, 33024, 65792, 128k} (8448, 33024 and 65792: llama-bench's caches at depth 8k,
32k and 64k), B in {1, 16} sequences (streams of S cells each). Median of N interleaved runs per op. Reports time, the
bandwidth each op achieves on the paper's transfer model, the speedup and the speedup the model predicts.

    python bench/cuda_op.py [--runs 50] [--out bench/results/cuda_op.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from head_shapes import HEAD_SHAPES
from record import RESULTS, provenance, write_record
from sparq_llama import ops
from sparq_llama.sparq import DEFAULT_INDEX, DEFAULT_SELECT, INDEXES, SELECTS, default_k1, transfer_bytes, transfer_ratio

HEADS = HEAD_SHAPES["llama2-7b"].op_args()  # --heads sets it


def bytes_moved(s: int, b: int, k1: int, k2: int, sparq: bool, index: str) -> float:
    """Bytes per step of B sequences on the transfer model (f16 K/V, mean on as for MHA heads)."""
    dense, sparse = transfer_bytes(s, HEADS["d"], k1, k2, mean=True, index=index)
    return (sparse if sparq else dense) * HEADS["n_head_kv"] * b


def measure(s: int, b: int, k1: int, k2: int, runs: int, index: str, select: str) -> dict:
    sparq_us, flash_us = ops.bench_attn(**HEADS, n_kv=s, k1=k1, k2=k2, n_runs=runs, backend="cuda", n_seq=b,
                                        mean="auto", index=index, select=select)
    ts, tf = float(np.median(sparq_us)), float(np.median(flash_us))
    return dict(S=s, B=b, sparq_us=ts, flash_us=tf, speedup=tf / ts,
                theory=transfer_ratio(s, HEADS["d"], k1, k2, index=index),
                sparq_gbps=bytes_moved(s, b, k1, k2, True, index) / ts / 1e3,
                flash_gbps=bytes_moved(s, b, k1, k2, False, index) / tf / 1e3,
                raw_sparq_us=[float(x) for x in sparq_us], raw_flash_us=[float(x) for x in flash_us])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seqs", default="4096,8448,32768,33024,65792,131072")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--k1", type=int, default=0, help="0: the index's default, 1/8 of dense bytes")
    ap.add_argument("--index", choices=INDEXES, default=DEFAULT_INDEX)
    ap.add_argument("--select", choices=SELECTS, default=DEFAULT_SELECT)
    ap.add_argument("--k2", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda_op.json")
    ap.add_argument("--heads", choices=("llama2-7b", "llama3-8b"), default="llama2-7b", help="the attention shape")
    ap.add_argument("--one", type=int, nargs=2, metavar=("S", "B"),
                    help="measure one (S, B) in this process and print it as JSON (for profilers)")
    args = ap.parse_args()
    HEADS.update(HEAD_SHAPES[args.heads].op_args())
    args.k1 = args.k1 or default_k1(HEADS["d"], args.index)
    if args.one:
        print(json.dumps(measure(*args.one, args.k1, args.k2, args.runs, args.index, args.select)))
        return 0

    rows = []
    print(f"{'S':>7} {'B':>3} {'sparq us':>9} {'flash us':>9} {'sparq GB/s':>10} {'flash GB/s':>10} "
          f"{'speedup':>8} {'theory':>7}", flush=True)
    for b in (int(x) for x in args.batches.split(",")):
        for s in (int(x) for x in args.seqs.split(",")):
            # one process per configuration: a failure (a CUDA error aborts the process) is recorded, not fatal
            proc = subprocess.run([sys.executable, __file__, "--one", str(s), str(b), "--runs", str(args.runs),
                                   "--k1", str(args.k1), "--k2", str(args.k2), "--heads", args.heads,
                                   "--index", args.index, "--select", args.select],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                rows.append(dict(S=s, B=b, error=proc.stderr[-2000:]))
                print(f"{s:>7} {b:>3} failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{s:>7} {b:>3} {row['sparq_us']:>9.1f} {row['flash_us']:>9.1f} {row['sparq_gbps']:>10.0f} "
                  f"{row['flash_gbps']:>10.0f} {row['speedup']:>7.2f}x {row['theory']:>6.2f}x", flush=True)

    def speedup_at(s: int) -> float | None:
        row = next((r for r in rows if r["S"] == s and r["B"] == 1 and "error" not in r), None)
        return row["speedup"] if row else None
    target = [{"what": f"speedup >= {x}x at S = {s}, B = 1", "measured": speedup_at(s),
               "met": bool(speedup_at(s) and speedup_at(s) >= x)} for s, x in ((32768, 4.0), (131072, 6.0))]
    result = dict(provenance("cuda_op"), params=dict(HEADS, k1=args.k1, k2=args.k2, kv="f16", index=args.index,
                                             select=args.select, runs=args.runs,
                                             mean="auto (on: MHA)", statistic="median"),
                  target=target,
                  rows=rows)
    write_record(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
