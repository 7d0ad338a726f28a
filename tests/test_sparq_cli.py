"""SparQ on the command line: common's flags (llama-completion stands for every common-based tool) and
llama-bench's sweep columns. Decode correctness is in test_sparq_decode.py."""
import json
import re

import pytest
from conftest import run

GEN = ["-p", "The capital of France is", "-n", "8", "--temp", "0", "-no-cnv", "-t", "2", "-c", "512"]


def test_help_lists_the_flags_with_defaults():
    res = run(["llama-completion", "--help"], timeout=60)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    for flag in ["--sparq", "--k1", "--k2", "--sparq-window", "--sparq-sinks", "--sparq-mean", "--sparq-policy",
                 "--sparq-default-layout", "--sparq-prefill", "--sparse-v-thresh", "--sparq-swa", "--sparq-min-kv"]:
        assert re.search(rf"(^|\s|,){re.escape(flag)}(\s|,|=|$)", text, re.MULTILINE), f"{flag} missing from --help"
    assert re.search(r"--k2 N.*\n?.*default: 128", text)


@pytest.mark.parametrize(("args", "message"), [
    (["--k1", "8"], "--k1 has no effect without --sparq"),
    (["--sparq-policy", "exact"], "--sparq-policy has no effect without --sparq"),
    (["--sparq", "--k2", "0"], "must be >= 1"),
    (["--sparq", "--sparq-policy", "foo"], "expected sparq, exact or window"),
    (["--sparq", "--sparq-mean", "sometimes"], "expected auto, on or off"),
    (["--sparq", "--sparse-v-thresh", "1.5"], "[0, 1)"),
    (["--sparq", "--k2", "64", "--sparq-window", "60", "--sparq-sinks", "8"], "must not exceed k2"),
])
def test_bad_flags_fail_before_loading(args, message):
    res = run(["llama-completion", *args, "-m", "/nonexistent.gguf"], timeout=60)
    assert res.returncode != 0
    assert message in res.stderr + res.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--sparq", "-fa", "off"], "flash attention"),
    (["--sparq", "--k1", "65"], "exceeds the model's key head dim"),
])
def test_flags_the_model_cannot_honour_fail(smollm2_path, args, message):
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, *args], timeout=120)
    assert res.returncode != 0
    assert message in res.stderr + res.stdout


def test_flags_reach_the_context_and_generation_runs(smollm2_path):
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "-v", "--sparq", "--k1", "8", "--k2", "64",
               "--sparq-window", "8", "--sparq-sinks", "4", "--sparq-policy", "exact", "--sparq-min-kv", "0",
               "--sparq-default-layout"], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    log = res.stdout + res.stderr
    assert ("SparQ on: k1 = 8, k2 = 64, window = 8, sinks = 4, policy = exact, layout = default (no K^T), "
            "dense below n_kv = 0") in log
    assert "Paris" in res.stdout


def test_default_dense_threshold_is_per_backend(smollm2_path):
    # the measured defaults: 512 cells where the KV is in host memory; on a GPU 24576 for MHA layers and 49152
    # for GQA layers (docs/performance.md)
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "-v", "--sparq"], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "dense below n_kv = 512 (CPU) / 24576 (GPU, MHA) / 49152 (GPU, GQA) (measured defaults)" in res.stdout + res.stderr


def test_llama_bench_sweep_columns(smollm2_path):
    base = ["llama-bench", "-m", str(smollm2_path), "-p", "0", "-n", "4", "-r", "1", "-t", "2",
            "-sparq", "0,1", "-k1", "8", "-k2", "64"]
    res = run([*base, "-o", "json"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    got = [(r["sparq"], r["k1"], r["k2"], r["sparq_window"], r["sparq_policy"], r["sparq_layout"]) for r in rows]
    assert got == [(False, 8, 64, -1, "sparq", "kt"), (True, 8, 64, -1, "sparq", "kt")]
    assert all(r["avg_ts"] > 0 for r in rows)

    md = run(base, timeout=300)
    assert md.returncode == 0, md.stderr[-2000:]
    header = next(line for line in md.stdout.splitlines() if line.startswith("| model"))
    assert [c.strip() for c in header.split("|")][-6:-2] == ["sparq", "k1", "k2", "test"]


def test_llama_bench_rejects_bad_sweep_values(smollm2_path):
    res = run(["llama-bench", "-m", str(smollm2_path), "-sparq", "1", "-k2", "0"], timeout=60)
    assert res.returncode != 0
