"""The CUDA benchmark drivers' host-side parts, on the CPU: the random-weight model writer makes GGUFs that
llama.cpp loads and runs (dense and SparQ), the end-to-end driver compares two builds, batched-bench's table is
parsed, the SparQ op microbenchmark takes
several sequences, and the centroid-sparse one reads the fraction of the prefix it is asked to."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run
from sparq_llama import ops
from sparq_llama.eval import random_gguf

VOCAB = REPO / "vendor" / "llama.cpp" / "models"  # the pinned tree's tokenizers


def test_random_model_loads_and_decodes_dense_and_sparq(tmp_path):
    model = random_gguf.write_model(random_gguf.SHAPES["tiny"], tmp_path / "tiny.gguf", VOCAB)
    res = run(["llama-bench", "-m", str(model), "-p", "0", "-n", "4", "-d", "300", "-r", "1", "-t", "2",
               "-fa", "1", "-sparq", "0,1", "-k1", "16", "-k2", "32", "-sparq-min-kv", "0", "-o", "json"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    assert sorted(r["sparq"] for r in rows) == [False, True]
    assert all(r["n_gen"] == 4 and r["n_depth"] == 300 and r["avg_ts"] > 0 for r in rows)
    assert all(r["model_type"].startswith("llama") for r in rows)


def test_random_model_has_the_shape_and_a_real_tokenizer(tmp_path):
    import gguf

    shape = random_gguf.SHAPES["tiny"]
    reader = gguf.GGUFReader(random_gguf.write_model(shape, tmp_path / "tiny.gguf", VOCAB))
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    assert fields["llama.block_count"] == shape.n_layer and fields["llama.attention.head_count_kv"] == shape.n_head_kv
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 32000  # the Llama-2 vocabulary
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(q.shape) == [shape.n_embd, shape.n_head_kv * shape.n_embd // shape.n_head]


def test_end_to_end_bench_compares_two_builds(tmp_path):
    # the A/B mode of bench/cuda_e2e.py on the CPU: the installed llama-bench as both builds, a tiny model, two
    # rounds; every (build, round) gets its rows and each depth its medians' ratio (the same binary, but timing on a
    # shared machine is not an oracle: only that each ratio is a finite positive number is asserted)
    bin_dir = Path(shutil.which("llama-bench")).parent
    out = tmp_path / "ab.json"
    res = run([sys.executable, str(REPO / "bench" / "cuda_e2e.py"), "--bin", str(bin_dir), "--base-bin", str(bin_dir),
               "--models", str(tmp_path), "--shapes", "tiny", "--depths", "300,600", "--reps", "1", "--rounds", "2",
               "--out", str(out)], timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["bench"] == "cuda_e2e_ab" and "partial" not in rec
    got = sorted((r["build"], r["round"], r["depth"]) for r in rec["rows"])
    assert got == sorted((b, n, d) for b in ("head", "base") for n in (1, 2) for d in (300, 600))
    assert all(r["dense_tps"] > 0 and r["sparq_tps"] > 0 for r in rec["rows"])
    assert [(r["model_shape"], r["depth"]) for r in rec["summary"]] == [("tiny", 300), ("tiny", 600)]
    for r in rec["summary"]:
        for key in ("sparq_head_over_base", "dense_head_over_base"):
            assert math.isfinite(r[key]) and r[key] > 0
    assert len(rec["raw"]) == 4 and all("-sparq 0,1" in r["command"] for r in rec["raw"])
    res = run([sys.executable, str(REPO / "bench" / "cuda_e2e.py"), "--bin", str(bin_dir), "--shapes", "llama9"],
              timeout=120)
    assert res.returncode != 0 and "unknown llama9" in res.stderr


def test_end_to_end_bench_keeps_what_it_measured_when_a_run_fails(tmp_path):
    # a llama-bench that answers its first call and fails its second, as a device call's time limit or a crash would
    # stop a long run: the record on disk holds the first shape's rows, says that it is partial, and the script fails
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    rows = [{"n_depth": 300, "sparq": False, "avg_ts": 10.0}, {"n_depth": 300, "sparq": True, "avg_ts": 15.0}]
    tool = bin_dir / "llama-bench"
    tool.write_text(f"""#!/bin/sh
echo x >> {calls}
[ "$(wc -l < {calls})" -eq 1 ] || {{ echo "out of memory" >&2; exit 3; }}
echo '{json.dumps(rows)}'
""")
    tool.chmod(0o755)
    out = tmp_path / "e2e.json"
    res = run([sys.executable, str(REPO / "bench" / "cuda_e2e.py"), "--bin", str(bin_dir), "--models", str(tmp_path),
               "--shapes", "tiny,tiny", "--depths", "300", "--reps", "1", "--out", str(out)], timeout=300)
    assert res.returncode != 0 and "out of memory" in res.stderr
    rec = json.loads(out.read_text())
    assert rec["bench"] == "cuda_e2e" and rec["partial"].startswith("1 of 2 shapes measured")
    got = [(r["model_shape"], r["depth"], r["dense_tps"], r["sparq_tps"]) for r in rec["rows"]]
    assert got == [("tiny", 300, 10.0, 15.0)]
    assert "targets" not in rec


def test_end_to_end_bench_compares_indexes(tmp_path):
    # --indexes on the CPU: one llama-bench call per shape runs dense once and SparQ with each index; every depth
    # gets a row per index with that index's own SparQ run
    bin_dir = Path(shutil.which("llama-bench")).parent
    out = tmp_path / "index.json"
    res = run([sys.executable, str(REPO / "bench" / "cuda_e2e.py"), "--bin", str(bin_dir), "--indexes", "q8,q4",
               "--models", str(tmp_path), "--shapes", "tiny", "--depths", "300", "--reps", "1", "--out", str(out)],
              timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["bench"] == "cuda_e2e_index" and "partial" not in rec
    assert sorted((r["depth"], r["index"]) for r in rec["rows"]) == [(300, "q4"), (300, "q8")]
    bench_rows = rec["raw"]["tiny"]["output"]
    assert sorted(r["sparq_index"] for r in bench_rows if r["sparq"]) == ["q4", "q8"]
    assert sum(not r["sparq"] for r in bench_rows) == 1
    for r in rec["rows"]:
        run_of = next(b for b in bench_rows if b["sparq"] and b["sparq_index"] == r["index"])
        assert r["sparq_tps"] == float(run_of["avg_ts"]) and r["speedup"] == r["sparq_tps"] / r["dense_tps"]
    res = run([sys.executable, str(REPO / "bench" / "cuda_e2e.py"), "--bin", str(bin_dir), "--indexes", "q5"],
              timeout=120)
    assert res.returncode != 0 and "unknown q5" in res.stderr


def test_batched_bench_table_is_parsed(tmp_path):
    text = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|  8192 |     32 |    1 |   8224 |    1.234 |  6638.57 |    0.181 |   177.20 |    1.415 |  5812.01 |
|  8192 |     32 |    8 |  65792 |   12.001 |  5460.88 |    0.605 |   423.50 |   12.606 |  5219.10 |
"""
    log = tmp_path / "batched.log"
    log.write_text(text)
    res = run([sys.executable, str(REPO / "bench" / "cuda_batched.py"), "--from-log", str(log)], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    assert [(r["B"], r["s_tg"]) for r in rows] == [(1, 177.2), (8, 423.5)]
    log.write_text("nothing here")
    res = run([sys.executable, str(REPO / "bench" / "cuda_batched.py"), "--from-log", str(log)], timeout=120)
    assert res.returncode != 0 and "no table" in res.stderr


def test_batched_memory_estimate_follows_the_cache_type(tmp_path):
    # bench/cuda_batched.py's fit check: per cell and layer K and V of the cache type plus the q8 index, on top of the
    # weights and 2 GiB; the Llama-2 shape's 16 sequences of 8k cells need more than an 80 GiB card with f16 K and V
    # and fit it with q8_0
    sys.path.insert(0, str(REPO / "bench"))
    import cuda_batched as cb
    from sparq_llama.eval.random_gguf import SHAPES

    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 1000)
    n_ctx = 16 * (8192 + 32)
    sh = SHAPES["llama2-7b"]
    width = sh.n_layer * sh.n_head_kv * (sh.n_embd // sh.n_head)
    for cache_type, per_value in (("f16", 2.0), ("q8_0", 34 / 32)):
        want = 1000 + int(width * (2 * per_value + 34 / 32) * n_ctx) + 2 * cb.GIB
        assert cb.needed_bytes("llama2-7b", model, n_ctx, cache_type) == want
    weights = 7 * cb.GIB  # about the Q8_0 7B shape's file
    assert cb.needed_bytes("llama2-7b", model, n_ctx, "f16") + weights > 80 * cb.GIB
    assert cb.needed_bytes("llama2-7b", model, n_ctx, "q8_0") + weights < 80 * cb.GIB
    res = run([sys.executable, str(REPO / "bench" / "cuda_batched.py"), "--bin", str(tmp_path), "--cache-type", "q4"],
              timeout=120)
    assert res.returncode == 2 and "--cache-type" in res.stderr


def test_op_bench_takes_several_sequences():
    sparq_us, flash_us = ops.bench_attn(d=64, n_head=4, n_head_kv=2, n_kv=600, k1=16, k2=64, n_runs=2,
                                        n_threads=2, n_seq=3)
    assert sparq_us.shape == flash_us.shape == (2,)
    assert np.all(sparq_us > 0) and np.all(flash_us > 0)
    with pytest.raises(ValueError, match="backend must be"):
        ops.bench_attn(d=64, n_head=4, n_head_kv=2, n_kv=600, k1=16, k2=64, backend="gpu")


def test_centroid_op_bench_reads_the_asked_fraction():
    for keep in (0.1, 0.5):
        c_us, f_us, kept = ops.bench_centroid(d=64, n_head=6, n_head_kv=2, n_kv=3000, n_prefix=2900, n_clusters=145,
                                              keep=keep, n_runs=2)
        assert c_us.shape == f_us.shape == (2,) and (c_us > 0).all() and (f_us > 0).all()
        # per KV head the budget, and at most the boundary cluster past it (20 cells)
        assert keep <= kept <= keep + 21 / 2900
    with pytest.raises(ValueError, match="n_prefix"):
        ops.bench_centroid(d=64, n_head=6, n_head_kv=2, n_kv=100, n_prefix=200, n_clusters=10, keep=0.1)


def test_int8_tiles_variants_follow_their_definitions():
    # bench/int8_tiles.py's helpers: the default variant is the reference's selection; a tile index keeps one scale per
    # 4 components x 32 cells; groups are whole; the int8 query is one scale per head
    sys.path.insert(0, str(REPO / "bench"))
    import int8_tiles as t
    from sparq_llama import reference as ref

    rng = np.random.default_rng(3)
    keys = rng.standard_normal((300, 64)) * np.linspace(0.2, 3.0, 64)
    qg = rng.standard_normal((3, 64))
    assert np.array_equal(t.variant_top("default", qg, keys, 32, 64, 0.125),
                          ref.approx_top_cells(qg, keys, 32, 64, scale=0.125, select="qsigma", index="q8"))
    i1 = t.group_components(np.abs(qg).sum(axis=0), 32)
    assert len(i1) == 32 and np.all(i1.reshape(-1, 4) % 4 == np.arange(4)) and np.all(np.diff(i1) > 0)
    # one large value in the tile (cells 0..31, components 4..7): only that tile's other values lose precision
    small = np.full((64, 8), 0.01)
    small[3, 5] = 100.0
    back = t.tile_index(small)
    tile = back[:32, 4:8]
    assert abs(tile[3, 1] - 100.0) < 0.1  # the large value (an f16 scale's rounding)
    assert np.all(np.delete(tile.reshape(-1), 3 * 4 + 1) == 0.0)  # 0.01: below half the tile's step
    assert np.allclose(back[:32, :4], 0.01, rtol=1e-2) and np.allclose(back[32:], 0.01, rtol=1e-2)
    q8 = t.int8_query(qg, i1)
    step = np.abs(qg[:, i1]).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(q8[:, i1] - qg[:, i1]) <= step / 2 + 1e-12)
    assert np.array_equal(np.delete(q8, i1, axis=1), np.delete(qg, i1, axis=1))
    # groups in a given order: whole groups of consecutive components of that order, and the tiles follow it
    order = np.random.default_rng(4).permutation(64)
    i1 = t.group_components(np.abs(qg).sum(axis=0), 32, order)
    pos = np.sort(np.argsort(order)[i1]).reshape(-1, 4)
    assert len(i1) == 32 and np.all(pos - pos[:, :1] == np.arange(4)) and np.all(pos[:, 0] % 4 == 0)
    assert np.array_equal(t.tile_index(keys[:, order], np.argsort(order))[:, np.argsort(order)], t.tile_index(keys))


def test_int8_tiles_four_bit_indexes():
    # bench/int8_tiles.py's 4-bit helpers: each block of 32 cells of a component keeps its own scale and 15 levels; the
    # integer scores (per-block int8 query coefficients) are the float scores over the 4-bit keys to within the
    # coefficients' rounding; every component scored with rho = 1 ranks as the exact scores of those keys
    sys.path.insert(0, str(REPO / "bench"))
    import int8_tiles as t
    from sparq_llama import reference as ref

    rng = np.random.default_rng(5)
    keys = rng.standard_normal((100, 64)) * np.linspace(0.1, 4.0, 64)
    scale, q = t.q4_blocks(keys, "rows")
    assert scale.shape == (64, 4, 1) and q.shape == (64, 4, 32)
    assert np.all(np.abs(q) <= t.Q4_MAX) and np.all(q == np.round(q))
    back = t.q4_index(keys, "rows")
    step = scale[:, :, 0].repeat(32, axis=1)[:, :100].T                   # each value's own block's step
    assert np.all(np.abs(back - keys) <= step * 0.5 + np.abs(keys) * 1e-3)
    qg = rng.standard_normal((2, 64))
    exact = qg @ back.T
    got = t.q4_block_query_scores(qg, keys)
    w_max = (np.abs(qg)[:, :, None] * scale[None, :, :, 0]).max(axis=1)   # [G, blocks]: the coefficients' scale * 127
    bound = (w_max / 127 / 2)[:, np.arange(100) // 32] * np.abs(q.reshape(64, -1)[:, :100]).sum(axis=0)
    assert np.all(np.abs(got - exact) <= bound + 1e-9) and np.abs(got - exact).max() > 0
    top = t.variant_top("q4 x2", qg, keys, 32, 16, 0.125)
    assert np.array_equal(top, ref.exact_top_cells(qg, back, 16, scale=0.125))
    # ggml's q4_0 blocks along K^T's rows: 16 levels from the block's signed extreme
    top0 = t.variant_top("q4_0 x2", qg, keys, 32, 16, 0.125)
    rows = np.pad(keys, ((0, 28), (0, 0))).T                              # [64, 128]: whole blocks of cells
    assert np.array_equal(top0, ref.exact_top_cells(qg, ops.kv_round(rows, "q4_0").T[:100], 16, scale=0.125))


def test_int8_tiles_q8_index_as_integer_dot_products():
    # bench/int8_tiles.py's q8-q8 variant: the q8 index's component rows I1 scored with int8 coefficients per head and
    # block of 32 cells follow the float scores over those rows to within the coefficients' rounding
    sys.path.insert(0, str(REPO / "bench"))
    import int8_tiles as t
    from sparq_llama.index import q8_0_quantize, q8_index_values

    rng = np.random.default_rng(8)
    keys = rng.standard_normal((90, 64)) * np.linspace(0.1, 4.0, 64)
    qg = rng.standard_normal((3, 64))
    i1 = np.sort(rng.permutation(64)[:32])
    got = t.q8_block_query_scores(qg, keys, i1)
    exact = qg[:, i1] @ q8_index_values(keys)[:, i1].T
    scale, vals = q8_0_quantize(np.pad(keys.astype(np.float32).T, ((0, 0), (0, 6)))[i1])  # [32, 3], [32, 3, 32]
    w_max = (np.abs(qg[:, i1])[:, :, None] * scale.astype(np.float64)[None]).max(axis=1)  # [G, blocks]
    bound = (w_max / 127 / 2)[:, np.arange(90) // 32] * np.abs(vals.reshape(32, -1)[:, :90]).sum(axis=0)
    assert got.shape == (3, 90)
    assert np.all(np.abs(got - exact) <= bound + 1e-9) and np.abs(got - exact).max() > 0
    assert t.variant_top("q8-q8", qg, keys, 32, 16, 0.125).shape == (16,)


def test_int8_tiles_q4_0_blocks_are_ggml_q4_0():
    # bench/int8_tiles.py's q4_0 blocks read back as gguf's q4_0 quantizer gives them (the values the ggml type holds),
    # and the integer scores over them follow the float scores to within the coefficients' rounding
    sys.path.insert(0, str(REPO / "bench"))
    import int8_tiles as t

    rng = np.random.default_rng(6)
    keys = rng.standard_normal((70, 64)) * np.linspace(0.1, 4.0, 64) + np.where(np.arange(64) % 7 == 0, 3.0, 0.0)
    scale, vals = t.q4_0_blocks(keys)
    assert scale.shape == (64, 3, 1) and vals.shape == (64, 3, 32) and vals.min() >= -8 and vals.max() <= 7
    rows = np.pad(keys, ((0, 26), (0, 0))).T                               # [64, 96]: whole blocks of cells
    np.testing.assert_array_equal((scale * vals).reshape(64, -1), ops.kv_round(rows, "q4_0"))
    qg = rng.standard_normal((3, 64))
    got = t.q4_block_query_scores(qg, keys, q4_0=True)
    exact = qg @ (scale * vals).reshape(64, -1)[:, :70]
    w_max = (np.abs(qg)[:, :, None] * np.abs(scale)[None, :, :, 0]).max(axis=1)
    bound = (w_max / 127 / 2)[:, np.arange(70) // 32] * np.abs(vals.reshape(64, -1)[:, :70]).sum(axis=0)
    assert np.all(np.abs(got - exact) <= bound + 1e-9)


def test_block_bound_keeps_the_exact_top():
    # bench/block_bound.py's per-block bound: with one head it is the block's maximum, so exactly the need blocks with
    # the largest maxima are kept; with three heads the per-head bound keeps at least the exact maximum's blocks, and
    # both keep every cell of the exact top (kept_cells asserts that against a full sort of the row)
    sys.path.insert(0, str(REPO / "bench"))
    import block_bound as bb
    rng = np.random.default_rng(5)
    window, need, block = 3, 4, 8
    p = rng.uniform(0.0, 0.01, (1, 40 * block + window))
    p[0, [3 * block + 1, 3 * block + 5, 7 * block + 2, 7 * block + 6]] = [0.9, 0.8, 0.7, 0.6]
    assert bb.kept_cells(p, window, need, block) == (4 * block, 4 * block)
    for seed in range(20):
        p = np.random.default_rng(seed).dirichlet(np.full(403, 0.05), size=3)  # peaked rows, as attention is
        kept, exact = bb.kept_cells(p, window, need, block)
        assert exact <= kept <= 400 and exact >= need and exact % block == 0
    assert bb.kept_cells(p, window, 60, block) == (400, 400)  # fewer whole blocks than need: nothing skipped


def test_block_bound_rows_of_the_benchmarks(tmp_path):
    # the rows the timings run on: the op bench's, where one head per KV head makes the bound the block maximum (exactly
    # need blocks kept), and a random-weight model's roped Q and K per layer and KV head, as captured while it prefills
    sys.path.insert(0, str(REPO / "bench"))
    import block_bound as bb
    need, window, block = 96, 32, 8
    for il, q, k, first in bb.op_bench_rows("llama2-7b", 2048, 2, 1, seed=3):
        assert q.shape == (2, 1, 128) and k.shape == (2048, 128) and first == 2046
        counts = bb.row_counts(q, k, first, need + window, window, (block,))
        assert (counts[:, 0, 1] == need * block + counts[:, 0, 0] % block).all()  # + the cells of the window's block
    shape = random_gguf.SHAPES["tiny"]
    G, d = shape.n_head // shape.n_head_kv, shape.n_embd // shape.n_head
    got = list(bb.random_model_rows("tiny", 2, 512, 3, 1, 7, 2, models=tmp_path))
    assert [(il, q.shape, k.shape, first) for il, q, k, first in got] == [
        (il, (3, G, d), (512, d), 509) for il in range(2) for _ in range(shape.n_head_kv)]
    assert all(np.isfinite(q).all() and np.isfinite(k).all() and k.std() > 0 for _, q, k, _ in got)
    for _, q, k, first in got:  # kept_cells asserts the kept blocks hold the exact top
        counts = bb.row_counts(q, k, first, 64, 16, (block,))
        assert (counts[:, 0, 1] >= counts[:, 0, 2]).all()


def test_kernel_a_loop_bench_variants_and_source():
    # bench/cuda_kernel_a_loop.py: ring x rows variants the harness's loops can take, refused otherwise; an
    # alternative's flags, a stream's parameters on streams only; the harness source names every macro the runner sets
    sys.path.insert(0, str(REPO / "bench"))
    import cuda_kernel_a_loop as loop

    assert loop.parse_variants("4x8,6x8,3x16") == [(4, 8), (6, 8), (3, 16)]
    for bad in ("4x6", "1x8", "4x128", "x8", "4"):
        with pytest.raises(ValueError):
            loop.parse_variants(bad)
    assert loop.alt_flags("stream/lanes17/skew1") == ["-DSTREAM=1", "-DSTREAM_LANES_N=17", "-DSTREAM_SKEW_N=1"]
    assert loop.alt_flags("stream_wave/loads8") == ["-DSTREAM=2", "-DSTREAM_LOADS_N=8"]
    assert loop.alt_flags("ldg_contig") == ["-DCOPY_ONLY", "-DCOPY_LDG", "-DCOPY_CONTIG"]
    assert loop.alt_flags("copy/ef1") == ["-DCOPY_ONLY", "-DEVICT_FIRST_N=1"]
    assert loop.alt_flags("stream/ef0/occ4") == ["-DSTREAM=1", "-DEVICT_FIRST_N=0", "-DSTREAM_OCC_N=4"]
    for bad in ("copy/lanes3", "copy/occ4", "int/ef1", "ldg/ef2", "stream/foo2", "stream/lanes", "stream/8",
                "nothing"):
        with pytest.raises(ValueError):
            loop.alt_flags(bad)
    source = loop.SOURCE.read_text()
    macros = {"RING_N", "ROWS_N", "WARPS_N", "TILES_N", "SM_BLOCKS_N", *loop.STREAM_PARAMS.values(),
              *loop.READ_PARAMS.values()}
    macros |= {f.removeprefix("-D").split("=")[0] for flags in loop.ALTS.values() for f in flags}
    assert all(m in source for m in macros), sorted(m for m in macros if m not in source)
    # tiles are the copies' option: asked for without the copies, the runner refuses before building anything
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "cuda_kernel_a_loop.py"), "--tiles", "1,2", "--alts",
                           "stream", "--nvcc", "/nonexistent/nvcc"], capture_output=True, text=True)
    assert proc.returncode == 2 and "only the copies' builds take tiles" in proc.stderr
    # a launch bound beyond an SM's 64 warps is refused before building anything
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "cuda_kernel_a_loop.py"), "--warps", "8",
                           "--sm-blocks", "4,9", "--alts", "copy", "--nvcc", "/nonexistent/nvcc"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "at most 64 warps an SM with --warps 8" in proc.stderr
