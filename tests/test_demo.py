"""The main job (`sparq-llama demo`): dense and SparQ decoding side by side on the real model."""
import os
import re
import shutil
import subprocess

import pytest
from conftest import run
from sparq_llama.demo import (
    SPREAD_WARN,
    AttentionShape,
    DemoConfig,
    DemoResult,
    Machine,
    RunResult,
    choose_threads,
    measurement_warnings,
    report,
    spread,
    wait_policy,
)
from sparq_llama.reference import transfer_ratio

ROW = r"^{name}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)-([\d.]+)\s+(\d+)$"


def _parse(stdout: str, k1: int, k2: int) -> dict:
    """The numbers and texts of a demo report (AssertionError naming what is missing)."""
    out = {}
    for key, name in (("dense", "dense"), ("sparq", re.escape(f"SparQ (k1={k1}, k2={k2})"))):
        m = re.search(ROW.format(name=name), stdout, re.MULTILINE)
        assert m, f"no {key} row in:\n{stdout}"
        out[key] = {"prefill": float(m.group(1)), "decode": float(m.group(2)), "min": float(m.group(3)),
                    "max": float(m.group(4)), "generated": int(m.group(5))}
        text = re.search(rf"^--- {name} continuation ---\n(.*?)(?=\n\n--- |\Z)", stdout, re.MULTILINE | re.DOTALL)
        assert text, f"no {key} continuation in:\n{stdout}"
        out[key]["text"] = text.group(1)
    m = re.search(r"^decode speedup \(SparQ / dense\): ([\d.]+)x \(medians; per round ([\d.]+)x-([\d.]+)x\)$",
                  stdout, re.MULTILINE)
    assert m, stdout
    out["speedup"] = float(m.group(1))
    out["round_speedups"] = (float(m.group(2)), float(m.group(3)))
    m = re.search(r"^threads: (\d+) \((.*)\); (OMP_WAIT_POLICY.*)$", stdout, re.MULTILINE)
    out["threads"], out["threads_reason"], out["wait_policy"] = (int(m.group(1)), m.group(2), m.group(3)) if m else (
        None, None, None)
    m = re.search(r"^(\d+) interleaved round\(s\)", stdout, re.MULTILINE)
    assert m, stdout
    out["rounds"] = int(m.group(1))
    out["warnings"] = re.findall(r"^WARNING: (.*)$", stdout, re.MULTILINE)
    m = re.search(r"^transfer ratio \(.*n_kv=(\d+), d=(\d+), k1=(\d+), k2=(\d+), mean (on|off), index (f16|q8)\): "
                  r"([\d.]+)x$", stdout, re.MULTILINE)
    assert m, stdout
    out["ratio_args"] = (int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5) == "on")
    out["index"] = m.group(6)
    out["ratio"] = float(m.group(7))
    m = re.search(r"^SparQ: k1 (\d+), k2 (\d+), index (f16|q8), select (q|qsigma)$", stdout, re.MULTILINE)
    assert m, stdout
    out["settings"] = (int(m.group(1)), int(m.group(2)), m.group(3), m.group(4))
    return out


def test_report_shows_both_runs_speedup_and_transfer_ratio():
    """The report's format and arithmetic, without a model (the parser below is the one the slow test uses)."""
    dense = RunResult("dense", [1, 2, 3, 4], " to be", 250.0, 80.0)
    sparq = RunResult("sparq", [1, 2, 9], " or not", 251.0, 100.0)
    res = DemoResult(prompt_tokens=6000, shape=AttentionShape(64, 9, 3), k1=16, k2=128, n_threads=2,
                     dense=dense, sparq=sparq, prompt_tail="Whether 'tis nobler")
    assert res.speedup == pytest.approx(1.25)
    assert res.agreeing_tokens == 2
    assert res.transfer_ratio == pytest.approx(transfer_ratio(6000, 64, 16, 128, mean=False))
    parsed = _parse(report(DemoConfig(), res), 16, 128)
    assert parsed["threads"] is None  # how it ran on the machine is not known here: no line, no busy warning
    assert parsed["warnings"] == ["one round only: no spread measured (--repeats 3 or more)"]
    assert parsed["dense"]["decode"] == 80.0 and parsed["sparq"]["decode"] == 100.0
    assert parsed["dense"]["generated"] == 4 and parsed["sparq"]["generated"] == 3
    assert parsed["speedup"] == 1.25
    assert parsed["ratio_args"] == (6000, 64, 16, 128, False)
    assert parsed["dense"]["text"].strip() == "to be" and parsed["sparq"]["text"].strip() == "or not"
    q8 = DemoResult(prompt_tokens=6000, shape=AttentionShape(64, 9, 3), k1=32, k2=128, n_threads=2, dense=dense,
                    sparq=sparq, index="q8", select="qsigma")
    assert q8.transfer_ratio == pytest.approx(transfer_ratio(6000, 64, 32, 128, mean=False, index="q8"))
    parsed = _parse(report(DemoConfig(), q8), 32, 128)
    assert parsed["settings"] == (32, 128, "q8", "qsigma") and parsed["index"] == "q8"
    assert parsed["ratio"] == pytest.approx(q8.transfer_ratio, abs=0.006)


def test_report_shows_the_rounds_spread_and_warnings():
    dense = RunResult("dense", [1, 2], " a", 250.0, 80.0)
    sparq = RunResult("sparq", [1, 2], " a", 250.0, 160.0)
    quiet = Machine(cores=4, threads_reason="as asked", wait_policy="OMP_WAIT_POLICY=PASSIVE (as set)",
                    load_before=0.2, load_max=2.1)
    res = DemoResult(prompt_tokens=6000, shape=AttentionShape(64, 9, 3), k1=16, k2=128, n_threads=2, dense=dense,
                     sparq=sparq, dense_rates=[80.0, 100.0, 82.0], sparq_rates=[160.0, 150.0, 170.0], machine=quiet)
    assert res.speedup == pytest.approx(160.0 / 82.0)            # the medians' ratio
    assert res.round_speedups == pytest.approx([2.0, 1.5, 170 / 82])
    parsed = _parse(report(DemoConfig(), res), 16, 128)
    assert parsed["dense"]["decode"] == 82.0 and (parsed["dense"]["min"], parsed["dense"]["max"]) == (80.0, 100.0)
    assert parsed["sparq"]["decode"] == 160.0 and (parsed["sparq"]["min"], parsed["sparq"]["max"]) == (150.0, 170.0)
    assert parsed["round_speedups"] == (1.5, 2.07) and parsed["rounds"] == 3
    assert parsed["threads"] == 2 and parsed["wait_policy"] == "OMP_WAIT_POLICY=PASSIVE (as set)"
    # dense spread by 24%, SparQ by 12.5%: both warned; the load was our 2 threads only: no busy warning
    assert len(parsed["warnings"]) == 2 and parsed["warnings"][0].startswith("dense's decode rate spread by 24%")


def test_warnings_say_when_the_machine_is_busy_or_the_rates_spread():
    steady = [100.0, 101.0, 99.0]
    assert spread(steady) == pytest.approx(0.02) and spread([5.0]) == 0.0
    assert measurement_warnings(steady, steady, 0.1, 2.3, 2, 2) == []            # our own 2 threads on 2 cores
    busy = measurement_warnings(steady, steady, 1.9, 2.0, 2, 2)                   # another job on the box
    assert len(busy) == 1 and "the machine was busy" in busy[0]
    assert "busy" in measurement_warnings(steady, steady, 0.0, 3.5, 1, 2)[0]      # load came during the run
    assert measurement_warnings(steady, steady, 1.0, 2.0, 1, 2) == []             # one free core left to it
    wide = [100.0, 100.0 * (1 + SPREAD_WARN) + 1, 100.0]
    assert measurement_warnings(wide, steady, 0, 0, 1, 4)[0].startswith("dense's decode rate spread")
    assert measurement_warnings(steady, wide, 0, 0, 1, 4)[0].startswith("SparQ's decode rate spread")
    assert "one round only" in measurement_warnings([1.0], [2.0], 0, 0, 1, 4)[0]


def test_threads_and_wait_policy():
    assert choose_threads(None, 2, 0.1) == (2, "the cores not busy: 2 cores, load average 0.10 before the run")
    assert choose_threads(None, 2, 1.2)[0] == 1 and choose_threads(None, 2, 4.7)[0] == 1
    assert choose_threads(None, 16, 3.4)[0] == 13 and choose_threads(3, 2, 9.0) == (3, "as asked")
    env = {}
    assert "set by the demo" in wait_policy(env) and env["OMP_WAIT_POLICY"] == "PASSIVE"
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert wait_policy(env) == "OMP_WAIT_POLICY=ACTIVE (as set)" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        DemoConfig(repeats=0).check()


def test_demo_runs_dense_and_sparq_side_by_side(smollm2_path):
    n_prompt, n_gen, k1, k2 = 500, 16, 16, 128  # one ubatch: llama.cpp's perf counters miss its prefill
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # unset: the demo sets it
    res = subprocess.run([shutil.which("sparq-llama"), "demo", "--n-prompt", str(n_prompt), "--n-gen", str(n_gen),
                          "--n-ctx", "2048", "--k1", str(k1), "--k2", str(k2), "--repeats", "2"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"prompt: {n_prompt} tokens of hamlet_gut" in res.stdout
    out = _parse(res.stdout, k1, k2)
    # the wait policy was set before OpenMP started (else the report says it could not be), threads by the load
    assert out["wait_policy"].startswith("OMP_WAIT_POLICY=PASSIVE (set by the demo"), res.stdout
    assert 1 <= out["threads"] <= (os.cpu_count() or 1) and out["threads_reason"].startswith("the cores not busy")
    assert out["rounds"] == 2 and res.stderr.count("decoding 16 tokens") == 4, res.stderr[-2000:]
    lo_r, hi_r = out["round_speedups"]
    assert lo_r <= hi_r
    for key in ("dense", "sparq"):
        assert 0 < out[key]["prefill"] < 1e5 and out[key]["decode"] > 0, res.stdout  # 135M params on a CPU
        assert 1 <= out[key]["generated"] <= n_gen, res.stdout
        assert out[key]["text"].strip(), f"{key} generated no text:\n{res.stdout}"
    # the report prints tokens/s and the speedup to 2 decimals: the printed speedup must lie in the range the
    # printed rates allow (at a loaded machine's < 1 token/s, their rounding alone moves the ratio by > 1%)
    s, d, half = out["sparq"]["decode"], out["dense"]["decode"], 0.005
    lo, hi = (s - half) / (d + half), (s + half) / max(d - half, 1e-9)
    assert lo - half <= out["speedup"] <= hi + half, res.stdout
    for key in ("dense", "sparq"):
        assert out[key]["min"] <= out[key]["decode"] <= out[key]["max"], res.stdout
    # SmolLM2: head_dim 64, GQA (9 q / 3 kv heads) so no mean reallocation; n_kv = the prompt
    assert out["ratio_args"] == (n_prompt, 64, k1, k2, False)
    assert out["ratio"] == pytest.approx(transfer_ratio(n_prompt, 64, k1, k2, mean=False), abs=0.006)
    assert out["ratio"] > 1


def test_demo_rejects_a_prompt_longer_than_the_context():
    res = run([shutil.which("sparq-llama"), "demo", "--n-prompt", "4000", "--n-ctx", "1024"], timeout=120)
    assert res.returncode == 1 and "> n_ctx" in res.stderr


def test_demo_rejects_a_zero_k2():
    res = run([shutil.which("sparq-llama"), "demo", "--k2", "0"], timeout=120)
    assert res.returncode == 1 and "must be >= 1" in res.stderr and "k2=0" in res.stderr, res.stderr


@pytest.mark.parametrize(("flag", "value"), [("--sparq-index", "q2"), ("--sparq-select", "sigma")])
def test_demo_rejects_an_unknown_index_or_select(flag, value):
    res = run([shutil.which("sparq-llama"), "demo", flag, value], timeout=120)
    assert res.returncode == 2 and f"argument {flag}: invalid choice: '{value}'" in res.stderr, res.stderr


def test_demo_config_checks_index_and_select():
    with pytest.raises(ValueError, match="index must be one of f16, q8, q4"):
        DemoConfig(index="q2").check()
    DemoConfig(index="q4", k1=None).check()
    with pytest.raises(ValueError, match="select must be one of q, qsigma"):
        DemoConfig(select="sigma").check()
