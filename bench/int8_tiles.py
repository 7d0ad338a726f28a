#!/usr/bin/env python3
"""Scoring straight from int8 (dp4a), in numpy on real queries and keys: what an index laid out for integer dot
products costs SparQ's selection, before any kernel is built.

Kernel A's time follows the instructions each warp issues per K^T row (docs/performance.md, "What limits each kernel
of the op on CUDA"): a q8_0 row costs a warp 77 instructions for 8 multiply-adds, most of them the int8-to-float
conversions and the row's scale and address. A dp4a multiplies 4 int8 pairs and adds them in one instruction, but only
along one scale: the default q8 index scales each component row of K^T per 32 cells, so 4 components of a cell carry 4
scales. The variants measured here are the index and selection a dp4a kernel needs:

    default   the op's defaults: q8_0 K^T (each component, blocks of 32 cells), I1 = the k1 components of largest
              sum_g |q_g,i| * sigma_i (select qsigma), float query coefficients;
    groups    the q8_0 index, but I1 in whole groups of 4 adjacent components (the k1/4 groups of largest summed
              weight): the selection's cost alone;
    tiles     groups as above, the index quantized per tile of 4 components x 32 cells (one scale per tile, 4 int8
              values per cell side by side: a dp4a operand as stored), float query coefficients;
    q8-q8     the default (q8_0 K^T, I1 by qsigma, k1 = d/2) scored as integer dot products: per head and block of 32
              cells the query times each chosen component's scale rounded to int8 with one scale (the block's own),
              as q4-q8 x2 below does with 4-bit values: what an integer kernel A computes on the default index;
    tiles-q8  tiles, and each head's query coefficients on I1 rounded to int8 with one scale per head: the scores are
              then integer dot products times two scales, as dp4a computes them;
    sigma-tiles-q8  tiles-q8 with the groups formed of components of similar spread rather than adjacent ones: the
              components ordered by their spread over the first CALIBRATION cells (an order fixed before the index is
              written, as a cache would fix it after the prompt's start), groups of 4 consecutive in that order;
    tiles-q8 x1.25, x1.5  tiles-q8 with 1.25 / 1.5 times the components (and bytes): what the groups need to match
              the default;
    q4 x2     the default's layout (each component, blocks of 32 cells) at 4 bits (one scale per block, amax / 7,
              values -7..7), twice the components: the default's bytes (plus the scales), every component at k1 = d/2;
    q4-q8 x2  q4 x2 scored as integer dot products: per head and block of 32 cells the query times each component's
              scale rounded to int8 with one scale (the block's own), so that a cell's 4-bit values can meet them in
              dp4a whatever their components' scales;
    q4_0 x2   q4 x2 in ggml's q4_0 blocks (a scale per component and 32 cells: the block's signed extreme / -8, values
              0..15 less 8), as ggml_set_rows would write such an index; q4_0 x1: the default's k1 (qsigma) at 4 bits,
              half the default's bytes; q4_0-q8 x2: q4_0 x2 scored as q4-q8 x2 (the dp4a kernel's arithmetic on
              q4_0's values);
    q4-cells x2  4 bits with one scale per cell and 32 components (the K rows themselves, as a q4 KV cache holds
              them: a dp4a operand as stored, for any choice of components), twice the components;
    q4-tiles x2  4 bits in tiles of 4 components x 32 cells with one scale (a dp4a operand once its nibbles are
              unpacked), twice the components;
    q4-tiles-q8 x2  q4-tiles x2 with int8 query coefficients, as tiles-q8;
    q4-tiles-q8 x2 centred  the same over the keys less their mean over the first CALIBRATION cells (a fixed offset
              per component, written with the index: the logits of a head shift alike, the ranking does not).
At the default k1 = d/2, "x2" is every component: no choice of components (I1) at all.

The first six (default to sigma-tiles-q8) read the default's k1 = d/2 int8 values per cell (with one f16 scale per 32
cells per component row, or per tile: a quarter of the scales); the 4-bit ones the same bytes as d 4-bit values (with
twice the default's scales for q4, the same for q4-cells). Per row (the last
`rows` positions of a retrieval example, every earlier cell visible), layer and KV head: the agreement, |exact top-k2
& approximate top-k2| / k2, where exact ranks by sum_g softmax(sigma q_g . K) and approximate by SparQ's p_hat
(the float64 reference's temperature: sigma / sqrt(rho), rho from the chosen components; no window or sinks, as
`sparq_llama.eval.agreement`).

    python bench/int8_tiles.py --model smollm2
    python bench/int8_tiles.py --model gemma3 --append
Writes bench/results/int8_tiles.json (per model the mean agreement of each variant, and per layer).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from captured_rows import captured_rows
from record import RESULTS, append_run, provenance, write_record
from sparq_llama import ops
from sparq_llama import reference as ref
from sparq_llama.index import Q8_BLOCK, q4_0_quantize, q8_0_quantize

GROUP = 4  # int8 values a dp4a multiplies and adds


@dataclass(frozen=True)
class Variant:
    groups: bool = False        # I1 in groups of GROUP components
    tiles: bool = False         # the index in tiles of GROUP components x 32 cells (else q8_0 K^T)
    int8_query: bool = False    # the query coefficients on I1 rounded to int8
    spread_order: bool = False  # groups of components of similar spread (else adjacent)
    k1_times: float = 1.0       # components against the default's
    q4: str = ""                # 4-bit index: "rows" (scales per component and 32 cells), "cells" (per cell and 32
                                # components), "tiles" (per tile); "" for the 8-bit ones above
    centred: bool = False       # the index holds the keys less their mean over the first CALIBRATION cells
    block_query: bool = False   # int8 query coefficients per head and block of 32 cells (dp4a's operands)


VARIANTS = {
    "default": Variant(),
    "q8-q8": Variant(block_query=True),
    "groups": Variant(groups=True),
    "tiles": Variant(groups=True, tiles=True),
    "tiles-q8": Variant(groups=True, tiles=True, int8_query=True),
    "sigma-tiles-q8": Variant(groups=True, tiles=True, int8_query=True, spread_order=True),
    "tiles-q8 x1.25": Variant(groups=True, tiles=True, int8_query=True, k1_times=1.25),
    "tiles-q8 x1.5": Variant(groups=True, tiles=True, int8_query=True, k1_times=1.5),
    "q4 x2": Variant(k1_times=2.0, q4="rows"),
    "q4-q8 x2": Variant(k1_times=2.0, q4="rows", block_query=True),
    "q4_0 x2": Variant(k1_times=2.0, q4="q4_0"),
    "q4_0 x1": Variant(q4="q4_0"),
    "q4_0-q8 x2": Variant(k1_times=2.0, q4="q4_0", block_query=True),
    "q4-cells x2": Variant(k1_times=2.0, q4="cells"),
    "q4-tiles x2": Variant(k1_times=2.0, q4="tiles"),
    "q4-tiles-q8 x2": Variant(k1_times=2.0, q4="tiles", int8_query=True),
    "q4-tiles-q8 x2 centred": Variant(k1_times=2.0, q4="tiles", int8_query=True, centred=True),
}
Q4_MAX = 7  # symmetric 4-bit values -7..7
CALIBRATION = 512  # sigma-tiles: the cells whose spread orders the components (fixed before the index is written)


def group_components(weight: np.ndarray, k1: int, order: np.ndarray | None = None) -> np.ndarray:
    """I1 as the k1 / GROUP groups of GROUP components with the largest summed weight (ties: the lower group),
    ascending: groups of adjacent components, or of GROUP consecutive ones in `order` (a permutation of the d)."""
    order = np.arange(len(weight)) if order is None else order
    per_group = weight[order].reshape(-1, GROUP).sum(axis=1)
    groups = ref._top_components(per_group, k1 // GROUP)
    return np.sort(order[(groups[:, None] * GROUP + np.arange(GROUP)).reshape(-1)])


def tile_index(keys: np.ndarray, order: np.ndarray | None = None, qmax: float = 127.0) -> np.ndarray:
    """Keys [n, d] as a tile index holds them: per tile of GROUP components (adjacent, or consecutive in `order`) x 32
    cells one f16 scale (q8_0's rounding over the tile's 128 values; amax / qmax, qmax 7 for 4 bits), read back as
    [n, d]."""
    n, d = keys.shape
    order = np.arange(d) if order is None else order
    kt = np.pad(keys[:, order].astype(np.float32), ((0, -n % Q8_BLOCK), (0, 0)))  # [cells, d], whole blocks of cells
    # [blocks of cells, groups, 32 cells x GROUP components]: one row per tile
    tiles = kt.reshape(-1, Q8_BLOCK, d // GROUP, GROUP).transpose(0, 2, 1, 3).reshape(-1, Q8_BLOCK * GROUP)
    amax = np.abs(tiles).max(axis=1)
    t_scale = (amax / np.float32(qmax)).astype(np.float32)
    inv = np.divide(np.float32(1.0), t_scale, out=np.zeros_like(t_scale), where=t_scale > 0)
    scaled = tiles * inv[:, None]
    q = np.trunc(scaled + np.copysign(np.float32(0.5), scaled))  # roundf, as q8_0
    back = t_scale.astype(np.float16).astype(np.float32)[:, None] * q
    back = back.reshape(-1, d // GROUP, Q8_BLOCK, GROUP).transpose(0, 2, 1, 3).reshape(-1, d)
    out = np.empty_like(back)
    out[:, order] = back
    return out[:n].astype(np.float64)


def q4_blocks(keys: np.ndarray, along: str) -> tuple[np.ndarray, np.ndarray]:
    """Keys [n, d] at 4 bits: the blocks' f16 scales (amax / 7) and values (rounded to -7..7), one block per 32 cells
    of a component (along "rows": K^T's rows; [d, n/32, 1] and [d, n/32, 32]) or per 32 components of a cell (along
    "cells": K's rows, d a multiple of 32; [n, d/32, 1] and [n, d/32, 32]); n padded to whole blocks of cells."""
    n, d = keys.shape
    x = np.pad(keys.astype(np.float32), ((0, -n % Q8_BLOCK), (0, 0)))
    blocks = (x.T.reshape(d, -1, Q8_BLOCK) if along == "rows" else x.reshape(x.shape[0], d // Q8_BLOCK, Q8_BLOCK))
    scale = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(Q4_MAX)).astype(np.float16).astype(np.float32)
    q = np.clip(np.round(np.divide(blocks, scale, out=np.zeros_like(blocks), where=scale > 0)), -Q4_MAX, Q4_MAX)
    return scale, q


def q4_index(keys: np.ndarray, along: str) -> np.ndarray:
    """Keys [n, d] at 4 bits (q4_blocks) as read back, [n, d]."""
    n, d = keys.shape
    scale, q = q4_blocks(keys, along)
    back = scale * q
    out = back.reshape(d, -1).T if along == "rows" else back.reshape(-1, d)
    return out[:n].astype(np.float64)


def q4_0_blocks(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys [n, d] in ggml's q4_0 blocks along K^T's rows, as q4_blocks "rows" gives them: the f16 scales [d, n/32, 1]
    (the block's signed extreme / -8) and the values [d, n/32, 32] (the stored nibbles less 8: -8..7)."""
    n, d = keys.shape
    scale, nib = q4_0_quantize(np.pad(keys.astype(np.float32), ((0, -n % Q8_BLOCK), (0, 0))).T)
    return scale.astype(np.float32)[..., None], nib.astype(np.float32) - 8


def block_query_scores(qg: np.ndarray, scale: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Every head's scores [G, n] over index rows (scales [r, nb], values [r, nb, 32]) as integer dot products: per
    head and block of 32 cells the products qg[g, i] * scale[i, b] (qg [G, r]: the rows' components) rounded to int8
    with one scale c_g,b (their max / 127), score = c_g,b * sum_i a_g,i,b * value_i,j (what dp4a computes once a
    cell's values sit side by side)."""
    w = qg[:, :, None] * scale[None]                                 # [G, r, nb]
    c = np.abs(w).max(axis=1, keepdims=True) / 127.0                 # [G, 1, nb]
    c = np.where(c > 0, c, 1.0)
    a = np.round(w / c)
    dots = np.einsum("ibj,gib->gbj", values.astype(np.float64), a)  # [G, nb, 32]
    return (dots * c.transpose(0, 2, 1)).reshape(qg.shape[0], -1)[:, :n]


def q4_block_query_scores(qg: np.ndarray, keys: np.ndarray, q4_0: bool = False) -> np.ndarray:
    """Every head's scores [G, n] over a 4-bit index of K^T rows (q4_blocks "rows", or q4_0_blocks) as integer dot
    products (block_query_scores over every component)."""
    scale, q = q4_0_blocks(keys) if q4_0 else q4_blocks(keys, "rows")  # [d, nb, 1], [d, nb, 32]
    return block_query_scores(qg, scale[..., 0], q, keys.shape[0])


def q8_block_query_scores(qg: np.ndarray, keys: np.ndarray, i1: np.ndarray) -> np.ndarray:
    """Every head's scores [G, n] over the q8 index's component rows I1 as integer dot products
    (block_query_scores over those rows)."""
    n = keys.shape[0]
    kt = np.pad(keys.astype(np.float32).T, ((0, 0), (0, -n % Q8_BLOCK)))
    scale, q = q8_0_quantize(kt[i1])                                   # [k1, nb], [k1, nb, 32]
    return block_query_scores(qg[:, i1], scale.astype(np.float64), q, n)


def int8_query(qg: np.ndarray, i1: np.ndarray) -> np.ndarray:
    """Each head's components on I1 rounded to int8 with one scale per head (max |q_g,i| / 127), read back."""
    sel = qg[:, i1]
    s = np.abs(sel).max(axis=1, keepdims=True) / 127.0
    s = np.where(s > 0, s, 1.0)
    out = qg.copy()
    out[:, i1] = np.round(sel / s) * s
    return out


def variant_top(variant: str, qg: np.ndarray, keys: np.ndarray, k1: int, k2: int, scale: float) -> np.ndarray:
    """The approximate top-k2 cells (rank order) of one group qg [G, d] over its visible keys [n, d]."""
    v = VARIANTS[variant]
    k1 = min(keys.shape[1], int(round(k1 * v.k1_times / GROUP)) * GROUP)
    spread = keys.std(axis=0)
    weight = np.abs(qg).sum(axis=0) * spread  # select qsigma
    order = np.argsort(-keys[:CALIBRATION].std(axis=0), kind="stable") if v.spread_order else None
    i1 = group_components(weight, k1, order) if v.groups else ref._top_components(weight, k1)
    if v.q4:
        # centred: a fixed offset per component shifts each head's logits of every cell alike (the softmax is unchanged)
        shifted = keys - keys[:CALIBRATION].mean(axis=0) if v.centred else keys
        if v.q4 == "q4_0":
            padded = np.pad(shifted, ((0, -len(shifted) % Q8_BLOCK), (0, 0)))
            k_index = ops.kv_round(padded.T, "q4_0").T[:len(shifted)]
        else:
            k_index = tile_index(shifted, qmax=Q4_MAX) if v.q4 == "tiles" else q4_index(shifted, v.q4)
    else:
        k_index = tile_index(keys, order) if v.tiles else ref._index_keys(keys, "q8")
    # the products from the int8 query where it is one; the temperature (rho) from the query as it is, as kernel Q
    q_products = int8_query(qg, i1) if v.int8_query else qg
    if v.block_query and not v.q4:
        products = q8_block_query_scores(qg, keys, i1)
    elif v.block_query:
        assert len(i1) == keys.shape[1], "block_query scores every component"
        products = q4_block_query_scores(qg, keys, q4_0=v.q4 == "q4_0")
    else:
        products = q_products[:, i1] @ k_index[:, i1].T
    logits = scale * products / np.sqrt(ref._rho(qg, i1, spread))[:, None]
    return ref._top_cells(ref._softmax(logits).sum(axis=0), np.arange(keys.shape[0], dtype=np.int64), k2)


def agreements(q: np.ndarray, k: np.ndarray, first: int, k2: int, variants: list[str]) -> np.ndarray:
    """Per row of one KV head (q [rows, G, d] from row `first`, k [n, d]) and variant, the agreement with the exact
    top-k2 over the row's visible cells: [rows, variants]."""
    d = k.shape[1]
    k1, scale = d // 2, 1.0 / math.sqrt(d)
    out = []
    for r in range(q.shape[0]):
        keys = k[: first + r + 1].astype(np.float64)
        qg = q[r].astype(np.float64)
        exact = set(ref.exact_top_cells(qg, keys, k2, scale=scale).tolist())
        out.append([len(exact & set(variant_top(v, qg, keys, k1, k2, scale).tolist())) / k2 for v in variants])
    return np.asarray(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=16, help="decode rows at the end of each example")
    ap.add_argument("--n", type=int, default=2, help="examples")
    ap.add_argument("--seed", type=int, default=61)
    ap.add_argument("--k2", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    ap.add_argument("--out", type=Path, default=RESULTS / "int8_tiles.json")
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")

    per_layer: dict[int, list[np.ndarray]] = {}
    t0 = time.time()
    for il, q, k, first in captured_rows(args.model, args.length, args.rows, args.n, args.seed, args.threads):
        per_layer.setdefault(il, []).append(agreements(q, k, first, args.k2, variants))
    every = np.concatenate([a for parts in per_layer.values() for a in parts])
    summary = {v: float(every[:, i].mean()) for i, v in enumerate(variants)}
    layers_out = {il: {v: float(np.concatenate(parts)[:, i].mean()) for i, v in enumerate(variants)}
                  for il, parts in per_layer.items()}
    print(f"{args.model}, {args.n} examples of {args.length} tokens, {args.rows} rows each, k2 {args.k2}: "
          f"{len(every)} rows x KV heads over {len(per_layer)} layers ({time.time() - t0:.0f} s)")
    print("  ".join(f"{v} {a:.3f}" for v, a in summary.items()))
    (append_run if args.append else write_record)(args.out, dict(
        provenance("int8_tiles"),
        params=dict(model=args.model, length=args.length, rows=args.rows, n=args.n, seed=args.seed, k2=args.k2,
                    k1="head_dim / 2", group=GROUP, select="qsigma", variants=variants),
        n_rows=int(len(every)), agreement=summary, per_layer=layers_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
