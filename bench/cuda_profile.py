#!/usr/bin/env python3
"""One decode step of ggml_sparq_attn and flash attention on CUDA, for profilers (ncu) to time per kernel.

    ncu --metrics gpu__time_duration.sum python bench/cuda_profile.py --seq 32768 --batch 1
"""
from __future__ import annotations

import argparse

import numpy as np
from sparq_llama import ops

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--seq", type=int, default=32768)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--runs", type=int, default=2)
ap.add_argument("--heads", type=int, nargs=2, default=[32, 32], metavar=("N_HEAD", "N_HEAD_KV"))
args = ap.parse_args()
sparq_us, flash_us = ops.bench_attn(d=128, n_head=args.heads[0], n_head_kv=args.heads[1], n_kv=args.seq, k1=32,
                                    k2=128, n_runs=args.runs, backend="cuda", n_seq=args.batch)
print(f"S={args.seq} B={args.batch}: sparq {np.median(sparq_us):.1f} us, flash {np.median(flash_us):.1f} us")
