"""Centroid-sparse attention on the command line (llama-completion --squeeze ...): a document is evaluated and
prepared once, the prompt follows it without evaluating it again, a saved prefix loads and answers the same, keep 1
answers as dense attention over the same tokens does, and bad flags fail clearly."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run
from sparq_llama import Llama

QUESTION = "\nQuestion: What is the secret number of Alice?\nAnswer: The secret number of Alice is"
GEN = ["-no-cnv", "--temp", "0", "-n", "8", "-t", "2", "-c", "2048"]


def answer(stdout: str) -> str:
    """The generated text: what follows the question (llama-completion echoes the prompt, the prefix included)."""
    assert QUESTION.strip() in stdout, stdout[-2000:]
    return stdout.split("Answer: The secret number of Alice is", 1)[1]


def completion(model, *args: str) -> tuple[str, str]:
    res = run(["llama-completion", "-m", str(model), *GEN, "-p", QUESTION, *args], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return answer(res.stdout), res.stderr


def test_help_lists_the_flags():
    res = run(["llama-completion", "--help"], timeout=60)
    assert res.returncode == 0, res.stderr
    for flag in ["--squeeze", "--squeeze-prefix-file", "--squeeze-centroids", "--squeeze-keep", "--squeeze-levels",
                 "--squeeze-save", "--squeeze-load", "--squeeze-prefill", "--squeeze-var", "--squeeze-init"]:
        assert re.search(rf"(^|\s|,){re.escape(flag)}(\s|,|=|$)", res.stdout, re.MULTILINE), f"{flag} missing"


@pytest.mark.parametrize(("args", "message"), [
    (["--squeeze-keep", "0.2"], "--squeeze-keep has no effect without --squeeze"),
    (["--squeeze"], "--squeeze needs one of --squeeze-prefix-file"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--squeeze-load", "b.state"], "--squeeze needs one of"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--squeeze-keep", "1.5"], "must be a number in (0, 1]"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--squeeze-centroids", "x"], "must be a number in (0, 1]"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--squeeze-levels", "3"], "must be 1 or 2"),
    (["--squeeze", "--squeeze-load", "b.state", "--squeeze-centroids", "0.2"], "--squeeze-centroids applies when preparing"),
    (["--squeeze", "--squeeze-load", "b.state", "--squeeze-keep", "0"], "must be a number in (0, 1]"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--prompt-cache", "c.bin"], "cannot be combined with --prompt-cache"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--squeeze-prefill", "fast"], "must be auto, sparse or dense"),
    (["--squeeze-prefill", "dense"], "--squeeze-prefill has no effect without --squeeze"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--squeeze-var", "-1"], "must be a number in [0, 100]"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--squeeze-var", "0.5x"], "must be a number in [0, 100]"),
    (["--squeeze-var", "0"], "--squeeze-var has no effect without --squeeze"),
    (["--squeeze", "--squeeze-load", "b.state", "--squeeze-var", "0"], "--squeeze-var applies when preparing"),
    (["--squeeze", "--squeeze-prefix-file", "a.txt", "--squeeze-init", "random"], "must be even or kpp"),
    (["--squeeze-init", "kpp"], "--squeeze-init has no effect without --squeeze"),
    (["--squeeze", "--squeeze-load", "b.state", "--squeeze-init", "kpp"], "--squeeze-init applies when preparing"),
])
def test_bad_flags_fail_before_loading(args, message):
    res = run(["llama-completion", *args, "-m", "/nonexistent.gguf"], timeout=60)
    assert res.returncode != 0
    assert message in res.stderr + res.stdout



def test_squeeze_chat_is_for_the_chat_tools():
    res = run(["llama-completion", "--squeeze-chat", "-m", "/nonexistent.gguf"], timeout=60)
    assert res.returncode != 0
    assert "--squeeze-chat: llama-server and llama-cli take it" in res.stderr + res.stdout


@pytest.mark.parametrize("tool", ["llama-perplexity", "llama-batched-bench"])
@pytest.mark.parametrize("flag", ["--squeeze", "--squeeze-load"])
def test_tools_without_squeeze_say_where_it_runs(tool, flag):
    # llama-completion, llama-server and llama-cli prepare a fixed prefix; the others must not take the flag as if it
    # were unknown
    res = run([tool, flag, "x", "-m", "/nonexistent.gguf"], timeout=60)
    assert res.returncode != 0
    out = res.stderr + res.stdout
    assert f"{flag}: centroid-sparse attention over a fixed prefix runs in llama-completion, llama-server and llama-cli" in out, out[-2000:]

def test_keep_1_answers_as_dense_over_the_same_tokens(smollm2_path, document):
    got, log = completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", "1")
    # the prompt follows the prepared prefix: only the question is evaluated after it
    n_prefix = int(re.search(r"session file matches (\d+) / (\d+) tokens", log).group(1))
    assert "prepared the fixed prefix" in log and "dropped" not in log
    llm = Llama(str(smollm2_path), n_ctx=2048, flash_attn=True, n_threads=2, n_threads_batch=2, verbose=False)
    try:
        doc = Path(document).read_text()
        tokens = llm.tokenize(doc.encode(), add_bos=True, special=True)
        assert len(tokens) == n_prefix
        tokens += llm.tokenize(QUESTION.encode(), add_bos=False, special=True)
        out = llm.create_completion(tokens, max_tokens=8, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()
    assert got.startswith(out), (got, out)
    assert "48213" in got


def test_saved_prefix_loads_and_answers_the_same(smollm2_path, document, tmp_path):
    state = str(tmp_path / "doc.state")
    prepared, log = completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", "0.3",
                               "--squeeze-save", state)
    assert "saved the prepared prefix" in log
    loaded, log = completion(smollm2_path, "--squeeze", "--squeeze-load", state)
    assert "loaded a prepared prefix" in log and "evaluating the fixed prefix" not in log and "dropped" not in log
    assert loaded == prepared
    # the Python API reads what the CLI saved (one format): same prefix, same settings
    llm = Llama(str(smollm2_path), n_ctx=2048, flash_attn=True, n_threads=2, verbose=False, fixed_context=state)
    try:
        info = llm.fixed_context
        n_prefix = int(re.search(r"loaded a prepared prefix of (\d+) tokens", log).group(1))
        assert info.prepared and info.n_prefix == n_prefix and info.keep == pytest.approx(0.3)
        assert info.var_weight == 1.0  # the default kept rule, saved
    finally:
        llm.close()


def test_squeeze_var_sets_the_kept_rule(smollm2_path, document, tmp_path):
    state = str(tmp_path / "mean.state")
    got, _ = completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", "0.3",
                        "--squeeze-var", "0", "--squeeze-save", state)
    llm = Llama(str(smollm2_path), n_ctx=2048, flash_attn=True, n_threads=2, verbose=False, fixed_context=state)
    try:
        assert llm.fixed_context.var_weight == 0.0
    finally:
        llm.close()
    assert got  # the semantics of the rule are tested in Python (test_squeeze_decode.py)


def test_loaded_prefix_recalibrated_answers_as_prepared_at_that_keep(smollm2_path, document, tmp_path):
    state = str(tmp_path / "doc.state")
    prepared_at_03, _ = completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", "0.3",
                                   "--squeeze-save", state)
    at_1, log = completion(smollm2_path, "--squeeze", "--squeeze-load", state, "--squeeze-keep", "1")
    assert "set to keep 1 (each row reads its best clusters up to that share of the clustered cells)" in log
    prepared_at_1, _ = completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", "1")
    assert at_1 == prepared_at_1 and "48213" in at_1
    # and back: a preparation at 0.3, as the saved one is
    at_03, log = completion(smollm2_path, "--squeeze", "--squeeze-load", state, "--squeeze-keep", "0.3")
    assert "set to keep 0.3 (" in log and at_03 == prepared_at_03


def test_missing_or_mismatched_files_fail(smollm2_path, document, tmp_path):
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "-p", QUESTION, "--squeeze",
               "--squeeze-load", str(tmp_path / "none.state")], timeout=120)
    assert res.returncode != 0 and "failed to load the prepared prefix: cannot open" in res.stderr
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "-p", QUESTION, "--squeeze",
               "--squeeze-prefix-file", str(tmp_path / "none.txt")], timeout=120)
    assert res.returncode != 0 and "cannot read --squeeze-prefix-file" in res.stderr
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN[:-1], "256", "-p", QUESTION, "--squeeze",
               "--squeeze-prefix-file", document], timeout=120)
    assert res.returncode != 0 and "must leave room for the prompt" in res.stderr


def test_with_sparq_the_prepared_prefix_decides(smollm2_path, document):
    # --sparq and --squeeze together: the prepared prefix takes precedence in its layers, so the answer is the one
    # --squeeze gives alone (and SparQ is on: its settings line is logged)
    alone, _ = completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", "0.3")
    both, log = completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", "0.3",
                           "-v", "--sparq", "--k2", "64", "--sparq-min-kv", "0")
    assert "SparQ on: k1 = 0 (head_dim/2), k2 = 64" in log and "dropped" not in log
    assert both == alone


def test_squeeze_prefill_applies_to_a_loaded_prefix(smollm2_path, document, tmp_path):
    # --squeeze-prefill is accepted with a loaded prefix (a runtime choice, not saved) and the answer is right; what
    # each mode computes is tested through the Python API (test_squeeze_decode.py)
    state = str(tmp_path / "doc.state")
    completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", "1", "--squeeze-save", state)
    got, log = completion(smollm2_path, "--squeeze", "--squeeze-load", state, "--squeeze-prefill", "dense")
    assert "loaded a prepared prefix" in log and "dropped" not in log
    assert "48213" in got


def _progress(log: str, what: str) -> list[tuple[int, str]]:
    """(percent, the rest of the line) of each 'what the fixed prefix: N%...' progress line, in order."""
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(rf"{what} the fixed prefix: (\d+)%(.*)", log)]


def test_preparing_logs_progress_over_both_phases(smollm2_path, document):
    # batches of 128 tokens: the ~1k-token document's evaluation passes each quarter in its own batch
    _, log = completion(smollm2_path, "--squeeze", "--squeeze-prefix-file", document, "-b", "128", "-ub", "128")
    n = int(re.search(r"evaluating the fixed prefix \((\d+) tokens\)", log).group(1))
    evaluating = _progress(log, "evaluating")
    assert [p for p, _ in evaluating] == [25, 50, 75, 100], log[-3000:]
    done = [int(re.match(r" \((\d+) of (\d+) tokens\), [\d.]+ s", rest).group(1)) for _, rest in evaluating]
    assert done == sorted(done) and done[-1] == n and done[0] >= n / 4, evaluating
    # the clustering's last quarter is the line that says it is prepared
    assert [p for p, _ in _progress(log, "clustering")] == [25, 50, 75], log[-3000:]
    assert log.index("evaluating the fixed prefix: 100%") < log.index("clustering the fixed prefix: 25%") \
        < log.index("prepared the fixed prefix in")
