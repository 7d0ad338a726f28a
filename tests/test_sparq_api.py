"""The SparQ Python API: SparqConfig, its C mirror, Llama(sparq=...) / set_sparq / .sparq, transfer_ratio.

Settings are read back from llama.cpp (llama_get_sparq), so every round trip goes through the C side.
"""
from __future__ import annotations

import ctypes
import dataclasses
import pickle
import re
from fractions import Fraction

import pytest
import sparq_llama
from conftest import REPO, python
from sparq_llama import Llama, SparqConfig
from sparq_llama import sparq as sparq_api

HEADER = REPO / "ggml_ops" / "include" / "sparq-llama.h"
SMALL = dict(n_ctx=256, n_threads=1, verbose=False)


# ---------------------------------------------------------------------------------------------------
# transfer_ratio


@pytest.mark.parametrize("s,d,r,k", [(65536, 128, 32, 128), (1024, 64, 16, 64), (8192, 64, 16, 128),
                                     (100, 256, 64, 16), (1, 1, 1, 1)])
@pytest.mark.parametrize("mean", [True, False])
def test_transfer_ratio_is_the_design_formula(s, d, r, k, mean):
    # the f16 index on an f16 cache: every element 2 bytes, so the ratio of elements
    dense = 2 * s * d + 2 * d
    sparse = s * r + 2 * k * d + (4 * d if mean else 2 * d)
    assert sparq_llama.transfer_ratio(s, d, r, k, mean=mean, index="f16") == pytest.approx(dense / sparse, rel=1e-15)


def test_transfer_ratio_known_values_and_errors():
    assert sparq_llama.transfer_ratio(65536, 128, 32, 128, index="f16") == pytest.approx(7.87515, abs=1e-5)
    assert sparq_llama.transfer_ratio(1024, 64, 16, 64, index="f16") == pytest.approx(131200 / 24832)
    for bad in [(0, 128, 32, 128), (1024, 0, 32, 128), (1024, 128, 0, 128), (1024, 128, 32, -1)]:
        with pytest.raises(ValueError, match="must all be >= 1"):
            sparq_llama.transfer_ratio(*bad)
    with pytest.raises(ValueError, match="k2 must be an integer"):
        sparq_llama.transfer_ratio(1024, 128, 32, 12.5)
    with pytest.raises(ValueError, match="mean must be True or False"):
        sparq_llama.transfer_ratio(1024, 128, 32, 128, mean="on")
    with pytest.raises(ValueError, match="index must be one of 'f16', 'q8', 'q4'"):
        sparq_llama.transfer_ratio(1024, 128, 32, 128, index="q2")
    with pytest.raises(ValueError, match="the q4 index scores every key component: k1 must be head_dim = 128"):
        sparq_llama.transfer_ratio(1024, 128, 32, 128, index="q4")
    with pytest.raises(ValueError, match="kv_type must be one of"):
        sparq_llama.transfer_ratio(1024, 128, 32, 128, kv_type="q3_k")


# (n_kv, d, k1, k2, mean, kv_type, index) -> (dense bytes, SparQ bytes), worked out by hand:
# dense = (2*S*d + 2*d) * b_kv; SparQ = S*k1*b_index + (2*k2*d + 4*d or 2*d) * b_kv
HAND_BYTES = [
    # f16 cache, q8 index (34 bytes per 32 values): 65536*64*34/32 = 4456448; (2*128*128 + 4*128)*2 = 66560
    ((65536, 128, 64, 128, True, "f16", "q8"), (33554944, 4523008)),
    # q8_0 cache and q8 index: (2*1024*64 + 128)*34/32 = 139400; (1024*16 + 2*64*64 + 256)*34/32 = 26384
    ((1024, 64, 16, 64, True, "q8_0", "q8"), (139400, 26384)),
    # q8_0 cache, f16 index (K^T in f16 for a quantized K): 2048*8*2 = 32768; (2*32*64 + 2*64)*34/32 = 4488
    ((2048, 64, 8, 32, False, "q8_0", "f16"), (278664, 37256)),
    # f32 cache, f16 index (K^T in f16 whatever the cache, 2 bytes): 100*10*2 + (2*16*32 + 4*32)*4 = 6608
    ((100, 32, 10, 16, True, "f32", "f16"), (25856, 6608)),
]


@pytest.mark.parametrize("args,want", HAND_BYTES)
def test_transfer_bytes_by_hand(args, want):
    s, d, r, k, mean, kv_type, index = args
    got = sparq_api.transfer_bytes(s, d, r, k, mean, kv_type=kv_type, index=index)
    assert got == pytest.approx(want, rel=1e-15)
    assert sparq_llama.transfer_ratio(s, d, r, k, mean, kv_type=kv_type, index=index) == pytest.approx(
        want[0] / want[1], rel=1e-15)


def test_transfer_ratio_q8_index_reads_twice_the_components_for_about_the_bytes():
    f16 = sparq_llama.transfer_ratio(8192, 64, 16, 128, mean=False, index="f16")
    q8 = sparq_llama.transfer_ratio(8192, 64, 32, 128, mean=False, index="q8")
    assert f16 == pytest.approx(2097408 / 295168) and q8 == pytest.approx(2097408 / 311552)
    assert sparq_llama.transfer_ratio(8192, 64, 16, 128) == sparq_llama.transfer_ratio(
        8192, 64, 16, 128, index=sparq_api.DEFAULT_INDEX)


def test_index_bytes():
    assert sparq_api.index_bytes("q8", "f16") == sparq_api.index_bytes("q8", "f32") == Fraction(34, 32)
    assert [sparq_api.index_bytes("f16", t) for t in ("f32", "f16", "bf16", "q8_0", "q4_0")] == [2, 2, 2, 2, 2]


def test_one_transfer_ratio_and_a_cheap_import():
    from sparq_llama import reference

    assert sparq_llama.transfer_ratio is reference.transfer_ratio is sparq_api.transfer_ratio
    assert sparq_llama.SparqConfig is SparqConfig
    res = python("import sys, sparq_llama; sparq_llama.transfer_ratio(1024, 64, 16, 64); sparq_llama.SparqConfig(); "
                 "print(sorted(m for m in ('numpy', 'llama_cpp') if m in sys.modules))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"import sparq_llama loaded {res.stdout.strip()}"


# ---------------------------------------------------------------------------------------------------
# SparqConfig and its C struct (no model)


def test_config_defaults_and_immutability():
    cfg = SparqConfig()
    assert dataclasses.asdict(cfg) == dict(enabled=True, k1=None, k2=128, window=None, sinks=0, mean="auto",
                                           policy="sparq", sparse_v_thresh=0.0, default_layout=False,
                                           prefill=False, swa=False, min_n_kv=None,
                                           index=sparq_api.DEFAULT_INDEX, select=sparq_api.DEFAULT_SELECT)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.k2 = 64  # type: ignore[misc]


@pytest.mark.parametrize("kwargs,match", [
    (dict(enabled="yes"), "enabled must be True or False"),
    (dict(prefill=1), "prefill must be True or False"),
    (dict(k2="128"), "k2 must be an integer"),
    (dict(k2=128.0), "k2 must be an integer"),
    (dict(k2=True), "k2 must be an integer, got the bool"),
    (dict(k2=2**31), "does not fit the C int32_t"),
    (dict(k1=0), r"k1 must be >= 1, or None for the index's default"),
    (dict(window=-1), r"window must be >= 0, or None for k2/4"),
    (dict(min_n_kv=-1), r"min_n_kv must be >= 0, or None"),
    (dict(mean="maybe"), "mean must be one of 'auto', 'on', 'off'"),
    (dict(mean=True), "mean must be one of"),
    (dict(policy="topk"), "policy must be one of 'sparq', 'exact', 'window'"),
    (dict(sparse_v_thresh="0.1"), "sparse_v_thresh must be a number"),
    (dict(sparse_v_thresh=float("nan")), "sparse_v_thresh must be finite"),
    (dict(index="q2"), "index must be one of 'f16', 'q8', 'q4'"),
    (dict(index=1), "index must be one of"),
    (dict(select="sigma"), "select must be one of 'q', 'qsigma'"),
    (dict(select=None), "select must be one of"),
])
def test_config_rejects_bad_types_and_names(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparqConfig(**kwargs)


def test_config_normalises_numbers():
    class Index:  # an integer-like object (numpy ints behave so)
        def __index__(self):
            return 7

    cfg = SparqConfig(k1=Index(), sparse_v_thresh=0)
    assert cfg.k1 == 7 and type(cfg.k1) is int
    assert cfg.sparse_v_thresh == 0.0 and type(cfg.sparse_v_thresh) is float


def _header_struct_fields() -> list[tuple[str, str]]:
    text = HEADER.read_text()
    body = re.search(r"struct llama_sparq_params\s*\{(.*?)\};", text, re.DOTALL)
    assert body, f"no struct llama_sparq_params in {HEADER}"
    body_text = re.sub(r"//[^\n]*", "", body.group(1))
    return [(name, ctype) for ctype, name in re.findall(r"(\w+)\s+(\w+)\s*;", body_text)]


def test_ctypes_struct_mirrors_the_header():
    c_of = {"bool": ctypes.c_bool, "int32_t": ctypes.c_int32, "float": ctypes.c_float}
    want = [(name, c_of[ctype]) for name, ctype in _header_struct_fields()]
    assert [(n, t) for n, t in sparq_api.LlamaSparqParams._fields_] == want
    assert [f.name for f in dataclasses.fields(SparqConfig)] == [n for n, _ in want]


def test_header_enums_match_the_names():
    text = HEADER.read_text()
    for prefix, names in (("LLAMA_SPARQ_MEAN_", sparq_api.MEAN_MODES), ("LLAMA_SPARQ_POLICY_", sparq_api.POLICIES),
                          ("LLAMA_SPARQ_INDEX_", sparq_api.INDEXES), ("LLAMA_SPARQ_SELECT_", sparq_api.SELECTS)):
        values = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(prefix + r"(\w+)\s*=\s*(\d+)", text)}
        assert values == {name: i for i, name in enumerate(names)}


@pytest.mark.parametrize("cfg", [
    SparqConfig(),
    SparqConfig(enabled=False),
    SparqConfig(k1=8, k2=64, window=8, sinks=4, mean="on", policy="exact", sparse_v_thresh=0.1,
                default_layout=True, prefill=True, swa=True, min_n_kv=0),
    SparqConfig(k1=1, k2=1, window=0, mean="off", policy="window", sparse_v_thresh=1e-3, min_n_kv=4096),
    SparqConfig(k1=32, index="q8", select="qsigma"),
    SparqConfig(index="f16", select="q"),
    SparqConfig(index="q4", select="q"),
])
def test_config_c_struct_round_trip(cfg):
    p = cfg.to_c()
    assert (p.k1, p.window, p.min_n_kv) == (cfg.k1 or 0, -1 if cfg.window is None else cfg.window,
                                           -1 if cfg.min_n_kv is None else cfg.min_n_kv)
    assert p.mean == sparq_api.MEAN_MODES.index(cfg.mean) and p.policy == sparq_api.POLICIES.index(cfg.policy)
    assert (p.index, p.select) == (sparq_api.INDEXES.index(cfg.index), sparq_api.SELECTS.index(cfg.select))
    assert SparqConfig.from_c(p) == cfg  # float32 sparse_v_thresh reads back as the decimal given


def test_from_c_rejects_unknown_index_and_select():
    for name, value in (("index", 3), ("select", -1)):
        p = SparqConfig().to_c()
        setattr(p, name, value)
        with pytest.raises(ValueError, match=rf"llama_sparq_params.{name} = {value} is not a known value"):
            SparqConfig.from_c(p)


def test_default_layout_without_an_index_takes_f16():
    assert SparqConfig().index == sparq_api.DEFAULT_INDEX
    assert SparqConfig(default_layout=True).index == "f16"
    assert SparqConfig(default_layout=True, index="q8").index == "q8"       # given: kept (C refuses it)
    held = SparqConfig(index="q8")
    assert sparq_api.config_from_kwargs({"sparq_default_layout": True}, held).index == "f16"
    assert sparq_api.config_from_kwargs({"default_layout": True}, held).index == "f16"
    assert sparq_api.config_from_kwargs({"default_layout": True, "index": "q8"}, held).index == "q8"


def test_choosing_the_q4_index_without_a_k1_takes_none():
    # the q4 index scores every component: a held k1 does not carry over to it, one given with it does (C refuses it)
    held = SparqConfig(k1=32, index="q8")
    assert sparq_api.config_from_kwargs({"index": "q4"}, held) == dataclasses.replace(held, index="q4", k1=None)
    assert sparq_api.config_from_kwargs({"index": "q4", "k1": 16}, held).k1 == 16
    assert sparq_api.config_from_kwargs({"k2": 64}, SparqConfig(index="q4")).k1 is None
    assert sparq_api.config_from_kwargs({"default_layout": False}, held).index == "q8"
    assert sparq_api.config_from_kwargs({"k2": 64}, held).index == "q8"


def test_to_kwargs_round_trips_index_and_select():
    cfg = SparqConfig(k1=32, index="q8", select="qsigma")
    kwargs = sparq_api.to_kwargs(cfg)
    assert (kwargs["index"], kwargs["select"]) == ("q8", "qsigma")
    assert sparq_api.config_from_kwargs(kwargs, SparqConfig(enabled=False), field_names=False) == cfg


# ---------------------------------------------------------------------------------------------------
# The C functions


def test_c_defaults_are_the_python_defaults_disabled():
    assert sparq_api.available()
    assert sparq_api.c_defaults() == SparqConfig(enabled=False)


@pytest.mark.parametrize("cfg,match", [
    (SparqConfig(k2=0), "k2"),
    (SparqConfig(k2=-5), "k2"),
    (SparqConfig(k2=32, window=30, sinks=4), "window|sinks"),
    (SparqConfig(sinks=-1), "sinks"),
    (SparqConfig(sparse_v_thresh=1.5), "sparse_v_thresh|Sparse-V|thresh"),
    (SparqConfig(sparse_v_thresh=-0.1), "sparse_v_thresh|Sparse-V|thresh"),
    (SparqConfig(default_layout=True, index="q8"), "q8 index .* default_layout"),
    (SparqConfig(default_layout=True, index="q4"), "q4 index .* default_layout"),
    (SparqConfig(index="q4", k1=32), "q4 index .*k1"),
])
def test_c_check_rejects_bad_values(cfg, match):
    with pytest.raises(ValueError, match=match):
        sparq_api.check(cfg)


@pytest.mark.parametrize("name,value,match", [("index", 3, "index must be f16 \\(0\\), q8 \\(1\\) or q4 \\(2\\), got 3"),
                                              ("index", -1, "index must be"),
                                              ("select", 2, "select must be q \\(0\\) or qsigma \\(1\\), got 2")])
def test_c_check_rejects_unknown_enum_values(name, value, match):
    p = SparqConfig().to_c()
    setattr(p, name, value)
    msg = sparq_api._api().llama_sparq_check(None, ctypes.byref(p))
    assert msg is not None and re.search(match, msg.decode()), msg


def test_c_check_accepts_good_values():
    for cfg in (SparqConfig(), SparqConfig(enabled=False),
                SparqConfig(k1=8, k2=32, window=28, sinks=4, sparse_v_thresh=0.5, min_n_kv=0),
                SparqConfig(k2=1, window=0, policy="window", mean="on", default_layout=True, prefill=True),
                SparqConfig(k1=32, index="q8", select="qsigma"), SparqConfig(default_layout=True, select="qsigma")):
        sparq_api.check(cfg)


# ---------------------------------------------------------------------------------------------------
# Llama(sparq=...)


def test_kwargs_round_trip_through_llama_get_sparq(smollm2_path):
    import llama_cpp

    llm = Llama(str(smollm2_path), sparq=True, k1=8, k2=64, sparq_window=8, sparq_sinks=4, sparq_mean="on",
                sparq_policy="exact", sparse_v_thresh=0.01, sparq_default_layout=True, sparq_prefill=True,
                sparq_swa=True, sparq_min_n_kv=0, **SMALL)
    try:
        assert llm.sparq == SparqConfig(k1=8, k2=64, window=8, sinks=4, mean="on", policy="exact",
                                        sparse_v_thresh=0.01, default_layout=True, prefill=True, swa=True,
                                        min_n_kv=0)
        assert llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    finally:
        llm.close()


def test_index_and_select_reach_llama_get_sparq(smollm2_path):
    # the settings only: with these short contexts every decode stays below min_n_kv (dense)
    llm = Llama(str(smollm2_path), sparq=True, k1=32, index="q8", select="qsigma", **SMALL)
    try:
        assert llm.sparq == SparqConfig(k1=32, index="q8", select="qsigma")
        p = sparq_api._api().llama_get_sparq(llm.ctx)
        assert (p.index, p.select) == (1, 1)
        assert llm.set_sparq(select="q").select == "q" and llm.sparq.index == "q8"
        assert llm.set_sparq(default_layout=True) == SparqConfig(k1=32, default_layout=True, index="f16", select="q")
        with pytest.raises(ValueError, match="default_layout"):
            llm.set_sparq(index="q8")
        assert llm.sparq.index == "f16"
    finally:
        llm.close()
    llm = Llama(str(smollm2_path), sparq=True, sparq_default_layout=True, **SMALL)
    try:
        assert (llm.sparq.index, llm.sparq.select) == ("f16", sparq_api.DEFAULT_SELECT)
    finally:
        llm.close()


def test_sparq_true_alone_is_the_defaults(smollm2_path):
    llm = Llama(str(smollm2_path), sparq=True, **SMALL)
    try:
        assert llm.sparq == SparqConfig()
        out = llm.create_completion("The capital of France is", max_tokens=4, temperature=0.0)
        assert out["choices"][0]["text"]
    finally:
        llm.close()


def test_without_sparq_kwargs_the_context_is_dense(smollm2_path):
    llm = Llama(str(smollm2_path), **SMALL)
    try:
        assert sparq_api.c_defaults() == SparqConfig(enabled=False)
        assert llm.sparq == SparqConfig(enabled=False), (
            f"a context never given SparQ settings holds {llm.sparq}, not llama_sparq_default_params()")
    finally:
        llm.close()


def test_sparq_false_stores_the_values_given(smollm2_path):
    llm = Llama(str(smollm2_path), sparq=False, k2=64, sparq_sinks=2, flash_attn=True, **SMALL)
    try:
        assert llm.sparq == SparqConfig(enabled=False, k2=64, sinks=2)
        assert llm.set_sparq() == SparqConfig(k2=64, sinks=2)
    finally:
        llm.close()


@pytest.mark.parametrize("kwargs,match", [
    (dict(sparq="yes"), "enabled must be True or False"),
    (dict(sparq=True, k2=0), "k2"),
    (dict(sparq=True, k2="128"), "k2 must be an integer"),
    (dict(sparq=True, k1=-1), "k1 must be >= 1"),
    (dict(sparq=True, sparq_mean="maybe"), "mean must be one of"),
    (dict(sparq=True, sparq_policy="topk"), "policy must be one of"),
    (dict(sparq=True, k2=16, sparq_window=16, sparq_sinks=1), "window|sinks"),
    (dict(sparq=True, sparse_v_thresh=1.5), "thresh|Sparse-V"),
    (dict(sparq=True, flash_attn=False), "SparQ needs flash attention"),
    (dict(sparq=True, index="q2"), "index must be one of 'f16', 'q8', 'q4'"),
    (dict(sparq=True, index="q4", k1=32), "q4 index .*k1"),
    (dict(sparq=True, select="sigma"), "select must be one of 'q', 'qsigma'"),
    (dict(sparq=True, sparq_default_layout=True, index="q8"), "default_layout"),
])
def test_bad_kwargs_fail_before_the_model_is_loaded(tmp_path, kwargs, match):
    missing = tmp_path / "no-such-model.gguf"  # loading it would fail with "Model path does not exist"
    with pytest.raises(ValueError, match=match) as info:
        Llama(str(missing), **kwargs)
    assert "Model path" not in str(info.value)


def test_misspelt_sparq_kwargs_are_type_errors(tmp_path):
    with pytest.raises(TypeError, match=r"'sparq_windw' \(did you mean 'sparq_window'\?\)"):
        Llama(str(tmp_path / "x.gguf"), sparq=True, sparq_windw=8)
    with pytest.raises(TypeError, match="'window'"):  # field names are set_sparq's, not the constructor's
        Llama(str(tmp_path / "x.gguf"), sparq=True, window=8)


def test_a_value_the_model_cannot_honour_fails_after_loading(smollm2_path):
    with pytest.raises(ValueError, match="k1"):  # SmolLM2's head_dim is 64
        Llama(str(smollm2_path), sparq=True, k1=65, **SMALL)


# ---------------------------------------------------------------------------------------------------
# set_sparq at run time


def test_set_sparq_at_run_time_reads_back(smollm2_path):
    llm = Llama(str(smollm2_path), flash_attn=True, **SMALL)
    try:
        assert not llm.sparq.enabled
        assert llm.set_sparq(k2=64) == SparqConfig(k2=64)                        # on, the rest as held
        cfg = SparqConfig(k1=8, k2=32, window=4, mean="off", min_n_kv=0)
        assert llm.set_sparq(cfg) == cfg == llm.sparq                           # exactly that config
        assert llm.set_sparq(k2=16, sparq_sinks=2) == dataclasses.replace(cfg, k2=16, sinks=2)  # changes only
        assert llm.set_sparq(cfg, policy="window") == dataclasses.replace(cfg, policy="window")
        assert llm.set_sparq(enabled=False) == dataclasses.replace(cfg, policy="window", enabled=False)
        assert llm.set_sparq(sparq=True).enabled
        out = llm.create_completion("Once upon a time", max_tokens=4, temperature=0.0)
        assert out["choices"][0]["text"]
    finally:
        llm.close()


def test_set_sparq_rejects_bad_settings_and_keeps_the_held_ones(smollm2_path):
    llm = Llama(str(smollm2_path), sparq=True, k2=64, **SMALL)
    try:
        held = llm.sparq
        for kwargs, err, match in [(dict(k2=0), ValueError, "k2"),
                                   (dict(k1=65), ValueError, "k1"),
                                   (dict(mean="sometimes"), ValueError, "mean must be one of"),
                                   (dict(k22=8), TypeError, r"'k22' \(did you mean 'k2'\?\)"),
                                   (dict(window=4, sparq_window=4), TypeError, "both set 'window'"),
                                   (dict(enabled=True, sparq=True), TypeError, "both set 'enabled'")]:
            with pytest.raises(err, match=match):
                llm.set_sparq(**kwargs)
            assert llm.sparq == held
        with pytest.raises(TypeError, match="SparqConfig"):
            llm.set_sparq({"k2": 32})
    finally:
        llm.close()


def test_set_sparq_needs_flash_attention(smollm2_path):
    llm = Llama(str(smollm2_path), flash_attn=False, **SMALL)
    try:
        with pytest.raises(ValueError, match="SparQ needs flash attention"):
            llm.set_sparq()
        assert not llm.sparq.enabled
        # the C side says so too (llama-cli and llama-bench rely on it, not on Python)
        p = SparqConfig().to_c()
        lib = sparq_api._api()
        assert lib.llama_set_sparq(llm.ctx, ctypes.byref(p)) == -1
        assert b"flash attention" in lib.llama_sparq_last_error()
        assert not llm.sparq.enabled
        assert lib.llama_sparq_check(llm.ctx, ctypes.byref(p)) is not None, (
            "llama_sparq_check(ctx, SparQ on) passes on a context without flash attention, which "
            "llama_set_sparq then refuses: the header promises the check covers what the context can honour")
    finally:
        llm.close()


def test_pickle_keeps_the_sparq_settings(smollm2_path):
    llm = Llama(str(smollm2_path), sparq=True, k1=8, k2=48, sparq_mean="on", **SMALL)
    try:
        copy = pickle.loads(pickle.dumps(llm))
        try:
            assert copy.sparq == llm.sparq == SparqConfig(k1=8, k2=48, mean="on")
        finally:
            copy.close()
    finally:
        llm.close()
    dense = Llama(str(smollm2_path), **SMALL)
    try:
        copy = pickle.loads(pickle.dumps(dense))
        try:
            assert not copy.sparq.enabled
        finally:
            copy.close()
    finally:
        dense.close()


def test_sparq_kwargs_are_documented():
    doc = Llama.__doc__ or ""
    for name in sparq_api.KWARG_FIELDS:
        assert name in doc, name


# ---------------------------------------------------------------------------------------------------
# what the context runs, said once when the Llama is made (llama.cpp's log, shown by default: verbose=True)

_MAKE = """
import sys
from sparq_llama import Llama, models
llm = Llama(str(models.fetch("smollm2")), n_ctx=256, n_threads=1, {kwargs})
print("SUMMARY=" + llm.sparq_summary)
llm.close()
"""


@pytest.mark.parametrize(("kwargs", "expected"), [
    ("sparq=True", "SparQ: on, k1 = 32 (head_dim/2), k2 = 128, index = q8, select = qsigma; runs in 30 of 30 layers; "
                   "dense below 512 cached cells (the measured default with the KV in host memory"),
    ("sparq=True, type_k=20", "runs in 0 of 30 layers, 30 dense: 30 K cache type iq4_nl"),  # GGML_TYPE_IQ4_NL
    ("sparq=True, k2=64, sparq_min_n_kv=0", "k2 = 64, index = q8, select = qsigma; runs in 30 of 30 layers; "
                                            "dense below 0 cached cells"),
    ("", "SparQ: off (dense attention in every layer)"),
])
def test_llama_logs_what_runs_once_by_default(kwargs, expected):
    res = python(_MAKE.format(kwargs=kwargs), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    logged = [line for line in res.stderr.splitlines() if line.startswith("llama_sparq_log_summary: ")]
    assert len(logged) == 1 and expected in logged[0], logged
    # the property reads the same line
    assert f"SUMMARY={logged[0].removeprefix('llama_sparq_log_summary: ')}" in res.stdout.splitlines()


def test_llama_quiet_logs_nothing(smollm2_path):
    res = python(_MAKE.format(kwargs="sparq=True, verbose=False"), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "llama_sparq_log_summary" not in res.stderr and "SUMMARY=SparQ: on" in res.stdout
