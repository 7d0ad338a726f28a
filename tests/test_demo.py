"""The main job (`sparq-llama demo`): dense and SparQ decoding side by side on the real model."""
import re
import shutil

import pytest
from conftest import run
from sparq_llama.demo import AttentionShape, DemoConfig, DemoResult, RunResult, report
from sparq_llama.reference import transfer_ratio

ROW = r"^{name}\s+([\d.]+)\s+([\d.]+)\s+(\d+)$"


def _parse(stdout: str, k1: int, k2: int) -> dict:
    """The numbers and texts of a demo report (AssertionError naming what is missing)."""
    out = {}
    for key, name in (("dense", "dense"), ("sparq", re.escape(f"SparQ (k1={k1}, k2={k2})"))):
        m = re.search(ROW.format(name=name), stdout, re.MULTILINE)
        assert m, f"no {key} row in:\n{stdout}"
        out[key] = {"prefill": float(m.group(1)), "decode": float(m.group(2)), "generated": int(m.group(3))}
        text = re.search(rf"^--- {name} continuation ---\n(.*?)(?=\n\n--- |\Z)", stdout, re.MULTILINE | re.DOTALL)
        assert text, f"no {key} continuation in:\n{stdout}"
        out[key]["text"] = text.group(1)
    m = re.search(r"^decode speedup \(SparQ / dense\): ([\d.]+)x$", stdout, re.MULTILINE)
    assert m, stdout
    out["speedup"] = float(m.group(1))
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


def test_demo_runs_dense_and_sparq_side_by_side(smollm2_path):
    n_prompt, n_gen, k1, k2 = 1500, 16, 16, 128
    res = run([shutil.which("sparq-llama"), "demo", "--n-prompt", str(n_prompt), "--n-gen", str(n_gen),
               "--n-ctx", "2048", "--k1", str(k1), "--k2", str(k2)], timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"prompt: {n_prompt} tokens of hamlet_gut" in res.stdout
    out = _parse(res.stdout, k1, k2)
    for key in ("dense", "sparq"):
        assert out[key]["prefill"] > 0 and out[key]["decode"] > 0, res.stdout
        assert 1 <= out[key]["generated"] <= n_gen, res.stdout
        assert out[key]["text"].strip(), f"{key} generated no text:\n{res.stdout}"
    # the report prints tokens/s and the speedup to 2 decimals: the printed speedup must lie in the range the
    # printed rates allow (at a loaded machine's < 1 token/s, their rounding alone moves the ratio by > 1%)
    s, d, half = out["sparq"]["decode"], out["dense"]["decode"], 0.005
    lo, hi = (s - half) / (d + half), (s + half) / max(d - half, 1e-9)
    assert lo - half <= out["speedup"] <= hi + half, res.stdout
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


@pytest.mark.parametrize(("flag", "value"), [("--sparq-index", "q4"), ("--sparq-select", "sigma")])
def test_demo_rejects_an_unknown_index_or_select(flag, value):
    res = run([shutil.which("sparq-llama"), "demo", flag, value], timeout=120)
    assert res.returncode == 2 and f"argument {flag}: invalid choice: '{value}'" in res.stderr, res.stderr


def test_demo_config_checks_index_and_select():
    with pytest.raises(ValueError, match="index must be one of f16, q8"):
        DemoConfig(index="q4").check()
    with pytest.raises(ValueError, match="select must be one of q, qsigma"):
        DemoConfig(select="sigma").check()
