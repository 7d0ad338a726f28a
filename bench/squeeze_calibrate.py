#!/usr/bin/env python3
"""Calibration time of a prepared prefix (the threshold search of llama_squeeze_prepare, on the host), through
sparq_llama.ops.squeeze_calibrate on random tables and queries of a model shape.

    python bench/squeeze_calibrate.py --shape llama2-7b --prefix 32768 --layers 4   # then scale by 32/4
    python bench/squeeze_calibrate.py --shape smollm2 --prefix 8192

The tables are random (Gaussian centroids, sizes 1..40): the work per (layer, KV head, row) does not depend on
the values, so the time is that of a real prefix of the same sizes. Prints seconds per run and per layer.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from head_shapes import HEAD_SHAPES
from sparq_llama import ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(HEAD_SHAPES), default="llama2-7b")
    ap.add_argument("--prefix", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=0, help="layers to time (default: the shape's)")
    ap.add_argument("--calib", type=int, default=100)
    ap.add_argument("--centroids", type=float, default=0.05)
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--levels", type=int, choices=(1, 2), default=1)
    ap.add_argument("--group", choices=("max", "mean"), default="max")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    hs = HEAD_SHAPES[args.shape]
    n_layer_shape, n_head, n_head_kv, d = hs.n_layer, hs.n_head, hs.n_head_kv, hs.d
    n_layer = args.layers or n_layer_shape
    n_cent = max(1, round(args.centroids * (args.prefix - args.calib)))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n_layer, args.calib, n_head, d), dtype=np.float32)
    table = np.empty((n_layer, n_head_kv, n_cent, d + 1), dtype=np.float32)
    table[..., :d] = rng.standard_normal((n_layer, n_head_kv, n_cent, d), dtype=np.float32)
    table[..., d] = rng.integers(1, 41, size=(n_layer, n_head_kv, n_cent))
    coarse = parent = None
    if args.levels == 2:
        n_coarse = max(1, round(0.01 * (args.prefix - args.calib)))
        parent = rng.integers(0, n_coarse, size=(n_layer, n_head_kv, n_cent)).astype(np.int32)
        coarse = np.empty((n_layer, n_head_kv, n_coarse, d + 1), dtype=np.float32)
        coarse[..., :d] = rng.standard_normal((n_layer, n_head_kv, n_coarse, d), dtype=np.float32)
        coarse[..., d] = n_cent * 20 / n_coarse
    scale = 1.0 / np.sqrt(d)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        t, tc, kept = ops.squeeze_calibrate(q, table, scale=scale, keep=args.keep, group=args.group, coarse=coarse,
                                            parent=parent, n_threads=args.threads)
        times.append(time.perf_counter() - t0)
    best = min(times)
    print(f"{args.shape} prefix {args.prefix}: {n_layer} layers x {n_head_kv} KV heads x {args.calib} rows x {n_cent} "
          f"clusters x d {d}, {args.threads} threads: best {best:.3f} s of {args.reps} ({best / n_layer:.4f} s/layer, "
          f"{best / n_layer * n_layer_shape:.2f} s for {n_layer_shape} layers); T = {t:.6g}, coarse T = {tc:.6g}, "
          f"kept {100 * kept:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
