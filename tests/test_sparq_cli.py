"""SparQ on the command line: common's flags (llama-completion stands for every common-based tool) and
llama-bench's sweep columns. Decode correctness is in test_sparq_decode.py."""
import csv
import io
import json
import re
import subprocess
import urllib.request

import pytest
from conftest import Server, run
from sparq_llama import sparq as sparq_api

GEN = ["-p", "The capital of France is", "-n", "8", "--temp", "0", "-no-cnv", "-t", "2", "-c", "512"]


def test_help_lists_the_flags_with_defaults():
    res = run(["llama-completion", "--help"], timeout=60)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    for flag in ["--sparq", "--k1", "--k2", "--sparq-window", "--sparq-sinks", "--sparq-mean", "--sparq-policy",
                 "--sparq-default-layout", "--sparq-prefill", "--sparse-v-thresh", "--sparq-swa", "--sparq-min-kv",
                 "--sparq-index", "--sparq-select"]:
        assert re.search(rf"(^|\s|,){re.escape(flag)}(\s|,|=|$)", text, re.MULTILINE), f"{flag} missing from --help"
    assert re.search(r"--k2 N.*\n?.*default: 128", text)
    # the defaults shown are the library's (llama_sparq_default_params)
    lib = sparq_api.c_defaults()
    index = _help_entry(text, "--sparq-index {f16,q8,q4}")
    assert f"(default: {lib.index}; f16 with --sparq-default-layout)" in index, index
    assert f"(default: {lib.select})" in _help_entry(text, "--sparq-select {q,qsigma}")
    assert "0 = by the index: head_dim/4 with f16, head_dim/2 with q8" in _help_entry(text, "--k1 N")


def _help_entry(text: str, head: str) -> str:
    """One option's --help entry (its first line and the indented ones after it), whitespace collapsed."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i][:1].isspace()), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


@pytest.mark.parametrize(("args", "message"), [
    (["--k1", "8"], "--k1 has no effect without --sparq"),
    (["--sparq-policy", "exact"], "--sparq-policy has no effect without --sparq"),
    (["--sparq", "--k2", "0"], "must be >= 1"),
    (["--sparq", "--sparq-policy", "foo"], "expected sparq, exact or window"),
    (["--sparq", "--sparq-mean", "sometimes"], "expected auto, on or off"),
    (["--sparq", "--sparse-v-thresh", "1.5"], "[0, 1)"),
    (["--sparq", "--k2", "64", "--sparq-window", "60", "--sparq-sinks", "8"], "must not exceed k2"),
    (["--sparq-index", "q8"], "--sparq-index has no effect without --sparq"),
    (["--sparq-select", "qsigma"], "--sparq-select has no effect without --sparq"),
    (["--sparq", "--sparq-index", "q2"], "\"--sparq-index\": unknown value 'q2', expected f16, q8 or q4"),
    (["--sparq", "--sparq-index", "F16"], "\"--sparq-index\": unknown value 'F16', expected f16, q8 or q4"),
    (["--sparq", "--sparq-index", "q4", "--k1", "8"], "the q4 index scores every key component: k1 must be 0"),
    (["--sparq", "--sparq-default-layout", "--sparq-index", "q4"], "which default_layout does not keep"),
    (["--sparq", "--sparq-select", "sigma"], "\"--sparq-select\": unknown value 'sigma', expected q or qsigma"),
    (["--sparq", "--sparq-default-layout", "--sparq-index", "q8"], "which default_layout does not keep"),
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
            "index = f16, select = qsigma, dense below n_kv = 0") in log
    assert "Paris" in res.stdout


@pytest.mark.parametrize("tool", ["llama-completion", "llama-cli"])
def test_index_and_select_reach_the_context(smollm2_path, tool):
    # the settings only: the prompt stays below the default min_n_kv, so every step decodes densely
    args = ["-m", str(smollm2_path), "-t", "2", "-c", "512", "-v", "--sparq", "--sparq-index", "q8",
            "--sparq-select", "qsigma"]
    if tool == "llama-cli":
        res = run([tool, *args, "-p", "Hi", "-n", "2", "-st"], timeout=120, stdin=subprocess.DEVNULL)
    else:
        res = run([tool, *args, "-p", "The capital of France is", "-n", "2", "--temp", "0", "-no-cnv"], timeout=120)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-2000:]
    assert "SparQ on: k1 = 0 (head_dim/2), k2 = 128" in log and "index = q8, select = qsigma" in log, log[-2000:]


def test_default_layout_without_an_index_takes_f16(smollm2_path):
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "-v", "--sparq", "--sparq-default-layout",
               "--sparq-select", "qsigma"], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "layout = default (no K^T), index = f16, select = qsigma" in res.stdout + res.stderr


def test_default_dense_threshold_is_per_backend(smollm2_path):
    # the measured defaults: 512 cells where the KV is in host memory; on a GPU 12k for MHA and 48k for GQA layers
    # (the end-to-end crossovers of docs/performance.md)
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "-v", "--sparq"], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "dense below n_kv = 512 (CPU) / 12288 (GPU, MHA) / 49152 (GPU, GQA) (measured defaults)" in res.stdout + res.stderr


def test_llama_bench_sweep_columns(smollm2_path):
    base = ["llama-bench", "-m", str(smollm2_path), "-p", "0", "-n", "4", "-r", "1", "-t", "2",
            "-sparq", "0,1", "-k1", "8", "-k2", "64"]
    res = run([*base, "-o", "json"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    got = [(r["sparq"], r["k1"], r["k2"], r["sparq_window"], r["sparq_policy"], r["sparq_layout"]) for r in rows]
    # the dense test has no SparQ values: null in JSON, empty in the table and the CSV
    assert got == [(False, None, None, None, "", ""), (True, 8, 64, -1, "sparq", "kt")]
    assert all(r["avg_ts"] > 0 for r in rows)

    md = run(base, timeout=300)
    assert md.returncode == 0, md.stderr[-2000:]
    lines = md.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model"))
    assert [c.strip() for c in lines[header].split("|")][-6:-2] == ["sparq", "k1", "k2", "test"]
    body = [[c.strip() for c in line.split("|")] for line in lines[header + 2:] if line.startswith("|")]
    assert [row[-6:-3] for row in body] == [["0", "", ""], ["1", "8", "64"]]

    csv_out = run([*base, "-o", "csv"], timeout=300)
    assert csv_out.returncode == 0, csv_out.stderr[-2000:]
    table = list(csv.DictReader(io.StringIO(csv_out.stdout)))
    assert [(r["sparq"], r["k1"], r["k2"], r["sparq_window"]) for r in table] == [("0", "", "", ""), ("1", "8", "64", "-1")]


def test_llama_bench_rejects_bad_sweep_values(smollm2_path):
    res = run(["llama-bench", "-m", str(smollm2_path), "-sparq", "1", "-k2", "0"], timeout=60)
    assert res.returncode != 0


def test_llama_bench_index_and_select_columns(smollm2_path):
    # the settings only: -n 2 after no prompt stays below the default min_n_kv (dense decodes)
    base = ["llama-bench", "-m", str(smollm2_path), "-p", "0", "-n", "2", "-r", "1", "-t", "2", "-sparq", "1",
            "-k1", "16", "-sparq-index", "f16,q8", "-sparq-select", "q"]  # not the default: shown
    res = run([*base, "-o", "json"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    got = [(r["k1"], r["sparq_index"], r["sparq_select"]) for r in rows]
    assert got == [(16, "f16", "q"), (16, "q8", "q")]
    md = run(base, timeout=300)
    assert md.returncode == 0, md.stderr[-2000:]
    lines = md.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model"))
    names = [c.strip() for c in lines[header].split("|")]
    assert names[-8:-3] == ["sparq", "k1", "k2", "index", "select"]  # then test, t/s
    body = [[c.strip() for c in line.split("|")] for line in lines[header + 2:] if line.startswith("|")]
    assert [row[-5:-3] for row in body] == [["f16", "q"], ["q8", "q"]]


def test_llama_bench_default_layout_takes_the_f16_index(smollm2_path):
    base = ["llama-bench", "-m", str(smollm2_path), "-p", "0", "-n", "2", "-r", "1", "-t", "2", "-sparq", "1"]
    res = run([*base, "-sparq-layout", "kt,default", "-o", "json"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    default = sparq_api.c_defaults().index
    assert [(r["sparq_layout"], r["sparq_index"], r["sparq_select"]) for r in json.loads(res.stdout)] == [
        ("kt", default, sparq_api.c_defaults().select), ("default", "f16", sparq_api.c_defaults().select)]
    res = run([*base, "-sparq-layout", "default", "-sparq-index", "q8"], timeout=120)
    assert res.returncode != 0 and "which default_layout does not keep" in res.stderr


@pytest.mark.parametrize(("flag", "value"), [("-sparq-index", "q2"), ("-sparq-select", "sigma")])
def test_llama_bench_rejects_bad_index_and_select(smollm2_path, flag, value):
    res = run(["llama-bench", "-m", str(smollm2_path), "-sparq", "1", flag, value], timeout=60)
    assert res.returncode != 0
    assert f"error: {flag}: unknown value '{value}'" in res.stderr
    assert f"invalid parameter for argument: {flag}" in res.stderr
    help_text = run(["llama-bench", "--help"], timeout=60).stdout
    assert flag in help_text


@pytest.mark.parametrize(("index", "select"), [("q8", "qsigma"), ("q4", "qsigma"), ("f16", "q")])
def test_batched_bench_reports_index_and_select(smollm2_path, index, select):
    args = ["llama-batched-bench", "-m", str(smollm2_path), "-c", "256", "-t", "2", "-npp", "8", "-ntg", "2",
            "-npl", "1", "--sparq", "--sparq-index", index, "--sparq-select", select]
    res = run(args, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"sparq = 1, k1 = 0, k2 = 128, sparq_index = {index}, sparq_select = {select}" in res.stdout + res.stderr
    res = run([*args, "--output-format", "jsonl"], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    row = json.loads(next(line for line in (res.stdout + res.stderr).splitlines() if line.startswith("{")))
    got = (row["sparq"], row["k1"], row["k2"], row["sparq_index"], row["sparq_select"])
    assert got == (True, 0, 128, index, select)


# ---- what runs, at the tools' default verbosity -----------------------------------------------------------------

ON_DEFAULTS = "SparQ: on, k1 = 32 (head_dim/2), k2 = 128, index = q8, select = qsigma"  # SmolLM2: head_dim 64
HOST_DEFAULT = "dense below 512 cached cells (the measured default with the KV in host memory"


def _summaries(text: str) -> list[str]:
    """The lines that say what a context runs (llama_sparq_summary's line, wherever a tool prints it)."""
    return [line for line in text.splitlines() if "SparQ: on" in line or "SparQ: off" in line]


@pytest.mark.parametrize(("args", "expected"), [
    (["--sparq"], [ON_DEFAULTS, "runs in 30 of 30 layers;", HOST_DEFAULT]),
    (["--sparq", "-ctk", "q8_0", "-ctv", "q8_0"], [ON_DEFAULTS, "runs in 30 of 30 layers;", HOST_DEFAULT]),
    (["--sparq", "-ctk", "iq4_nl"], ["runs in 0 of 30 layers, 30 dense: 30 K cache type iq4_nl (the op reads"]),
    (["--sparq", "--k1", "8", "--k2", "64", "--sparq-index", "f16", "--sparq-select", "q", "--sparq-min-kv", "100"],
     ["SparQ: on, k1 = 8, k2 = 64, index = f16, select = q; runs in 30 of 30 layers; dense below 100 cached cells"]),
    ([], ["SparQ: off (dense attention in every layer)"]),
])
def test_default_verbosity_says_what_runs(smollm2_path, args, expected):
    # no -v: the line is logged at the tools' default verbosity, once per context
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, *args], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = _summaries(res.stdout + res.stderr)
    assert len(lines) == 1, lines
    for part in expected:
        assert part in lines[0], lines[0]


def test_default_verbosity_names_the_sliding_window_layers(gemma3_path):
    # Gemma-3-270M: 18 layers, 15 of them sliding-window
    res = run(["llama-completion", "-m", str(gemma3_path), *GEN, "--sparq"], timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = _summaries(res.stdout + res.stderr)
    assert len(lines) == 1 and "runs in 3 of 18 layers, 15 dense: 15 sliding-window layer" in lines[0], lines
    res = run(["llama-completion", "-m", str(gemma3_path), *GEN, "--sparq", "--sparq-swa"], timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "runs in 18 of 18 layers;" in " ".join(_summaries(res.stdout + res.stderr))


def test_llama_cli_banner_says_what_runs(smollm2_path):
    # llama-cli logs only errors by default: its banner carries the line
    res = run(["llama-cli", "-m", str(smollm2_path), "-t", "2", "-c", "512", "--sparq", "-ctk", "q8_0", "-ctv", "q8_0",
               "-p", "Hi", "-n", "2", "-st"], timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, (res.stdout + res.stderr)[-2000:]
    banner = [line for line in res.stdout.splitlines() if line.startswith("attention  : ")]
    assert len(banner) == 1 and ON_DEFAULTS in banner[0] and "runs in 30 of 30 layers" in banner[0], res.stdout[-2000:]


def test_llama_server_logs_what_runs(smollm2_path, tmp_path):
    srv = Server(["llama-server", "-m", str(smollm2_path), "-c", "1024", "-t", "2", "--no-warmup", "--sparq"],
                 tmp_path / "server.log")
    try:
        lines = _summaries(srv.log())
    finally:
        srv.close()
    assert len(lines) == 1 and ON_DEFAULTS in lines[0] and HOST_DEFAULT in lines[0], lines


@pytest.mark.parametrize("sparq", [True, False])
def test_llama_server_props_say_what_runs(smollm2_path, tmp_path, sparq):
    args = ["--sparq", "--k2", "64", "--sparq-index", "f16", "--sparq-min-kv", "0"] if sparq else []
    srv = Server(["llama-server", "-m", str(smollm2_path), "-c", "1024", "-t", "2", "--no-warmup", *args],
                 tmp_path / "server.log")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/props", timeout=30) as r:
            props = json.loads(r.read())
        lines = _summaries(srv.log())
    finally:
        srv.close()
    sp = props["sparq"]
    assert len(lines) == 1 and lines[0].endswith(sp["summary"]) and sp["summary"].startswith("SparQ: "), (sp, lines)
    if sparq:
        assert (sp["enabled"], sp["k1"], sp["k2"], sp["index"], sp["select"], sp["min_n_kv"]) == \
            (True, 0, 64, "f16", "qsigma", 0), sp
        assert "runs in 30 of 30 layers" in sp["summary"], sp
    else:
        assert sp["enabled"] is False and sp["summary"].startswith("SparQ: off"), sp
    assert props["squeeze"]["enabled"] is False and props["squeeze"]["keep"] == pytest.approx(0.1)


def _completion_timings(srv: Server, prompt: str, n_predict: int, stream: bool) -> dict:
    """The timings object of one /completion (the final event's when streaming); the prompt is never taken from
    the slot's cache, so its evaluation is a prompt batch, and the first token comes from it."""
    body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0, "cache_prompt": False,
            "stream": stream}
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            return json.loads(r.read())["timings"]
        events = [json.loads(line[len(b"data: "):]) for line in r.read().splitlines() if line.startswith(b"data: ")]
    assert events and events[-1]["stop"] is True, events[-1:]
    assert all("timings" not in e for e in events[:-1])  # timings come with the last event only
    return events[-1]["timings"]


# SparQ decodes a ubatch of one token per sequence once the cache view holds --sparq-min-kv cells (a view of at least
# 256 here); the prompt's evaluation, which gives the first token, runs it only with --sparq-prefill. SmolLM2 has 30
# attention layers.
@pytest.mark.parametrize(("args", "want"), [
    ([], lambda n: (0, 0)),                                                     # dense
    (["--sparq"], lambda n: (0, 0)),                                            # a short chat: under 512 cells
    (["--sparq", "--sparq-min-kv", "0"], lambda n: (n - 1, 30)),                # every decode step
    (["--sparq", "--sparq-min-kv", "0", "--sparq-prefill"], lambda n: (n, 30)),  # the prompt's first token too
])
def test_llama_server_timings_say_whether_sparq_ran(smollm2_path, tmp_path, args, want):
    srv = Server(["llama-server", "-m", str(smollm2_path), "-c", "1024", "-t", "2", "--no-warmup", *args],
                 tmp_path / "server.log")
    try:
        prompt = "The capital of France is Paris. The capital of Italy is"
        n_prompt = len(srv.post("/tokenize", {"content": prompt, "add_special": True})[1]["tokens"])
        out = [_completion_timings(srv, prompt, 16, stream) for stream in (False, True, False)]
    finally:
        srv.close()
    for t in out:
        assert t["predicted_n"] == 16 and t["prompt_n"] == n_prompt, t
        assert (t["sparq_tokens"], t["sparq_layers"]) == want(16), t


# Speculative decoding (the model as its own draft: every draft is accepted): the target checks each draft in one
# multi-token ubatch, which runs SparQ only with --sparq-prefill; the timings say so either way.
@pytest.mark.parametrize(("args", "want"), [
    ([], (0, 0)),
    (["--sparq-prefill"], (16, 30)),
])
def test_llama_server_timings_with_speculative_decoding(smollm2_path, tmp_path, args, want):
    srv = Server(["llama-server", "-m", str(smollm2_path), "-md", str(smollm2_path), "--spec-type", "draft-simple",
                  "-c", "1024", "-t", "2", "--no-warmup", "--sparq", "--sparq-min-kv", "0", *args],
                 tmp_path / "server.log")
    try:
        t = _completion_timings(srv, "The capital of France is Paris. The capital of Italy is", 16, False)
    finally:
        srv.close()
    assert t["predicted_n"] == 16 and t["draft_n"] > 0 and t["draft_n_accepted"] == t["draft_n"], t
    assert (t["sparq_tokens"], t["sparq_layers"]) == want, t


def test_min_kv_help_states_the_measured_defaults():
    res = run(["llama-completion", "--help"], timeout=60)
    entry = _help_entry(res.stdout, "--sparq-min-kv N")
    assert ("default: -1 = measured per layer: 512 with the KV in host memory; on a GPU 12288 for MHA layers, "
            "49152 for GQA layers") in entry, entry
    bench = " ".join(run(["llama-bench", "--help"], timeout=60).stdout.split())
    assert "512 with the KV in host memory; on a GPU 12288 for MHA layers, 49152 for GQA layers" in bench


# ---- number parse errors name the flag ---------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--k1", "--k2", "--sparq-window", "--sparq-sinks", "--sparq-min-kv"])
@pytest.mark.parametrize(("value", "message"), [
    ("abc", "expected an integer, got 'abc'"),
    ("12abc", "expected an integer, got '12abc'"),
    ("99999999999", "'99999999999' is out of range for an integer"),
])
def test_integer_flags_name_themselves_on_a_bad_number(flag, value, message):
    res = run(["llama-completion", "--sparq", flag, value, "-m", "/nonexistent.gguf"], timeout=60)
    assert res.returncode != 0
    assert f'error while handling argument "{flag}": {message}' in res.stderr + res.stdout


def test_negative_k1_is_refused_with_what_0_means():
    res = run(["llama-completion", "--sparq", "--k1", "-3", "-m", "/nonexistent.gguf"], timeout=60)
    assert res.returncode != 0
    assert ('"--k1": must be >= 0 (0 = by the index: head_dim/4 with f16, head_dim/2 with q8, every component with '
            'q4)') in res.stderr + res.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--sparq", "--sparse-v-thresh", "x"], '"--sparse-v-thresh": expected a number, got \'x\''),
    (["--squeeze", "--squeeze-levels", "two"], '"--squeeze-levels": expected an integer, got \'two\''),
])
def test_other_number_flags_name_themselves(args, message):
    res = run(["llama-completion", *args, "-m", "/nonexistent.gguf"], timeout=60)
    assert res.returncode != 0
    assert message in res.stderr + res.stdout


@pytest.mark.parametrize("flag", ["-k1", "-k2", "-sparq-window", "-sparq-min-kv"])
def test_llama_bench_names_the_flag_of_a_bad_number(smollm2_path, flag):
    res = run(["llama-bench", "-m", str(smollm2_path), "-sparq", "1", flag, "abc"], timeout=60)
    assert res.returncode != 0
    assert f"invalid parameter for argument: {flag}" in res.stderr


# ---- llama-bench: SparQ values need -sparq 1; an invalid test is skipped, the sweep goes on -----------------------

@pytest.mark.parametrize("args", [
    ["-k1", "16"], ["-k2", "64"], ["-sparq-window", "8"], ["-sparq-policy", "exact"], ["-sparq-layout", "default"],
    ["-sparq-min-kv", "0"], ["-sparq-index", "f16"], ["-sparq-select", "q"], ["-sparq", "0", "-k1", "16"],
])
def test_llama_bench_refuses_sparq_values_without_sparq(smollm2_path, args):
    res = run(["llama-bench", "-m", str(smollm2_path), "-p", "0", "-n", "2", "-r", "1", *args], timeout=60)
    assert res.returncode != 0
    flag = next(a for a in args if a != "-sparq" and a.startswith("-"))
    assert f"error: {flag} has no effect without -sparq 1" in res.stderr
    assert "| model" not in res.stdout  # refused before any test


def test_llama_bench_skips_an_invalid_test_and_runs_the_others(smollm2_path):
    base = ["llama-bench", "-m", str(smollm2_path), "-p", "0", "-n", "2", "-r", "1", "-t", "2", "-o", "json"]
    # window 8 > k2 4: invalid before loading; k1 65 > head_dim 64: refused by the model's context
    res = run([*base, "-sparq", "0,1", "-k1", "8,65", "-k2", "64,4", "-sparq-window", "8"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    assert [(r["sparq"], r["k1"], r["k2"]) for r in rows] == [(False, None, None), (True, 8, 64)]
    skipped = [line for line in res.stderr.splitlines() if line.startswith("llama-bench: skipping the test with")]
    assert len(skipped) == 3, res.stderr[-3000:]
    assert sum("window (8) + sinks (0) must not exceed k2 (4)" in line for line in skipped) == 2
    assert any("-k1 65 -k2 64" in line and "k1 (65) exceeds the model's key head dim (64" in line for line in skipped)


def test_llama_bench_fails_when_every_test_is_skipped(smollm2_path):
    base = ["llama-bench", "-m", str(smollm2_path), "-p", "0", "-n", "2", "-r", "1", "-t", "2", "-sparq", "1"]
    res = run([*base, "-k2", "4", "-sparq-window", "8"], timeout=120)
    assert res.returncode != 0 and "every test was skipped" in res.stderr, res.stderr[-2000:]
    res = run([*base, "-k1", "65"], timeout=120)
    assert res.returncode != 0 and "every test was skipped" in res.stderr, res.stderr[-2000:]
