#!/usr/bin/env python3
"""One decode step of centroid-sparse attention (ggml_centroid_attn) vs llama.cpp's CUDA flash attention on one GPU,
over a cache whose first cells are a clustered prefix, at several prefix lengths and keep fractions
(sparq_llama.ops.bench_centroid on backend cuda).

    python bench/squeeze_op_cuda.py                     # Llama-2-7B heads (32 x 128, f16), 32k and 64k prefixes, keep 30/20/10%

Times are host wall-clock around one graph compute + synchronize (launches included), medians of interleaved
runs, one process. The transfer ratio is the model's bytes moved: dense reads every K and V row; the op reads the
centroid table (f32, d + 1 per cluster), the cell map (4 bytes a cell) and the K and V rows of the cells it selects.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from record import RESULTS, provenance, write_record
from head_shapes import HEAD_SHAPES
from sparq_llama import ops
from squeeze_op_cpu import transfer_ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(HEAD_SHAPES), default="llama2-7b")
    ap.add_argument("--prefixes", default="32768,65536")
    ap.add_argument("--question", type=int, default=64, help="unclustered cells after the prefix")
    ap.add_argument("--centroids", type=float, default=0.05)
    ap.add_argument("--keeps", default="0.3,0.2,0.1")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--out", type=Path, default=RESULTS / "squeeze_op_cuda.json")
    args = ap.parse_args()

    shape = HEAD_SHAPES[args.shape].op_args()
    rows = []
    for prefix in (int(x) for x in args.prefixes.split(",")):
        n_kv = prefix + args.question
        n_clusters = max(1, round(args.centroids * prefix))
        for keep in (float(x) for x in args.keeps.split(",")):
            c_us, f_us, kept = ops.bench_centroid(**shape, n_kv=n_kv, n_prefix=prefix, n_clusters=n_clusters, keep=keep,
                                                  n_runs=args.runs, backend=args.backend)
            ratio = transfer_ratio(shape["d"], n_kv, prefix, n_clusters, kept)
            row = {"prefix": prefix, "n_kv": n_kv, "clusters": n_clusters, "keep": keep, "kept": kept,
                   "centroid_us": float(np.median(c_us)), "flash_us": float(np.median(f_us)),
                   "speedup": float(np.median(f_us) / np.median(c_us)), "transfer_ratio": ratio,
                   "raw_centroid_us": c_us.tolist(), "raw_flash_us": f_us.tolist()}
            rows.append(row)
            print(f"prefix {prefix}, keep {keep:.2f} (read {kept:.3f} of the prefix): centroid {row['centroid_us']:.1f} us, "
                  f"flash {row['flash_us']:.1f} us, {row['speedup']:.2f}x (transfer ratio {ratio:.2f}x)", flush=True)
    record = {**provenance("squeeze_op_cuda"), "shape": args.shape, **shape, "kv_type": "f16", "question": args.question,
              "centroids": args.centroids, "backend": args.backend, "runs": args.runs, "rows": rows}
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
