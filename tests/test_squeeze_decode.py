"""Centroid-sparse attention over a prepared prefix in llama.cpp's decode path, on the real default model
(SmolLM2-135M), every result against an oracle:

* the two-level rule's coarse threshold calibration against the float64 reference
  (`reference_squeeze.calibrate_threshold`);
* dense attention, where keep = 1 must equal it and where a small keep must not (proof the op is used);
* the same tokens computed another way: a question after another question equals a fresh preparation; a saved
  and loaded prefix equals the original; a change inside the prefix drops it (and decoding stays correct);
* clear errors for bad settings, a prefix that does not fit, a sidecar of another prefix or model.

Logit tolerances are test_sparq_decode's (this Q4_1 model amplifies rounding; see its docstring).
"""
from __future__ import annotations

import ctypes
import dataclasses
import struct

import numpy as np
import pytest
import squeeze_files
from sparq_llama import Llama, SparqConfig, ops, reference_squeeze
from sparq_llama import squeeze as squeeze_api
from test_sparq_decode import (
    TEXT,
    TOL,
    TOL_DENSE,
    TOL_LAYOUT,
    Ctx,
    assert_logits_agree,
    rel_err,
)

from llama_cpp import llama_cpp as lc  # isort: skip

N_CTX = 1024
N_PREFIX = 600          # the document: 500 clustered tokens + 100 calibration tokens
SETTINGS = dict(centroids=0.1, progress=False)   # 50 clusters per KV head


# ---------------------------------------------------------------------------------------------------
# The calibration against the float64 reference


def _random_tables(rng, n_layers=3, h_kv=2, g=3, n_cent=24, d=16, n_rows=20, empty=3):
    """Queries and tables of width 2d + 1 (centroids, sizes, variances)."""
    q = rng.standard_normal((n_layers, n_rows, h_kv * g, d)).astype(np.float32)
    table = np.zeros((n_layers, h_kv, n_cent, 2 * d + 1), dtype=np.float32)
    table[..., :d] = rng.standard_normal((n_layers, h_kv, n_cent, d)) * 0.8
    table[..., d] = rng.integers(1, 40, size=(n_layers, h_kv, n_cent))
    table[..., d + 1:] = rng.gamma(1.0, 0.5, size=(n_layers, h_kv, n_cent, d))
    table[:, :, :empty, d] = 0  # empty clusters never count
    return q, table


def _reference_rows(q, table, scale, group, var_weight=0.0):
    """(group scores, sizes) per (layer, KV head, row), as calibrate_threshold takes them."""
    n_layers, n_rows, n_head, d = q.shape
    h_kv = table.shape[1]
    g = n_head // h_kv
    rows = []
    for layer in range(n_layers):
        for h in range(h_kv):
            cent, sizes = table[layer, h, :, :d].astype(np.float64), table[layer, h, :, d].astype(np.float64)
            var = table[layer, h, :, d + 1:].astype(np.float64)
            for t in range(n_rows):
                s = reference_squeeze.group_scores(q[layer, t, h * g:(h + 1) * g], cent, sizes, scale, group, None, var,
                                                   var_weight)
                rows.append((s, sizes))
    return rows


def _identity_coarse(table):
    """Two levels whose coarse table is `table` itself, each fine cluster its own coarse one: the coarse calibration
    then runs over exactly the scores of `table`."""
    n_layers, h_kv, n_cent, _ = table.shape
    parent = np.broadcast_to(np.arange(n_cent, dtype=np.int32), (n_layers, h_kv, n_cent)).copy()
    return table.copy(), parent


@pytest.mark.parametrize("var_weight", [0.0, 0.5])
@pytest.mark.parametrize("group", ["max", "mean"])
@pytest.mark.parametrize("keep", [0.05, 0.2, 0.5, 1.0])
def test_coarse_calibration_matches_reference(group, keep, var_weight):
    rng = np.random.default_rng(7)
    q, table = _random_tables(rng)
    scale = 0.25
    if var_weight == 0.0:  # tables without variances (sidecars of formats 1 and 2)
        table = table[..., :q.shape[3] + 1].copy()
    coarse, parent = _identity_coarse(table)
    t, kept = ops.squeeze_calibrate(q, table, scale=scale, keep=0.5, keep_coarse=keep, coarse=coarse, parent=parent,
                                    group=group, n_threads=2, var_weight=var_weight)
    rows = _reference_rows(q, coarse, scale, group, var_weight)
    if var_weight > 0.0 and keep < 1.0:  # the term changes the threshold (or this test could not see it missing)
        t0, _ = ops.squeeze_calibrate(q, table[..., :q.shape[3] + 1].copy(), scale=scale, keep=0.5, keep_coarse=keep,
                                      coarse=coarse[..., :q.shape[3] + 1].copy(), parent=parent, group=group,
                                      n_threads=2)
        assert abs(t0 - t) > 1e-3 * t
    want = reference_squeeze.calibrate_threshold(rows, keep)
    assert t == pytest.approx(want, rel=1e-4, abs=1e-12), f"T = {t}, reference {want}"
    # C's scores are float32, so the cluster at T itself may round to either side of it in float64
    lo, hi = (np.mean([reference_squeeze.kept_fraction(s, n, t * f) for s, n in rows]) for f in (1 + 1e-5, 1 - 1e-5))
    assert lo - 1e-6 <= kept <= hi + 1e-6, (lo, kept, hi)
    assert kept >= keep - 1e-4
    if keep < 1.0:  # the largest such T: a slightly higher one keeps less than asked
        above = np.mean([reference_squeeze.kept_fraction(s, n, t * (1 + 1e-3)) for s, n in rows])
        assert above < keep + 1e-4


def test_one_level_has_nothing_to_calibrate():
    q, table = _random_tables(np.random.default_rng(5))
    assert ops.squeeze_calibrate(q, table, scale=0.25, keep=0.1) == (0.0, 1.0)


@pytest.mark.parametrize("var_weight", [0.0, 0.5])
def test_two_level_calibration_matches_a_float64_oracle(var_weight):
    rng = np.random.default_rng(3)
    q, table = _random_tables(rng, n_cent=30, empty=0)
    n_layers, _, h_kv, d = q.shape[0], None, table.shape[1], q.shape[3]
    n_coarse = 6
    parent = rng.integers(0, n_coarse, size=(n_layers, h_kv, 30)).astype(np.int32)
    coarse = np.zeros((n_layers, h_kv, n_coarse, 2 * d + 1), dtype=np.float32)
    for layer in range(n_layers):
        for h in range(h_kv):
            for c in range(n_coarse):  # the coarse centroids and sizes in float32, as before the variances
                members = parent[layer, h] == c
                size = table[layer, h, members, d].sum()
                coarse[layer, h, c, d] = size
                if size > 0:
                    coarse[layer, h, c, :d] = ((table[layer, h, members, d:d + 1] * table[layer, h, members, :d]).sum(0)
                                               / size)
            coarse[layer, h, :, d + 1:] = reference_squeeze.coarse_level(
                table[layer, h, :, :d], table[layer, h, :, d], table[layer, h, :, d + 1:], parent[layer, h], n_coarse)[2]
    scale, keep = 0.25, 0.2
    tc, kept = ops.squeeze_calibrate(q, table, scale=scale, keep=keep, coarse=coarse, parent=parent,
                                     var_weight=var_weight)
    # the oracle: the coarse rows at keep_coarse = 2 * keep
    g = q.shape[2] // h_kv
    coarse_rows = []
    for layer in range(n_layers):
        for h in range(h_kv):
            cc, cn = coarse[layer, h, :, :d].astype(np.float64), coarse[layer, h, :, d].astype(np.float64)
            cv = coarse[layer, h, :, d + 1:].astype(np.float64)
            for r in range(q.shape[1]):
                qg = q[layer, r, h * g:(h + 1) * g].astype(np.float64)
                coarse_rows.append((reference_squeeze.group_scores(qg, cc, cn, scale, "max", None, cv, var_weight), cn))
    want_tc = reference_squeeze.calibrate_threshold(coarse_rows, 2 * keep)
    assert tc == pytest.approx(want_tc, rel=1e-4)
    assert kept >= 2 * keep - 1e-4
    lo, hi = (np.mean([reference_squeeze.kept_fraction(s, n, tc * f) for s, n in coarse_rows]) for f in (1 + 1e-5, 1 - 1e-5))
    assert lo - 1e-6 <= kept <= hi + 1e-6, (lo, kept, hi)


def test_calibration_rejects_bad_arguments():
    q, table = _random_tables(np.random.default_rng(0))
    with pytest.raises(ValueError, match="keep"):
        ops.squeeze_calibrate(q, table, scale=0.25, keep=0.0)
    with pytest.raises(ValueError, match="coarse and parent"):
        ops.squeeze_calibrate(q, table, scale=0.25, keep=0.1, coarse=table)
    with pytest.raises(ValueError, match="var_weight"):
        ops.squeeze_calibrate(q, table[..., :q.shape[3] + 1].copy(), scale=0.25, keep=0.1, var_weight=0.5)


# ---------------------------------------------------------------------------------------------------
# In llama.cpp's decode path


@pytest.fixture(scope="module")
def llm(smollm2_path):
    llm = Llama(str(smollm2_path), n_ctx=N_CTX, flash_attn=True, n_threads=1, n_threads_batch=1, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def toks(llm) -> list[int]:
    return llm.tokenize(TEXT.encode(), add_bos=True)


@pytest.fixture(scope="module")
def doc(toks):
    return toks[:N_PREFIX]


@pytest.fixture(scope="module")
def questions(toks):
    return toks[700:716], toks[760:772]


def _greedy_after(llm: Llama, question: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """The question decoded after the cache's prefix (one batch), then n - 1 greedy tokens one by one."""
    ctx = Ctx.of(llm)
    pos0 = int(lc.llama_memory_seq_pos_max(ctx.mem, 0)) + 1
    logits = [ctx.prefill(question, pos0=pos0)[0]]
    out = [int(np.argmax(logits[0]))]
    for i in range(n - 1):
        logits.append(ctx.decode([(out[-1], pos0 + len(question) + i, 0, True)])[0])
        out.append(int(np.argmax(logits[-1])))
    return out, np.array(logits)


def _back_to_prefix(llm: Llama, n_prefix: int) -> None:
    lc.llama_memory_seq_rm(lc.llama_get_memory(llm.ctx), 0, n_prefix, -1)
    llm.n_tokens = n_prefix


def prefill_question(llm: Llama, question: list[int], n_prefix: int) -> np.ndarray:
    """The question's prefill logits [rows, n_vocab] after the cached prefix; the cache is left at the prefix."""
    out = Ctx.of(llm).prefill(question, pos0=n_prefix, all_logits=True)
    _back_to_prefix(llm, n_prefix)
    return out


def prefill_in_each_mode(llm: Llama, question: list[int], n_prefix: int) -> dict[str, np.ndarray]:
    """prefill_question in the prefill modes auto (the prepared one), sparse and dense; leaves the mode dense."""
    out = {"auto": prefill_question(llm, question, n_prefix)}
    for mode in ("sparse", "dense"):
        assert llm.set_fixed_context_prefill(mode).prefill == mode
        out[mode] = prefill_question(llm, question, n_prefix)
    return out


def seq_state(ctx: Ctx, seq: int) -> ctypes.Array:
    """Sequence `seq`'s state (llama_state_seq_get_data)."""
    size = lc.llama_state_seq_get_size(ctx.ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    assert lc.llama_state_seq_get_data(ctx.ctx, buf, size, seq) == size
    return buf


def load_seq_state(ctx: Ctx, seq: int, buf: ctypes.Array) -> None:
    """llama_state_seq_set_data of a seq_state into sequence `seq`."""
    assert lc.llama_state_seq_set_data(ctx.ctx, buf, len(buf), seq) == len(buf)


@pytest.fixture(scope="module")
def dense_answer(llm, doc, questions):
    """Dense greedy answer to question 0 (16 steps), on the cache a preparation leaves (then cleared)."""
    llm.prepare_fixed_context(doc, keep=1.0, **SETTINGS)
    llm.clear_fixed_context()
    return _greedy_after(llm, questions[0], 16)


def test_keep_one_equals_dense(llm, doc, questions, dense_answer):
    info = llm.prepare_fixed_context(doc, keep=1.0, **SETTINGS)
    assert info.prepared and info.n_prefix == N_PREFIX and info.n_clustered == N_PREFIX - 100
    assert info.n_layers == 30 and info.keep == 1.0 and info.threshold_coarse == 0.0 and info.kept_calib == 1.0
    tokens, logits = _greedy_after(llm, questions[0], 16)
    d_tokens, d_logits = dense_answer
    same = next((i for i, (a, b) in enumerate(zip(tokens, d_tokens)) if a != b), len(tokens))
    assert_logits_agree(logits[:same + 1], d_logits[:same + 1], "keep = 1 vs dense", tol=TOL_DENSE)
    assert tokens == d_tokens
    assert llm.fixed_context.prepared  # the answer's cells come after the prefix


@pytest.mark.parametrize("keep", [0.3, 0.1])
def test_small_keep_really_selects(llm, doc, questions, dense_answer, keep):
    d_tokens, _ = dense_answer
    ctx = Ctx.of(llm)
    rows = questions[0] + d_tokens[:15]
    # the op over every cluster (keep = 1)
    llm.prepare_fixed_context(doc, keep=1.0, **SETTINGS)
    logits_all = ctx.prefill(rows, pos0=N_PREFIX, all_logits=True)[len(questions[0]) - 1:]
    info = llm.prepare_fixed_context(doc, keep=keep, **SETTINGS)
    assert info.keep == pytest.approx(keep) and info.kept_calib == 1.0, info
    logits = ctx.prefill(rows, pos0=N_PREFIX, all_logits=True)[len(questions[0]) - 1:]
    assert np.isfinite(logits).all()
    # the skipped keys change the logits (the CPU op is deterministic: reading every key again would give keep 1's
    # logits bit for bit); the variance rule keeps them within dense's tolerance at keep 0.3 here, so that
    # tolerance cannot tell whether the op selects
    assert rel_err(logits, logits_all).max() > 1e-3, f"keep {keep}: the logits equal keep 1's: is the op used?"
    top5 = np.argsort(-logits, axis=1)[:, :5]
    hits = np.mean([d_tokens[i] in top5[i] for i in range(len(d_tokens))])
    assert hits >= 0.75, f"dense's greedy token in the centroid-sparse top 5 at only {hits:.0%} of steps"


def test_question_after_question_equals_a_fresh_preparation(llm, doc, questions):
    llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    _greedy_after(llm, questions[0], 8)
    _back_to_prefix(llm, N_PREFIX)        # a new question: the old one and its answer go
    assert llm.fixed_context.prepared
    got = _greedy_after(llm, questions[1], 8)
    llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    want = _greedy_after(llm, questions[1], 8)
    assert got[0] == want[0]
    assert_logits_agree(got[1], want[1], "second question vs a fresh preparation", tol=TOL)


def test_create_completion_reuses_the_prefix(llm):
    text = TEXT[:1500]
    llm.prepare_fixed_context(text, keep=0.2, **SETTINGS)
    out = llm.create_completion(text + " Who was the first keeper?", max_tokens=4, temperature=0)
    assert out["choices"][0]["text"]
    assert llm.fixed_context.prepared, "create_completion re-evaluated the prepared prefix"


def test_change_inside_the_prefix_drops_it(llm, doc, questions):
    llm.prepare_fixed_context(doc, keep=0.1, **SETTINGS)
    mem = lc.llama_get_memory(llm.ctx)
    lc.llama_memory_seq_rm(mem, 0, N_PREFIX - 20, -1)       # inside the calibration tail: kept
    assert llm.fixed_context.prepared
    Ctx.of(llm).prefill(doc[N_PREFIX - 20:], pos0=N_PREFIX - 20)
    assert llm.fixed_context.prepared
    lc.llama_memory_seq_rm(mem, 0, 100, 101)                # a clustered cell: dropped
    got = _greedy_after(llm, questions[0], 4)[1]
    assert not llm.fixed_context.prepared
    # the oracle: the same removal with no prepared prefix (dense over the same cells)
    # (the tail decoded again while the prefix was prepared: its keys come from the sparse path there too)
    llm.prepare_fixed_context(doc, keep=0.1, **SETTINGS)
    lc.llama_memory_seq_rm(mem, 0, N_PREFIX - 20, -1)
    Ctx.of(llm).prefill(doc[N_PREFIX - 20:], pos0=N_PREFIX - 20)
    llm.clear_fixed_context()
    lc.llama_memory_seq_rm(mem, 0, 100, 101)
    want = _greedy_after(llm, questions[0], 4)[1]
    assert_logits_agree(got, want, "after the prefix was dropped vs dense", tol=TOL)


def test_clear_and_cache_clear_drop_it(llm, doc):
    llm.prepare_fixed_context(doc, keep=0.1, **SETTINGS)
    llm.clear_fixed_context()
    assert not llm.fixed_context.prepared
    llm.prepare_fixed_context(doc, keep=0.1, **SETTINGS)
    lc.llama_memory_clear(lc.llama_get_memory(llm.ctx), True)
    assert not llm.fixed_context.prepared


def test_save_then_load_gives_the_same_outputs(llm, smollm2_path, doc, questions, tmp_path):
    llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    _greedy_after(llm, questions[0], 2)                     # saving trims the cache back to the prefix
    path = str(tmp_path / "doc.state")
    llm.save_fixed_context(path)
    want = _greedy_after(llm, questions[1], 8)
    other = Llama(str(smollm2_path), n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False, fixed_context=path)
    try:
        info = other.fixed_context
        assert info.prepared and info.n_prefix == N_PREFIX
        assert info.keep == llm.fixed_context.keep == pytest.approx(0.2)
        got = _greedy_after(other, questions[1], 8)
    finally:
        other.close()
    assert got[0] == want[0]
    assert_logits_agree(got[1], want[1], "loaded vs prepared", tol=TOL)


def test_recalibrating_equals_preparing_at_that_keep(llm, smollm2_path, doc, questions, tmp_path):
    at_03 = llm.prepare_fixed_context(doc, keep=0.3, **SETTINGS)
    want_info = llm.prepare_fixed_context(doc, keep=0.1, **SETTINGS)
    want = _greedy_after(llm, questions[0], 6)
    llm.prepare_fixed_context(doc, keep=0.3, **SETTINGS)
    _greedy_after(llm, questions[1], 2)
    _back_to_prefix(llm, N_PREFIX)
    info = llm.recalibrate_fixed_context(0.1)                # same clusters, a new budget
    assert info.prepared and info.keep == want_info.keep and info.kept_calib == want_info.kept_calib
    got = _greedy_after(llm, questions[0], 6)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])           # the same op inputs: the same logits
    # it survives a save and load (sidecar format 2 keeps the calibration queries), and goes back up
    _back_to_prefix(llm, N_PREFIX)
    path = str(tmp_path / "doc.state")
    llm.save_fixed_context(path)
    other = Llama(str(smollm2_path), n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False, fixed_context=path)
    try:
        assert other.fixed_context.keep == want_info.keep
        back = other.recalibrate_fixed_context(0.3)
        assert back.keep == at_03.keep and back.kept_calib == at_03.kept_calib
    finally:
        other.close()


def test_recalibrating_fails_clearly(llm, doc, tmp_path):
    info = llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    for keep in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="keep"):
            llm.recalibrate_fixed_context(keep)
    assert llm.fixed_context == info                         # a failed call leaves the prefix as it was
    # a version-1 sidecar (no calibration queries: format 2 appends them) loads; one level needs none for a new keep,
    # two levels do (their coarse threshold is calibrated on them)
    path = tmp_path / "doc.squeeze"
    for levels in (1, 2):
        llm.prepare_fixed_context(doc, keep=0.2, var_weight=0.0, levels=levels, centroids_coarse=0.02,
                                  **SETTINGS)  # the rule version-1 files hold
        squeeze_api.save(llm.ctx, str(path))
        old = downgrade_sidecar(path.read_bytes(), 1)
        path.write_bytes(old)
        loaded = squeeze_api.load(llm.ctx, str(path), doc)
        assert loaded.keep == pytest.approx(0.2) and loaded.var_weight == 0.0 and loaded.levels == levels
        if levels == 1:
            assert llm.recalibrate_fixed_context(0.1).keep == pytest.approx(0.1)
        else:
            with pytest.raises(ValueError, match="version 1"):
                llm.recalibrate_fixed_context(0.1)
    llm.clear_fixed_context()
    with pytest.raises(ValueError, match="no prepared prefix"):
        llm.recalibrate_fixed_context(0.1)


def test_preparation_is_deterministic(llm, doc, tmp_path):
    files = []
    for i in range(2):
        llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
        files.append(tmp_path / f"run{i}.squeeze")
        squeeze_api.save(llm.ctx, str(files[-1]))
    assert files[0].read_bytes() == files[1].read_bytes()


def downgrade_sidecar(data: bytes, version: int) -> bytes:
    """A sidecar of the current format (4) rewritten in format 1 or 2 as older builds wrote it: unframed (format 3),
    then no var_weight and no table width (tables of d + 1 floats: the variance columns dropped), and format 1
    without the calibration queries. The file must hold a var_weight-0 preparation (the only rule those formats
    know)."""
    data = squeeze_files.as_version_3(data)
    at = 0

    def take(n: int) -> bytes:
        nonlocal at
        at += n
        return data[at - n:at]

    def val(fmt: str):
        return struct.unpack("<" + fmt, take(struct.calcsize(fmt)))[0]

    def vec(item: int) -> bytes:  # a length-prefixed array, returned with its length
        n = val("Q")
        return struct.pack("<Q", n) + take(n * item)

    out = [take(4)]
    assert val("I") == 3, "a sidecar of format 3 is expected"
    out.append(struct.pack("<I", version))
    out.append(vec(1))                            # fingerprint
    out.append(take(8 * 4))                       # centroids .. group
    assert val("f") == 0.0, "formats 1 and 2 hold the mean rule only"
    out.append(take(5 * 4))                       # n_prefix .. kept_calib
    out.append(vec(4))                            # tokens
    n_layers = val("I")
    out.append(struct.pack("<I", n_layers))
    for _ in range(n_layers):
        out.append(take(4 + 1))                   # il, active
        out.append(vec(1))                        # reason
        d, n_head_kv, n_cent, n_coarse = (val("q") for _ in range(4))
        width = val("q")
        out.append(struct.pack("<4q", d, n_head_kv, n_cent, n_coarse))
        for kind in ("table", "assign", "coarse", "parent"):
            raw = vec(4)
            if kind in ("table", "coarse") and len(raw) > 8:
                rows = np.frombuffer(raw[8:], dtype=np.float32).reshape(-1, width)[:, :d + 1]
                raw = struct.pack("<Q", rows.size) + rows.tobytes()
            out.append(raw)
    if version >= 2:
        out.append(data[at:])                     # the calibration queries
    return b"".join(out)


def test_version_2_sidecar_loads_as_the_mean_rule(llm, doc, questions, tmp_path):
    # a file of the previous format (no variances: the mean rule) still loads, and decodes as the same preparation
    # made now with var_weight 0; recalibrating it works (format 2 holds the calibration queries)
    info = llm.prepare_fixed_context(doc, keep=0.2, var_weight=0.0, **SETTINGS)
    ctx = Ctx.of(llm)
    want = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
    path = tmp_path / "v2.squeeze"
    squeeze_api.save(llm.ctx, str(path))
    path.write_bytes(downgrade_sidecar(path.read_bytes(), 2))
    llm.clear_fixed_context()
    lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
    loaded = squeeze_api.load(llm.ctx, str(path), doc)
    assert (loaded.keep, loaded.var_weight, loaded.kept_calib) == (info.keep, 0.0, info.kept_calib)
    got = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
    assert np.array_equal(got, want)
    assert llm.recalibrate_fixed_context(0.1).var_weight == 0.0


def test_variance_rule_is_the_default_and_saved(llm, doc, questions, tmp_path):
    # var_weight 1 by default; a save and load keeps it, and it selects differently from the mean rule at the same
    # keep
    info = llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    assert info.var_weight == 1.0
    ctx = Ctx.of(llm)
    with_var = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
    path = tmp_path / "v3.squeeze"
    squeeze_api.save(llm.ctx, str(path))
    lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
    loaded = squeeze_api.load(llm.ctx, str(path), doc)
    assert (loaded.var_weight, loaded.keep) == (1.0, info.keep)
    assert np.array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True), with_var)
    mean = llm.prepare_fixed_context(doc, keep=0.2, var_weight=0.0, **SETTINGS)
    assert mean.var_weight == 0.0
    lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
    assert rel_err(ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True), with_var).max() > 1e-3
    with pytest.raises(ValueError, match="var_weight"):
        llm.prepare_fixed_context(doc, keep=0.2, var_weight=-1.0, **SETTINGS)


def _sidecar(llm, doc, tmp_path) -> bytes:
    llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    path = tmp_path / "ok.squeeze"
    squeeze_api.save(llm.ctx, str(path))
    return path.read_bytes()


def test_mismatched_sidecar_fails_clearly(llm, doc, tmp_path):
    good = _sidecar(llm, doc, tmp_path)
    path = tmp_path / "bad.squeeze"
    cases = {
        "not a centroid-sparse prefix file": b"XXXX" + good[4:],
        "format version 99": good[:4] + struct.pack("<I", 99) + good[8:],
        # the numbers in the other byte order (a file from a big-endian machine, read here)
        "other byte order": good[:4] + good[4:8][::-1] + good[8:],
        # a consistent file (its checksums written for its bytes) whose model fingerprint differs
        "different model": squeeze_files.replace_part(good, 0, squeeze_files.flip(
            good[squeeze_files.parts(good)[0].payload:][:squeeze_files.parts(good)[0].length], 8)),
        "truncated": good[:len(good) // 2],
        "header checksum mismatch": squeeze_files.flip(good, 40),
    }
    for expect, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(ValueError, match=expect):
            squeeze_api.load(llm.ctx, str(path), doc)
    path.write_bytes(good)
    with pytest.raises(ValueError, match="different prefix"):
        squeeze_api.load(llm.ctx, str(path), doc[:-1] + [doc[-1] + 1])
    assert squeeze_api.load(llm.ctx, str(path), doc).prepared


def test_calibration_tokens_over_several_ubatches(llm, doc, questions):
    """More calibration tokens than a ubatch: prepare decodes them in several ubatches of one size, and each one's
    queries are captured (a reused graph would capture none: "captured query rows have an unexpected size"; two
    levels, whose coarse threshold is calibrated on them). The oracle: the same preparation over one ubatch gives the
    same threshold and, at keep 1, dense's logits."""
    cfg = squeeze_api.SqueezeConfig(keep=0.2, centroids=0.1, n_calib=200, levels=2, centroids_coarse=0.02)
    thresholds = []
    for n_batch in (64, 512):
        with Ctx(llm.model, n_batch=n_batch) as ctx:
            ctx.prefill(doc)
            info = squeeze_api.prepare(ctx.ctx, doc, cfg)
            assert info.prepared and info.n_clustered == N_PREFIX - 200 and abs(info.kept_calib - 0.4) < 0.03, info
            thresholds.append(info.threshold_coarse)
    # other ubatches, other rounding of the captured queries: the threshold moves by at most that
    assert thresholds[0] == pytest.approx(thresholds[1], rel=1e-2)
    with Ctx(llm.model, n_batch=64) as ctx:
        ctx.prefill(doc)
        squeeze_api.prepare(ctx.ctx, doc, dataclasses.replace(cfg, keep=1.0))
        got = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
        squeeze_api.clear(ctx.ctx)
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        want = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
    assert_logits_agree(got, want, "keep = 1 after a prepare over several ubatches vs dense", tol=TOL_DENSE)


def test_damaged_kv_state_fails_clearly(llm, smollm2_path, doc, questions, tmp_path):
    """A saved prefix's KV state alone is read through llama_squeeze_load_state_file, which checks its layout first:
    llama.cpp's own loader aborts the process on a file cut short. A damaged file is a ValueError; the good one then
    loads and answers as saved. (A pair saved together is also checked against its sidecar's checksums:
    test_squeeze_integrity.py.)"""
    llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    path = tmp_path / "doc.state"
    llm.save_fixed_context(str(path))
    want = _greedy_after(llm, questions[0], 4)
    good = path.read_bytes()
    sidecar = (tmp_path / "doc.state.squeeze").read_bytes()
    bad = tmp_path / "bad.state"
    (tmp_path / "bad.state.squeeze").write_bytes(sidecar)
    cases = {
        "does not read as a KV state": good[:-1],                                   # cut short by a byte
        "does not read as a KV state ": good[:len(good) // 2],                      # by half
        "does not read as a KV state  ": good + b"\0" * 8,                          # longer
        "ends inside its token list": good[:14],
        "magic or version": b"XXXX" + good[4:],
        "more than the context": good[:8] + struct.pack("<I", 10**6) + good[12:],   # a token count past n_ctx
    }
    for expect, data in cases.items():
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=expect.strip()):
            squeeze_api.load_state_file(llm.ctx, str(bad), N_CTX)
    other = Llama(str(smollm2_path), n_ctx=N_CTX, flash_attn=True, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        assert other.load_fixed_context(str(path)).prepared
        got = _greedy_after(other, questions[0], 4)
    finally:
        other.close()
    assert got[0] == want[0]
    assert_logits_agree(got[1], want[1], "loaded after refusals vs prepared", tol=TOL)


def test_bad_settings_fail_clearly(llm, smollm2_path, doc):
    for kwargs, expect in ((dict(keep=0.0), "keep"), (dict(keep=1.5), "keep"), (dict(levels=3), "levels"),
                           (dict(centroids=0.0), "centroids"), (dict(n_calib=0), "n_calib"),
                           (dict(levels=2, centroids_coarse=0.5), "centroids_coarse"), (dict(init="random"), "init")):
        with pytest.raises(ValueError, match=expect):
            llm.prepare_fixed_context(doc, **{**SETTINGS, **kwargs})
    with pytest.raises(ValueError, match="more than this context holds"):
        llm.prepare_fixed_context(doc * 2, **SETTINGS)
    with pytest.raises(ValueError, match="flash attention"):
        Llama(str(smollm2_path), n_ctx=N_CTX, flash_attn=False, verbose=False, fixed_context="x.state")
    plain = Llama(str(smollm2_path), n_ctx=N_CTX, flash_attn=False, verbose=False)
    try:
        with pytest.raises(ValueError, match="flash attention"):
            plain.prepare_fixed_context(doc, **SETTINGS)
    finally:
        plain.close()
    # the C API directly: the cache must hold exactly the prefix
    llm.prepare_fixed_context(doc, keep=1.0, **SETTINGS)
    with pytest.raises(ValueError, match="positions after the prefix"):
        squeeze_api.prepare(llm.ctx, doc[:300], squeeze_api.SqueezeConfig())
    with pytest.raises(ValueError, match="fewer than the prefix"):
        squeeze_api.prepare(llm.ctx, doc + doc[:10], squeeze_api.SqueezeConfig())


def test_python_defaults_are_the_c_defaults():
    # SqueezeConfig() and llama_squeeze_default_params() each state the defaults (the CLI tools take the C ones):
    # they must agree, field for field
    want = squeeze_api._api().llama_squeeze_default_params()
    got = squeeze_api.SqueezeConfig().to_c()
    for name, _ in got._fields_:
        if not name.startswith("progress_callback"):
            assert getattr(got, name) == getattr(want, name), name
    assert squeeze_api.SqueezeConfig().centroids == pytest.approx(want.centroids) == 0.1


def test_kpp_initialisation(llm, doc, questions, dense_answer, tmp_path):
    # k-means++ seeding: keep 1 is still dense attention; a small keep selects and calibrates; preparing is
    # deterministic, and the clusters are not the evenly seeded ones (the seeding is used). The seeds themselves are
    # checked against the float64 reference in tests/test_op_kmeans.py.
    info = llm.prepare_fixed_context(doc, keep=1.0, init="kpp", **SETTINGS)
    assert info.prepared and info.keep == 1.0
    tokens, logits = _greedy_after(llm, questions[0], 16)
    d_tokens, d_logits = dense_answer
    same = next((i for i, (a, b) in enumerate(zip(tokens, d_tokens)) if a != b), len(tokens))
    assert_logits_agree(logits[:same + 1], d_logits[:same + 1], "kpp, keep = 1 vs dense", tol=TOL_DENSE)
    files = {}
    for name, init in (("kpp0", "kpp"), ("kpp1", "kpp"), ("even", "even")):
        info = llm.prepare_fixed_context(doc, keep=0.2, init=init, **SETTINGS)
        assert info.keep == pytest.approx(0.2), (init, info)
        files[name] = tmp_path / f"{name}.squeeze"
        squeeze_api.save(llm.ctx, str(files[name]))
    assert files["kpp0"].read_bytes() == files["kpp1"].read_bytes()
    assert files["kpp0"].read_bytes() != files["even"].read_bytes()


def test_two_levels(llm, doc, questions, dense_answer):
    info = llm.prepare_fixed_context(doc, keep=0.2, levels=2, centroids_coarse=0.02, **SETTINGS)
    assert info.prepared and info.levels == 2 and info.threshold_coarse > 0
    assert abs(info.kept_calib - 0.4) < 0.03, info  # under kept coarse clusters, at keep_coarse = 2 keep
    d_tokens, _ = dense_answer
    logits = Ctx.of(llm).prefill(questions[0] + d_tokens[:15], pos0=N_PREFIX, all_logits=True)[len(questions[0]) - 1:]
    top5 = np.argsort(-logits, axis=1)[:, :5]
    assert np.mean([d_tokens[i] in top5[i] for i in range(len(d_tokens))]) >= 0.75


def test_with_sparq_the_prefix_takes_precedence(llm, doc, questions):
    llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    want = _greedy_after(llm, questions[0], 6)
    try:
        llm.set_sparq(SparqConfig(k1=8, k2=32, min_n_kv=0))
        llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
        got = _greedy_after(llm, questions[0], 6)
    finally:
        llm.set_sparq(dataclasses.replace(llm.sparq, enabled=False))
    assert got[0] == want[0]
    assert_logits_agree(got[1], want[1], "prefix + SparQ vs prefix alone", tol=TOL)


def test_a_copy_into_another_stream_keeps_the_prefix(llm, doc, questions):
    """With one stream per sequence, seq_cp across streams overwrites the destination stream's buffers: the
    prepared prefix survives a copy out of its stream (its keys are untouched; the question's answer is the same
    bits as before the copy) and is dropped by a copy into its stream."""
    p = lc.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch = 2 * N_CTX, 512, 512
    p.n_seq_max, p.kv_unified = 2, False
    p.n_threads = p.n_threads_batch = 1
    p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = Ctx.__new__(Ctx)
    ctx.ctx, ctx._owned, ctx.n_batch, ctx.n_vocab = lc.llama_init_from_model(llm.model, p), True, 512, llm.n_vocab()
    assert ctx.ctx
    try:
        ctx.prefill(doc)
        squeeze_api.prepare(ctx.ctx, doc, squeeze_api.SqueezeConfig(keep=0.2, centroids=0.1))
        want = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        ctx.prefill(questions[1], seq=1)                       # stream 1 holds another sequence
        lc.llama_memory_seq_cp(ctx.mem, 0, 1, -1, -1)          # stream 0 -> stream 1 (at the next decode)
        got = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
        assert squeeze_api.info(ctx.ctx).prepared, "a copy out of the prefix's stream dropped it"
        np.testing.assert_array_equal(got, want)
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        lc.llama_memory_seq_cp(ctx.mem, 1, 0, -1, -1)          # stream 1 -> stream 0: the prefix's keys go
        ctx.prefill(questions[1], pos0=N_PREFIX, seq=1)
        assert not squeeze_api.info(ctx.ctx).prepared
    finally:
        ctx.close()


def test_a_copy_of_the_prefix_stream_reads_it_sparsely(llm, doc, questions):
    """With one stream per sequence, a cross-stream seq_cp copies the prefix's stream cell for cell: the copy (a
    mirror) reads the prefix sparsely too (the same clusters over the same cells: the same bits as the preparing
    sequence, where reading it densely answers otherwise), and so does a copy of the copy. A removal inside the
    clustered prefix, a state load or another stream's copy ends a mirror (dense there again) and keeps the prefix."""
    with Ctx(llm.model, n_seq_max=3, kv_unified=False, n_ctx=3 * N_CTX) as ctx:
        ctx.prefill(doc)
        squeeze_api.prepare(ctx.ctx, doc, squeeze_api.SqueezeConfig(keep=0.2, centroids=0.1))
        want = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        ctx.prefill(questions[1], seq=1)                       # stream 1 holds another sequence
        assert squeeze_api.seq_sparse(ctx.ctx, 0) and not squeeze_api.seq_sparse(ctx.ctx, 1)
        lc.llama_memory_seq_cp(ctx.mem, 0, 1, -1, -1)          # stream 0 -> stream 1 (the buffers at the next decode)
        assert squeeze_api.seq_sparse(ctx.ctx, 1)
        np.testing.assert_array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, seq=1, all_logits=True), want)
        lc.llama_memory_seq_cp(ctx.mem, 1, 2, -1, -1)          # a copy of the copy
        lc.llama_memory_seq_rm(ctx.mem, 2, N_PREFIX, -1)
        np.testing.assert_array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, seq=2, all_logits=True), want)
        # the oracle's other side: the same cells read densely answer otherwise, so the bits above are the op's
        lc.llama_memory_seq_rm(ctx.mem, 2, N_PREFIX, -1)
        squeeze_api.set_prefill(ctx.ctx, "dense")
        assert not np.array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, seq=2, all_logits=True), want)
        squeeze_api.set_prefill(ctx.ctx, "sparse")
        # a removal inside the clustered prefix ends stream 2's mirror only
        lc.llama_memory_seq_rm(ctx.mem, 2, 100, 101)
        assert not squeeze_api.seq_sparse(ctx.ctx, 2)
        assert squeeze_api.seq_sparse(ctx.ctx, 1) and squeeze_api.info(ctx.ctx).prepared
        # a copy from a stream that does not hold the prefix into a mirror ends it
        lc.llama_memory_seq_cp(ctx.mem, 2, 1, -1, -1)
        assert not squeeze_api.seq_sparse(ctx.ctx, 1) and squeeze_api.info(ctx.ctx).prepared
        # copied again it mirrors again, and the prefix's own sequence still answers with the same bits
        lc.llama_memory_seq_cp(ctx.mem, 0, 1, -1, -1)
        lc.llama_memory_seq_rm(ctx.mem, 1, N_PREFIX, -1)
        assert squeeze_api.seq_sparse(ctx.ctx, 1)
        np.testing.assert_array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, seq=1, all_logits=True), want)
        lc.llama_memory_seq_rm(ctx.mem, 1, N_PREFIX, -1)
        np.testing.assert_array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True), want)
        # a state load of the mirror's only sequence rewrites its cells: the mirror ends, the prefix stays
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        load_seq_state(ctx, 1, seq_state(ctx, 1))
        assert not squeeze_api.seq_sparse(ctx.ctx, 1) and squeeze_api.seq_sparse(ctx.ctx, 0)
        assert squeeze_api.info(ctx.ctx).prepared


def test_a_state_load_of_another_sequence_keeps_the_prefix(llm, doc, questions):
    """llama_state_seq_set_data of another sequence writes only that sequence's cells: the prefix stays prepared
    and answers with the same bits; a load of the prefix's own sequence drops it."""
    with Ctx(llm.model, n_seq_max=2, kv_unified=True) as ctx:
        ctx.prefill(doc)
        squeeze_api.prepare(ctx.ctx, doc, squeeze_api.SqueezeConfig(keep=0.2, centroids=0.1))
        want = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        ctx.prefill(questions[1], seq=1)
        buf = seq_state(ctx, 1)
        lc.llama_memory_seq_rm(ctx.mem, 1, -1, -1)
        load_seq_state(ctx, 1, buf)
        assert squeeze_api.info(ctx.ctx).prepared, "a state load of sequence 1 dropped sequence 0's prefix"
        np.testing.assert_array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True), want)
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        load_seq_state(ctx, 0, seq_state(ctx, 0))
        assert not squeeze_api.info(ctx.ctx).prepared


def test_sequences_sharing_the_prefix_cells_read_it_sparsely(llm, doc, questions):
    """With one stream, llama_memory_seq_cp shares the prefix's cells with another sequence: that sequence reads the
    prepared prefix too (the same kept clusters: the same bits as the preparing sequence), and the prefix stays
    prepared while any sequence holds its cells, through the preparing sequence's removal and a state load of a
    sequence that shares them; it is dropped when the last holder removes a clustered cell."""
    with Ctx(llm.model, n_seq_max=3, kv_unified=True, n_ctx=2 * N_CTX) as ctx:  # room for a sequence's state load
        ctx.prefill(doc)
        squeeze_api.prepare(ctx.ctx, doc, squeeze_api.SqueezeConfig(keep=0.2, centroids=0.1))
        want = ctx.prefill(questions[0], pos0=N_PREFIX, all_logits=True)
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        lc.llama_memory_seq_cp(ctx.mem, 0, 1, -1, -1)
        got = ctx.prefill(questions[0], pos0=N_PREFIX, seq=1, all_logits=True)
        assert squeeze_api.info(ctx.ctx).prepared
        np.testing.assert_array_equal(got, want)
        # the oracle's other side: read densely (prefill mode dense: the same cells, the same layout) the question
        # is answered otherwise, so the bits above are the op's
        lc.llama_memory_seq_rm(ctx.mem, 1, N_PREFIX, -1)
        squeeze_api.set_prefill(ctx.ctx, "dense")
        assert not np.array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, seq=1, all_logits=True), want)
        squeeze_api.set_prefill(ctx.ctx, "sparse")
        # sequence 0 lets go of the prefix: sequence 1 still holds it
        lc.llama_memory_seq_rm(ctx.mem, 1, N_PREFIX, -1)
        lc.llama_memory_seq_cp(ctx.mem, 1, 2, -1, -1)
        lc.llama_memory_seq_rm(ctx.mem, 0, -1, -1)
        ctx.prefill(questions[1], seq=0)                       # other cells at the prefix's positions
        np.testing.assert_array_equal(ctx.prefill(questions[0], pos0=N_PREFIX, seq=1, all_logits=True), want)
        assert squeeze_api.info(ctx.ctx).prepared, "removing the preparing sequence dropped a prefix others hold"
        # a state load of sequence 1 (which shares the cells with sequence 2) writes its own new cells and leaves the
        # prefix's alone; the question then lands in other cells (another summation order: TOL_LAYOUT)
        lc.llama_memory_seq_rm(ctx.mem, 1, N_PREFIX, -1)
        load_seq_state(ctx, 1, seq_state(ctx, 1))
        assert squeeze_api.info(ctx.ctx).prepared, "a state load of a sharing sequence dropped the prefix"
        assert_logits_agree(ctx.prefill(questions[0], pos0=N_PREFIX, seq=2, all_logits=True), want,
                            "a sharing sequence after a state load", tol=TOL_LAYOUT)
    with Ctx(llm.model, n_seq_max=2, kv_unified=True) as ctx:
        ctx.prefill(doc)
        squeeze_api.prepare(ctx.ctx, doc, squeeze_api.SqueezeConfig(keep=0.2, centroids=0.1))
        lc.llama_memory_seq_cp(ctx.mem, 0, 1, -1, -1)
        lc.llama_memory_seq_rm(ctx.mem, 0, 100, 101)           # sequence 1 still holds cell 100: kept
        assert squeeze_api.info(ctx.ctx).prepared
        lc.llama_memory_seq_rm(ctx.mem, 1, 100, 101)           # its last holder: dropped
        assert not squeeze_api.info(ctx.ctx).prepared
    with Ctx(llm.model, n_seq_max=2, kv_unified=True, n_ctx=2 * N_CTX) as ctx:
        # the last holder frees clustered cells, and a state load of another sequence (the same positions) comes
        # before any decode or query: the freed cells are noticed before the load can reuse them
        ctx.prefill(doc, seq=1)
        buf = seq_state(ctx, 1)
        lc.llama_memory_seq_rm(ctx.mem, 1, -1, -1)
        ctx.prefill(doc)
        squeeze_api.prepare(ctx.ctx, doc, squeeze_api.SqueezeConfig(keep=0.2, centroids=0.1))
        lc.llama_memory_seq_rm(ctx.mem, 0, -1, -1)
        load_seq_state(ctx, 1, buf)
        assert not squeeze_api.info(ctx.ctx).prepared


def test_prefill_modes_choose_how_a_question_reads_the_prefix(llm, doc, questions):
    # "dense" is the plain cache's prefill bit for bit (the oracle: the same cells, no prepared prefix); "sparse"
    # reads the kept clusters; "auto" is sparse here (the KV is in host memory) and dense on a GPU. The centroid-only
    # rule (var_weight 0) keeps the sparse logits clearly apart from dense's, which the checks that the op is used need
    # (the default rule's are within 1.5x dense's tolerance here)
    info = llm.prepare_fixed_context(doc, keep=0.1, var_weight=0.0, **SETTINGS)
    assert info.prefill == "auto"
    ctx = Ctx.of(llm)
    question = questions[0]
    modes = prefill_in_each_mode(llm, question, N_PREFIX)
    auto, sparse, dense = modes["auto"], modes["sparse"], modes["dense"]
    assert llm.fixed_context.prepared and llm.fixed_context.prefill == "dense"
    # decodes still read the clusters in the dense mode: one token after the question differs from the plain cache's
    ctx.prefill(question, pos0=N_PREFIX)
    step_sparse = ctx.decode([(question[0], N_PREFIX + len(question), 0, True)])[0]
    _back_to_prefix(llm, N_PREFIX)
    llm.clear_fixed_context()
    plain = prefill_question(llm, question, N_PREFIX)
    ctx.prefill(question, pos0=N_PREFIX)
    step_plain = ctx.decode([(question[0], N_PREFIX + len(question), 0, True)])[0]
    _back_to_prefix(llm, N_PREFIX)
    np.testing.assert_array_equal(dense, plain)
    np.testing.assert_array_equal(auto, sparse)
    assert rel_err(sparse, plain).max() > 1.5 * TOL_DENSE, "the sparse prefill equals dense: is the op used?"
    assert rel_err(step_sparse[None], step_plain[None]).max() > 1.5 * TOL_DENSE
    with pytest.raises(ValueError, match="no prepared prefix"):
        llm.set_fixed_context_prefill("dense")
    with pytest.raises(ValueError, match="prefill must be one of"):
        llm.set_fixed_context_prefill("fast")
