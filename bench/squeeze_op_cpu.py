#!/usr/bin/env python3
"""One decode step of centroid-sparse attention (ggml_centroid_attn) vs flash attention on the CPU, over a cache
whose first cells are a clustered prefix, at several keep fractions (sparq_llama.ops.bench_centroid).

    python bench/squeeze_op_cpu.py                      # SmolLM2 heads, 8k prefix + 64 question cells, keep 30/20/10%

Medians of interleaved runs, one process. The transfer ratio is the model's bytes moved: dense reads every K and
V row; the op reads the centroids, the cell map (4 bytes a cell) and the K and V rows of the cells it selects.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from record import RESULTS, provenance, write_record
from head_shapes import HEAD_SHAPES
from sparq_llama import ops
from tqdm import tqdm


def transfer_ratio(d: int, n_kv: int, n_prefix: int, n_clusters: int, kept: float, kv_bytes: int = 2) -> float:
    dense = 2 * n_kv * d * kv_bytes
    sparse = n_clusters * (d + 1) * 4 + n_kv * 4 + 2 * (kept * n_prefix + (n_kv - n_prefix)) * d * kv_bytes
    return dense / sparse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(HEAD_SHAPES), default="smollm2")
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--question", type=int, default=64, help="unclustered cells after the prefix")
    ap.add_argument("--centroids", type=float, default=0.05)
    ap.add_argument("--keeps", default="0.3,0.2,0.1")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "squeeze_op_cpu.json")
    args = ap.parse_args()

    shape = HEAD_SHAPES[args.shape].op_args()
    n_kv = args.prefix + args.question
    n_clusters = max(1, round(args.centroids * args.prefix))
    rows = []
    for keep in tqdm([float(x) for x in args.keeps.split(",")], desc="keep"):
        c_us, f_us, kept = ops.bench_centroid(**shape, n_kv=n_kv, n_prefix=args.prefix, n_clusters=n_clusters,
                                              keep=keep, n_runs=args.runs, n_threads=args.threads)
        row = {"keep": keep, "kept": kept, "centroid_us": float(np.median(c_us)), "flash_us": float(np.median(f_us)),
               "speedup": float(np.median(f_us) / np.median(c_us)),
               "transfer_ratio": transfer_ratio(shape["d"], n_kv, args.prefix, n_clusters, kept),
               "raw_centroid_us": c_us.tolist(), "raw_flash_us": f_us.tolist()}
        rows.append(row)
        print(f"keep {keep:.2f} (read {kept:.3f} of the prefix): centroid {row['centroid_us']:.0f} us, flash "
              f"{row['flash_us']:.0f} us, {row['speedup']:.2f}x (transfer ratio {row['transfer_ratio']:.2f}x)")
    record = {**provenance("squeeze_op_cpu"), "shape": args.shape, **shape, "n_kv": n_kv, "prefix": args.prefix,
              "clusters": n_clusters, "threads": args.threads, "rows": rows}
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
