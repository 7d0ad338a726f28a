#!/usr/bin/env python3
"""Kernel A's score loop over the q8 index alone (bench/cuda_kernel_a_loop.cu) on a lent GPU: the float loop of the op's
kernel against integer dot products (dp4a), against the ring's copies alone (of the gathered K^T rows or of contiguous
shares, by asynchronous copies or by loads into registers), and against the same bytes read as one contiguous stream of
plain loads (on the kernel's grid or on one wave of blocks; loads in flight, lanes a load, the start's alignment and
blocks an SM set), each with or without L2's evict-first policy, for several ring depths, rows per stage, warps a block
and launch bounds (blocks an SM). Builds each variant with nvcc (in parallel), runs them one after another and writes
bench/results/cuda_kernel_a_loop.json (machine, commit, command, every variant's JSON lines, with each kernel's blocks
an SM).

    python3 bench/cuda_kernel_a_loop.py [--variants 4x8,6x8,3x16] [--warps 4,8] [--tiles 1,2] [--sm-blocks 4,8]
        [--runs 30] [--alts copy,copy/ef1,ldg,stream,stream/lanes17,stream/occ4] [--seqs 33024,131072]

A variant RxW is a ring of R stages of W K^T rows a warp; each is built once per number of warps a block, launch bound
(--sm-blocks: the float loop's and the alternative's minimum blocks an SM, so their register budget; without it, the
harness's default of 16 warps an SM) and alternative, and every run times the float loop too, so every ratio is taken
within one process. --tiles gives a warp's tiles of 256 cells (a block's chunks, its ring running on from one into the
next; the grid that many times fewer blocks): the copies are built with each (the float loop in the same binary with the
same tiles), the other alternatives with one; more than one tile without the copies is refused. A row's
float_max_rel_err checks the float loop against the host's float64 products (in the _contig builds the float loop reads
the contiguous shares too: timing only, its check fails); int_mismatches (of `checked` cells) checks the integer loop
bit for bit, and means nothing for the copies and the streams.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from record import RESULTS, provenance, write_record

SOURCE = Path(__file__).with_name("cuda_kernel_a_loop.cu")
ALTS = {"int": [], "copy": ["-DCOPY_ONLY"], "copy_contig": ["-DCOPY_ONLY", "-DCOPY_CONTIG"],
        "ldg": ["-DCOPY_ONLY", "-DCOPY_LDG"], "ldg_contig": ["-DCOPY_ONLY", "-DCOPY_LDG", "-DCOPY_CONTIG"],
        "stream": ["-DSTREAM=1"], "stream_wave": ["-DSTREAM=2"]}
STREAM_PARAMS = {"loads": "STREAM_LOADS_N", "lanes": "STREAM_LANES_N", "skew": "STREAM_SKEW_N", "occ": "STREAM_OCC_N"}
READ_PARAMS = {"ef": "EVICT_FIRST_N"}  # every alternative but the integer loop's


def alt_flags(alt: str) -> list[str]:
    """An alternative's nvcc flags: a name of ALTS followed by /ef0 or /ef1 (the index read without or with the L2
    evict-first policy, the float loop's copies too; by default the stream's loads only), a stream's also by /loadsN,
    /lanesN, /skewN or /occN (16-byte loads a lane in flight, lanes a load, the stream's start in 16-byte words, its
    blocks an SM held to N by shared memory)."""
    base, *params = alt.split("/")
    if base not in ALTS:
        raise ValueError(f"alternative {alt!r}: expected one of {', '.join(ALTS)}")
    flags = list(ALTS[base])
    known = {**READ_PARAMS, **STREAM_PARAMS} if base.startswith("stream") else READ_PARAMS if base != "int" else {}
    for p in params:
        key = p.rstrip("0123456789")
        if key not in known or key == p or (key == "ef" and p[2:] not in ("0", "1")):
            raise ValueError(f"alternative {alt!r}: its parameters are {', '.join(known) or 'none'} with a number"
                             " (ef: 0 or 1)")
        flags.append(f"-D{known[key]}={p[len(key):]}")
    return flags


def parse_variants(text: str) -> list[tuple[int, int]]:
    """"4x8,6x8" -> [(4, 8), (6, 8)] (ring stages x rows per stage; rows a multiple of 4 dividing k1 = 64)."""
    out = []
    for item in text.split(","):
        ring, _, rows = item.partition("x")
        if not (ring.isdigit() and rows.isdigit()) or int(ring) < 2 or int(rows) % 4 or 64 % int(rows):
            raise ValueError(f"variant {item!r}: expected RINGxROWS, RING >= 2, ROWS a multiple of 4 dividing 64")
        out.append((int(ring), int(rows)))
    return out


def build(nvcc: str, arch: str, ring: int, rows: int, warps: int, tiles: int, sm_blocks: int | None, alt: str,
          out_dir: Path) -> Path:
    """One variant's binary; sm_blocks None leaves the launch bound at the harness's default."""
    exe = out_dir / f"loop_{ring}x{rows}_w{warps}_t{tiles}_b{sm_blocks or 'd'}_{alt.replace('/', '_')}"
    bound = [] if sm_blocks is None else [f"-DSM_BLOCKS_N={sm_blocks}"]
    cmd = [nvcc, "-O3", f"-arch={arch}", "-std=c++17", "-cudart", "static", f"-DRING_N={ring}", f"-DROWS_N={rows}",
           f"-DWARPS_N={warps}", f"-DTILES_N={tiles}", *bound, *alt_flags(alt), "-o", str(exe), str(SOURCE)]
    subprocess.run(cmd, check=True)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="4x8,6x8,3x16")
    ap.add_argument("--alts", default=",".join(ALTS), help=f"alternatives to the float loop, of {', '.join(ALTS)}")
    ap.add_argument("--warps", default="4", help="warps a block (its chunk: 256 cells a warp), comma-separated")
    ap.add_argument("--tiles", default="1", help="a warp's tiles (the copies' builds), comma-separated")
    ap.add_argument("--sm-blocks", default="",
                    help="the loops' launch bound, blocks an SM, comma-separated (default: the harness's, 16 warps "
                         "an SM)")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seqs", default="33024,131072")
    ap.add_argument("--timeout", type=float, default=120, help="seconds a variant may run")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda_kernel_a_loop.json")
    args = ap.parse_args()
    try:
        variants = parse_variants(args.variants)
        seqs = [int(s) for s in args.seqs.split(",")]
        warps = [int(w) for w in args.warps.split(",")]
        tiles = [int(t) for t in args.tiles.split(",")]
        sm_blocks = [int(b) for b in args.sm_blocks.split(",")] if args.sm_blocks else []
    except ValueError as e:
        ap.error(str(e))
    alts = args.alts.split(",")
    try:
        for a in alts:
            alt_flags(a)
    except ValueError as e:
        ap.error(f"--alts: {e}")
    if any(w not in (1, 2, 4, 8, 16) for w in warps):
        ap.error(f"--warps: each of 1, 2, 4, 8, 16, got {args.warps!r}")
    if any(b < 1 or b*w > 64 for b in sm_blocks for w in warps):
        ap.error(f"--sm-blocks: positive, at most 64 warps an SM with --warps {args.warps}, got {args.sm_blocks!r}")
    if any(t < 1 for t in tiles):
        ap.error(f"--tiles: positive, got {args.tiles!r}")
    if tiles != [1] and "copy" not in alts:
        ap.error("--tiles: only the copies' builds take tiles; add copy to --alts")
    if args.runs < 1 or any(s < 1 for s in seqs):
        ap.error("--runs and --seqs must be positive")
    rec: dict[str, Any] = provenance("cuda_kernel_a_loop")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(ring, w, n_warps, t, b, alt) for ring, w in variants for n_warps in warps
                for b in (sm_blocks or [None]) for alt in alts for t in (tiles if alt == "copy" else [1])]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            exes = list(pool.map(lambda j: build(args.nvcc, args.arch, *j, Path(tmp)), jobs))
        for (ring, w, n_warps, t, b, alt), exe in zip(jobs, exes):
            try:
                res = subprocess.run([str(exe), str(args.runs), *map(str, seqs)], capture_output=True, text=True,
                                     timeout=args.timeout)
            except subprocess.TimeoutExpired:
                res = None
            if res is None or res.returncode != 0:
                why = "timed out" if res is None else f"exit {res.returncode}: {res.stderr.strip()[-300:]}"
                rows.append({"ring": ring, "rows_per_stage": w, "warps": n_warps, "tiles": t, "sm_blocks": b,
                             "alt": alt, "error": why})
                print(f"ring {ring}x{w} w{n_warps} t{t} b{b} {alt}: {why}", flush=True)
                continue
            for line in res.stdout.splitlines():
                row = json.loads(line)
                rows.append(row)
                print(f"{row['heads']:10s} {row['n_kv']:6d} ring {row['ring']}x{row['rows_per_stage']:2d} "
                      f"w{row['warps']} t{row['tiles']} b{row['sm_blocks']} ({row['float_blocks_per_sm']} an SM): "
                      f"float {row['float_cold_us']:6.1f} us cold, {row['alt']} {row['alt_cold_us']:6.1f} "
                      f"({row['alt_cold_us'] / row['float_cold_us']:.2f}x), float "
                      f"{row['index_bytes'] / row['float_cold_us'] / 1e6:.2f} TB/s", flush=True)
    rec["rows"] = rows
    write_record(args.out, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
