"""The quality harness's pieces that need no model: the k1 recipe, the settings, statistics, scoring."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from sparq_llama import SparqConfig, transfer_ratio
from sparq_llama import sparq as sparq_api
from sparq_llama.eval import ModelShape, k1_for_ratio, settings_for
from sparq_llama.eval.report import targets
from sparq_llama.eval.stats import summarize
from sparq_llama.eval.tasks import matched_chars

SMOL = ModelShape(head_dim=64, n_head=9, n_head_kv=3)
GEMMA = ModelShape(head_dim=256, n_head=4, n_head_kv=1, has_swa=True)
MHA = ModelShape(head_dim=128, n_head=32, n_head_kv=32)


@pytest.mark.parametrize("shape", [SMOL, GEMMA, MHA])
@pytest.mark.parametrize("n_kv", [1024, 1792, 2048, 4000, 8192, 32768])
@pytest.mark.parametrize("target", [Fraction(1, 2), Fraction(1, 4), Fraction(1, 8)])
@pytest.mark.parametrize("index", ["f16", "q8"])
def test_k1_recipe_is_the_largest_r_within_the_target(shape, n_kv, target, index):
    mean = shape.mean_auto
    k1 = k1_for_ratio(target, n_kv, shape.head_dim, 128, mean, index=index)
    ratio = lambda r: 1 / transfer_ratio(n_kv, shape.head_dim, r, 128, mean=mean, index=index)
    if k1 is None:
        assert ratio(1) > target       # even r = 1 moves more than the target
        return
    assert 1 <= k1 <= shape.head_dim
    assert ratio(k1) <= target
    assert k1 == shape.head_dim or ratio(k1 + 1) > target


def test_k1_recipe_known_values():
    # SmolLM2 (d=64, GQA: no mean) at 2048 cells: (2048*128/8 + 16 - 2*128*64 - 128) / 2048 -> 7
    assert k1_for_ratio(Fraction(1, 8), 2048, 64, index="f16") == 7
    assert k1_for_ratio(Fraction(1, 2), 2048, 64, index="f16") == 55
    assert k1_for_ratio(Fraction(1, 8), 1024, 64, index="f16") is None     # k2 = 128 rows alone are 1/8 of dense
    # the paper's Llama-2 microbenchmark point: S=4096, r=32, k=128 is ~1/6.4 of dense
    assert k1_for_ratio(Fraction(1, 6), 4096, 128, mean=True, index="f16") == 34
    # the q8 index, 34 bytes per 32 components: ((2*2048*64 + 128)*2/8 - (2*128*64 + 128)*2) / (2048*34/32)
    # = 32544 / 2176 -> 14, twice f16's 7 at the same bytes
    assert k1_for_ratio(Fraction(1, 8), 2048, 64, index="q8") == 14
    assert k1_for_ratio(Fraction(1, 8), 1024, 64, index="q8") is None
    # a q8_0 cache with the f16 index: the K^T components cost 2 bytes against the cache's 34/32
    assert k1_for_ratio(Fraction(1, 8), 2048, 64, index="f16", kv_type="q8_0") == 4
    assert k1_for_ratio(Fraction(1, 8), 2048, 64) == k1_for_ratio(Fraction(1, 8), 2048, 64,
                                                                   index=sparq_api.DEFAULT_INDEX)


def test_q4_settings_read_every_component_where_the_ratio_allows():
    # the q4 index takes k1 = head_dim only: at 2048 cells SmolLM2's 1/2 and 1/4 are reachable, 1/8 is not (the index
    # alone is 18/32 of a byte against dense's 2*2 per component: 0.14 of dense)
    settings, skipped = settings_for(2048, SMOL, index="q4")
    by = {s.name: s for s in settings}
    assert by["sparq-1/2"].config.k1 == by["sparq-1/4"].config.k1 == 64 and by["sparq-1/4"].config.index == "q4"
    assert by["sparq-1/4"].transfer == pytest.approx(1 / transfer_ratio(2048, 64, 64, 128, mean=False, index="q4"))
    assert by["sparq-1/4"].transfer <= 1 / 4
    assert "sparq-1/8" not in by and any(name == "sparq-1/8" for name, _ in skipped)


def test_q4_ablation_adds_the_q4_index_at_its_own_ratio():
    # the index mode's "q4" ablation: one setting reading every component (k1 None: head_dim), at the q4 index's ratio
    settings, _ = settings_for(4096, SMOL, ablations=("q4",))
    q4 = next(s for s in settings if s.name == "sparq-q4")
    assert (q4.config.index, q4.config.k1, q4.family) == ("q4", None, "ablation")
    assert q4.transfer == pytest.approx(1 / transfer_ratio(4096, 64, 64, 128, mean=False, index="q4"))
    assert "sparq-q4" not in [s.name for s in settings_for(4096, SMOL)[0]]
    from sparq_llama.eval.agreement import variants
    assert variants(4096, 64, False, ("q4",))["q4"] == [64, sparq_api.DEFAULT_SELECT, "q4"]
    assert "q4" not in variants(4096, 64, False, ())


def test_settings_carry_the_index():
    settings, _ = settings_for(2048, SMOL, index="q8")
    by = {s.name: s for s in settings}
    assert all(s.config.index == "q8" for s in settings[1:])
    assert by["sparq-1/8"].config.k1 == 14
    assert by["sparq-1/8"].transfer == pytest.approx(1 / transfer_ratio(2048, 64, 14, 128, mean=False, index="q8"))
    assert by["sparq-1/8"].transfer <= 1 / 8
    default, _ = settings_for(2048, SMOL)
    assert all(s.config.index == sparq_api.DEFAULT_INDEX for s in default[1:])


def test_settings_cover_the_comparison():
    settings, skipped = settings_for(2048, SMOL)
    names = [s.name for s in settings]
    assert names[0] == "dense" and settings[0].config is None
    assert {"sparq-1/2", "sparq-1/4", "sparq-1/8", "exact", "window", "sparq-1/8-mean-on",
            "sparq-1/8-no-window", "sparq-1/8-sinks16"} <= set(names)
    assert "sparq-1/8-swa" not in names and not skipped               # SmolLM2 has no SWA layers
    by = {s.name: s for s in settings}
    for s in settings[1:]:
        assert isinstance(s.config, SparqConfig) and s.config.enabled and s.config.prefill
        assert s.config.k2 == 128 and s.config.min_n_kv == 0
    assert by["sparq-1/8"].transfer <= 1 / 8 < by["sparq-1/4"].transfer <= 1 / 4
    assert by["exact"].config.policy == "exact" and by["exact"].transfer > 1 / 2
    w = by["window"].config
    assert (w.policy, w.sinks, w.window) == ("window", 16, 112)
    assert by["sparq-1/8-mean-on"].config.mean == "on"               # GQA: auto is off
    assert by["sparq-1/8-no-window"].config.window == 0
    assert "sparq-1/8-swa" in [s.name for s in settings_for(4096, GEMMA)[0]]
    assert settings_for(4096, MHA)[0][4].config.mean == "off"        # MHA: the ablation turns it off


def test_unreachable_ratio_is_reported_not_faked():
    settings, skipped = settings_for(1024, SMOL)
    names = {s.name for s in settings}
    assert "sparq-1/8" not in names and "sparq-1/4" in names
    assert not any(n.startswith("sparq-1/8-") for n in names)
    assert [name for name, _ in skipped] == ["sparq-1/8"] and "unreachable" in skipped[0][1]


def test_matched_chars():
    assert matched_chars("abcdef", "abcxyz") == 3
    assert matched_chars("", "abc") == 0
    assert matched_chars("abc", "abc and more") == 3


def _recs(key, values):
    return [{key: v} for v in values]


def test_summary_retrieval_and_repetition():
    dense = _recs("correct", [1, 1, 1, 0])
    s = summarize("retrieval", "x", _recs("correct", [1, 0, 1, 0]), dense)
    assert s.value == 0.5 and math.isclose(s.se, math.sqrt(0.25 / 4))
    assert math.isclose(s.rel, 0.5 / 0.75)
    r = summarize("repetition", "x", _recs("matched_chars", [10, 20, 30]), _recs("matched_chars", [20, 20, 20]))
    assert r.value == 20 and math.isclose(r.se, np.std([10, 20, 30], ddof=1) / math.sqrt(3)) and r.rel == 1.0


def test_summary_ppl_is_paired_and_per_window():
    dense = [{"nll": 100.0, "n_tokens": 50, "n_chars": 200}, {"nll": 200.0, "n_tokens": 50, "n_chars": 200}]
    worse = [{"nll": 101.0, "n_tokens": 50, "n_chars": 200}, {"nll": 201.0, "n_tokens": 50, "n_chars": 200}]
    s = summarize("ppl", "x", worse, dense)
    assert math.isclose(s.value, math.exp(302 / 100))
    assert math.isclose(s.rel, math.exp(2 / 100))
    assert s.rel_se == 0.0                       # the same shift on both windows: no paired spread
    assert math.isclose(s.bpc, 302 / math.log(2) / 400)
    with pytest.raises(ValueError):
        summarize("ppl", "x", worse[:1], dense)


def _fake(task_values):
    """Records for two examples per task: {setting: [value per example]}."""
    key = {"ppl": "nll", "retrieval": "correct", "repetition": "matched_chars"}
    recs = {}
    for task, by_setting in task_values.items():
        for setting, values in by_setting.items():
            family = setting.split("-")[0] if setting.startswith("sparq") else setting
            for i, v in enumerate(values):
                r = {"task": task, "example": f"{task}/{i}", "setting": setting, "length": 2048,
                     "family": family, "transfer": 0.1, "k1": None, key[task]: v}
                if task == "ppl":
                    r.update(n_tokens=100, n_chars=400)
                recs[f"{task}/{i}|{setting}"] = r
    return {"records": recs}


def test_targets_compare_on_the_same_examples():
    data = _fake({
        "ppl": {"dense": [100.0, 100.0], "sparq-1/8": [101.0, 101.0], "exact": [100.5, 100.5],
                "window": [130.0, 130.0]},
        "retrieval": {"dense": [1, 1], "sparq-1/8": [1, 0], "exact": [1, 1], "window": [0, 0]},
    })
    checks = {(c["task"], c["check"].split(":")[0]): c for c in targets(data)}
    assert checks[("ppl", "sparq-1/8 vs dense")]["met"]            # +1%
    assert checks[("ppl", "SparQ >= window")]["met"]
    assert checks[("ppl", "SparQ within 1 point of exact top-k")]["met"]   # 0.5 points behind
    assert not checks[("retrieval", "sparq-1/8 vs dense")]["met"]  # 50% of dense
    assert not checks[("retrieval", "SparQ within 1 point of exact top-k")]["met"]
    assert checks[("retrieval", "SparQ >= window")]["met"]
