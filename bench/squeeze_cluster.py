#!/usr/bin/env python3
"""Clustering time of a fixed prefix for centroid-sparse attention: spherical k-means as ggml graphs
(sparq_llama.ops.kmeans_cosine), one call per layer over its KV heads, for a model shape and prefix length.

    python bench/squeeze_cluster.py --shape smollm2 --prefix 8192            # the 2-core CPU target: <= 30 s
    python bench/squeeze_cluster.py --shape llama2-7b --prefix 32768 --backend cuda   # the H100 target: <= 5 s
    python bench/squeeze_cluster.py --shape llama2-7b --prefix 32768 --backend cuda --resident

Default: through sparq_llama.ops.kmeans_cosine, one call per layer, so each layer's time includes opening the
backend and uploading its keys from host memory. --resident: sparq_llama_bench_kmeans, the keys of each layer
already on the backend (as in a prepared KV cache; random values from a pool, not numpy's), one backend for all
layers; each layer's time is the clustering graph runs with their read-backs.

The keys are random (Gaussian): every problem runs the full --iters iterations (real keys, which cluster,
may stop earlier), so the time is an upper bound for that count. The last --calib cells stay exact (unclustered).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from record import RESULTS, append_run, provenance, write_record
from head_shapes import HEAD_SHAPES
from sparq_llama import ops
from tqdm import tqdm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(HEAD_SHAPES), default="smollm2")
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--calib", type=int, default=100)
    ap.add_argument("--centroids", type=float, default=0.05, help="clusters as a fraction of the clustered cells")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--init", choices=("even", "kpp"), default="even", help="initial centroids (SqueezeConfig.init)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--resident", action="store_true", help="keys already on the backend (see above)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: bench/results/squeeze_cluster.json, squeeze_cluster_<backend>.json off the CPU")
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()
    if args.out is None:
        args.out = RESULTS / ("squeeze_cluster.json" if args.backend == "cpu" else f"squeeze_cluster_{args.backend}.json")

    hs = HEAD_SHAPES[args.shape]
    n_layer, n_head_kv, d = hs.n_layer, hs.n_head_kv, hs.d
    P = args.prefix - args.calib
    n = max(1, round(args.centroids * P))
    per_layer, iters, phases = [], [], None
    if args.resident:
        per_layer, iters, phases = ops.bench_kmeans(d=d, P=P, H=n_head_kv, n_clusters=n, n_iter=args.iters,
                                                    n_layers=n_layer, init=args.init, n_threads=args.threads,
                                                    backend=args.backend)
    else:
        rng = np.random.default_rng(0)
        keys = rng.standard_normal((n_head_kv, P, d)).astype(np.float32)
        ops.kmeans_cosine(keys[:, :256], 8, n_iter=1, backend=args.backend, n_threads=args.threads)  # warm-up
        for _ in tqdm(range(n_layer), desc=f"clustering {n_layer} layers"):
            keys = rng.standard_normal((n_head_kv, P, d)).astype(np.float32)  # each layer its own keys
            t0 = time.perf_counter()
            res = ops.kmeans_cosine(keys, n, n_iter=args.iters, init=args.init, backend=args.backend,
                                    n_threads=args.threads)
            per_layer.append(time.perf_counter() - t0)
            iters.append(res[0].n_iter)
    total = float(np.sum(per_layer))
    where = f"{args.backend} (keys resident)" if args.resident else args.backend
    print(f"{args.shape}, prefix {args.prefix} ({P} clustered cells, {n} clusters per KV head, {n_head_kv} KV heads x "
          f"{n_layer} layers, d = {d}), {args.iters} iterations, {args.init} seeds, on {where}: {total:.2f} s "
          f"({np.mean(per_layer) * 1e3:.0f} ms per layer, iterations run {min(iters)}-{max(iters)})")
    if phases is not None:
        setup, iterations, table = phases.mean(axis=0) * 1e3
        print(f"per layer: setup {setup:.1f} ms, iterations {iterations:.1f} ms, table {table:.1f} ms")
    record = {**provenance("squeeze_cluster"), "shape": args.shape, "prefix": args.prefix, "clustered_cells": P, "clusters": n,
              "layers": n_layer, "kv_heads": n_head_kv, "head_dim": d, "iterations": args.iters, "init": args.init,
              "iterations_run": iters, "backend": args.backend, "threads": args.threads,
              "keys": "random Gaussian pool, on the backend (--resident)" if args.resident else "random Gaussian",
              "resident": args.resident,
              "total_s": total, "per_layer_s": per_layer,
              "phase_s": None if phases is None else {"setup": phases[:, 0].tolist(), "iterations": phases[:, 1].tolist(),
                                                      "table": phases[:, 2].tolist()}}
    (append_run if args.append else write_record)(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
