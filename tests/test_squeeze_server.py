"""Centroid-sparse attention in llama-server and llama-cli (--squeeze ...): the fixed prefix is prepared once at start
in slot 0, a completion whose prompt starts with it evaluates only what follows and answers as the Python API does over
the same prepared prefix, other prompts run in the other slots without touching it, a single slot refuses them with a
clear error, other slots share the prefix (its cells with one cache stream, a copy of its stream with one per slot), a
dropped prefix is prepared again, a saved prefix loads, --squeeze-chat prepares the chat rendering of a system message,
and llama-cli (which runs the server in-process) answers through it."""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import Server, free_port, run
from sparq_llama import Llama

QUESTION = "\nQuestion: What is the secret number of Alice?\nAnswer: The secret number of Alice is"
# on this document SmolLM2 answers OPEN at keep 0.1 otherwise than over every key ("...written in Latin" against "...a
# dialogue between two characters"), so the answer shows which attention ran
OPEN = "\nQuestion: Who speaks first in this text, and what do they say?\nAnswer:"
KEEP = "0.1"
N_PREDICT = 16


_SERVER_LOGS = itertools.count()


class SqueezeServer(Server):
    """llama-server on SmolLM2 (4096 cells, 2 threads), with `args`; its log in `tmp`."""

    def __init__(self, model: Path, tmp: Path, *args: str):
        super().__init__(["llama-server", "-m", str(model), "-c", "4096", "-t", "2", "--no-warmup", *args],
                         tmp / f"server-{next(_SERVER_LOGS)}.log")

    def complete(self, prompt, **kw) -> dict:
        status, out = self.post("/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, **kw})
        assert status == 200, out
        return out


@pytest.fixture(scope="module")
def tokens(smollm2_path, document) -> tuple[list[int], list[int], list[int]]:
    """The prefix's tokens (as --squeeze-prefix-file tokenizes it) and the two questions'."""
    llm = Llama(str(smollm2_path), n_ctx=512, vocab_only=True, verbose=False)
    try:
        prefix = llm.tokenize(Path(document).read_text().encode(), add_bos=True, special=True)
        question = llm.tokenize(QUESTION.encode(), add_bos=False, special=True)
        open_question = llm.tokenize(OPEN.encode(), add_bos=False, special=True)
    finally:
        llm.close()
    return prefix, question, open_question


@pytest.fixture(scope="module")
def server(smollm2_path, document, tmp_path_factory):
    srv = SqueezeServer(smollm2_path, tmp_path_factory.mktemp("srv"), "-np", "2", "--squeeze", "--squeeze-prefix-file",
                 document, "--squeeze-keep", KEEP)
    yield srv
    srv.close()


def python_answers(model, prefix: list[int], questions: list[list[int]], keep: float) -> list[str]:
    """The oracle: the Python API over the same prepared prefix (same tokens, keep and ubatches)."""
    llm = Llama(str(model), n_ctx=4096, flash_attn=True, n_threads=2, n_threads_batch=2, verbose=False)
    try:
        llm.prepare_fixed_context(prefix, keep=keep, progress=False)
        out = [llm.create_completion(prefix + q, max_tokens=N_PREDICT, temperature=0.0)["choices"][0]["text"]
               for q in questions]
        assert llm.fixed_context.prepared
    finally:
        llm.close()
    return out


def test_prompt_after_the_prefix_answers_as_the_python_api(server, smollm2_path, document, tokens):
    prefix, question, open_question = tokens
    assert f"holds the prepared fixed prefix ({len(prefix)} tokens)" in server.log()
    got = []
    for q in (question, open_question):
        out = server.complete(prefix + q)
        # only (the new part of) the question was evaluated: the prefix's cells were prepared at start
        assert 0 < out["timings"]["prompt_n"] <= len(q) and out["id_slot"] == 0, out
        got.append(out["content"])
    want = python_answers(smollm2_path, prefix, [question, open_question], float(KEEP))
    assert got == want
    assert "48213" in got[0]
    # and the server's decode was the sparse one: over every key (keep 1) the open question is answered otherwise
    assert python_answers(smollm2_path, prefix, [open_question], 1.0)[0] != got[1]
    # a text prompt that starts with the document reuses it too
    text = server.complete(Path(document).read_text() + QUESTION)
    assert text["id_slot"] == 0 and text["timings"]["prompt_n"] <= len(question) + 1, text
    assert text["content"] == got[0]


def test_start_up_logs_progress(server, tokens):
    # the evaluation (one batch here: the prefix is shorter than -b) and the clustering, each line with the time so far
    log = server.log()
    n = len(tokens[0])
    assert re.search(rf"evaluating the fixed prefix: 100% \({n} of {n} tokens\), [\d.]+ s", log), log[-3000:]
    clustering = re.findall(r"clustering the fixed prefix: (\d+)%, [\d.]+ s", log)
    assert clustering == ["25", "50", "75"], log[-3000:]
    assert log.index("clustering the fixed prefix: 75%") < log.index("prepared the fixed prefix in")


def test_props_name_the_prefix_settings(server, document):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/props", timeout=30) as r:
        sq = json.loads(r.read())["squeeze"]
    assert (sq["enabled"], sq["prefix_file"], sq["loaded_from"], sq["group"], sq["init"], sq["prefill"]) == \
        (True, document, "", "max", "even", "auto"), sq
    assert sq["keep"] == pytest.approx(float(KEEP)) and sq["centroids"] == pytest.approx(0.1) and sq["levels"] == 1, sq


def test_other_prompts_run_in_the_other_slot_and_keep_the_prefix(server, tokens):
    prefix, question, _ = tokens
    first = server.complete(prefix + question)
    other = server.complete("The capital of France is")
    assert other["id_slot"] == 1 and "Paris" in other["content"], other
    # a completion without cache_prompt (it would clear the slot) never takes slot 0 either
    nocache = server.complete(prefix + question, cache_prompt=False)
    assert nocache["id_slot"] == 1 and nocache["timings"]["prompt_n"] == len(prefix) + len(question), nocache
    again = server.complete(prefix + question)
    assert again["id_slot"] == 0 and again["timings"]["prompt_n"] == 1  # all cached: the last token is evaluated again
    assert again["content"] == first["content"]
    second = server.complete(prefix + server_tokens_of(server, "\nQuestion: Who wrote this?\nAnswer:"))
    assert second["id_slot"] == 0
    assert "dropped" not in server.log() and "no longer prepared" not in server.log()


def server_tokens_of(server: SqueezeServer, text: str) -> list[int]:
    status, out = server.post("/tokenize", {"content": text})
    assert status == 200, out
    return out["tokens"]


@pytest.mark.parametrize(("kv_args", "shares"), [
    (["-kvu"], "shares the prepared fixed prefix's cells with slot 0"),
    ([], "copies the prepared fixed prefix's cache stream from slot 0"),
], ids=["one-stream", "stream-per-slot"])
def test_other_slots_share_the_prefix(smollm2_path, document, tokens, tmp_path, kv_args, shares):
    # slot 1 takes the prefix when slot 0 is busy or it is asked for: with one cache stream (-kvu) its cells by
    # reference (seq_cp within the stream), with a stream per slot a copy of slot 0's stream (seq_cp across streams,
    # cell for cell, which the library reads sparsely too). It evaluates only the question and reads the prefix
    # sparsely (the open question gets keep 0.1's answer, as in slot 0).
    prefix, question, open_question = tokens
    srv = SqueezeServer(smollm2_path, tmp_path, "-np", "2", *kv_args, "--squeeze", "--squeeze-prefix-file", document,
                 "--squeeze-keep", KEEP)
    try:
        home = [srv.complete(prefix + q) for q in (question, open_question)]
        assert [h["id_slot"] for h in home] == [0, 0]
        other = srv.complete("The capital of France is", id_slot=1)
        assert other["id_slot"] == 1 and "Paris" in other["content"], other
        shared = [srv.complete(prefix + q, id_slot=1) for q in (question, open_question)]
        assert [s["id_slot"] for s in shared] == [1, 1]
        assert shared[0]["timings"]["prompt_n"] == len(question), shared[0]
        assert 0 < shared[1]["timings"]["prompt_n"] <= len(open_question), shared[1]
        log = srv.log()
        assert f"{shares} ({len(prefix)} tokens)" in log
        assert "dropped" not in log and "no longer prepared" not in log and "densely" not in log
        # the same cells and clusters, but the question's cells sit elsewhere in the cache (another summation order),
        # which this small model amplifies after a few tokens: the first clause is compared (at keep 0.1 and 10%
        # clusters " The text is about a lady named Helena", then the two slots part after about ten tokens)
        assert "48213" in shared[0]["content"]
        first = lambda c: re.split(r"[.,]", c["content"])[0]
        assert first(shared[1]) == first(home[1]), (shared[1], home[1])
        # unasked: while slot 0 generates, a prompt with the prefix goes to slot 1, which shares the cells again
        assert srv.complete("Paris is the capital of", id_slot=1)["id_slot"] == 1
        busy: dict = {}
        worker = threading.Thread(target=lambda: busy.update(
            srv.complete(prefix + question, n_predict=400, ignore_eos=True)))
        worker.start()
        deadline = time.time() + 60
        while "selected the slot holding the prepared fixed prefix" not in srv.log()[len(log):]:
            assert time.time() < deadline and worker.is_alive(), "the long request did not start in slot 0"
            time.sleep(0.1)
        meanwhile = srv.complete(prefix + open_question)
        worker.join(timeout=300)
        # slot 0 was busy (an idle slot 0 takes every prompt with the prefix)
        assert busy["id_slot"] == 0 and meanwhile["id_slot"] == 1, (busy, meanwhile)
        assert meanwhile["timings"]["prompt_n"] == len(open_question), meanwhile
        assert srv.log().count(shares) == 2 and "densely" not in srv.log()
    finally:
        srv.close()


def test_one_slot_refuses_other_prompts(smollm2_path, document, tokens, tmp_path):
    prefix, question, _ = tokens
    srv = SqueezeServer(smollm2_path, tmp_path, "-np", "1", "--squeeze", "--squeeze-prefix-file", document,
                 "--squeeze-keep", KEEP)
    try:
        status, out = srv.post("/completion", {"prompt": "The capital of France is", "n_predict": 4})
        assert status == 400, out
        assert "slot 0 holds the prepared fixed prefix (--squeeze)" in out["error"]["message"]
        status, out = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 400 and "after the chat template" in out["error"]["message"], out
        ok = srv.complete(prefix + question)
        assert ok["timings"]["prompt_n"] == len(question) and "48213" in ok["content"]
    finally:
        srv.close()


def test_a_dropped_prefix_is_prepared_again(smollm2_path, document, tokens, tmp_path):
    """A slot erase takes the prefix's cells, which drops it; the next task finds no slot processing and prepares it
    again, so again only the question is evaluated, with the same answer, and the one slot refuses other prompts again."""
    prefix, question, _ = tokens
    srv = SqueezeServer(smollm2_path, tmp_path, "-np", "1", "--squeeze", "--squeeze-prefix-file", document,
                        "--squeeze-keep", KEEP, "--slot-save-path", str(tmp_path))
    try:
        first = srv.complete(prefix + question)
        assert first["timings"]["prompt_n"] == len(question) and "48213" in first["content"], first
        status, out = srv.post("/slots/0?action=erase", {})
        assert status == 200 and out["n_erased"] > len(prefix), out
        again = srv.complete(prefix + question)
        log = srv.log()
        assert "no longer prepared" in log and log.count("preparing the fixed prefix again") == 1, log[-3000:]
        assert log.count(f"holds the prepared fixed prefix ({len(prefix)} tokens)") == 2
        assert again["timings"]["prompt_n"] == len(question) and again["content"] == first["content"], again
        status, out = srv.post("/completion", {"prompt": "The capital of France is", "n_predict": 4})
        assert status == 400 and "slot 0 holds the prepared fixed prefix (--squeeze)" in out["error"]["message"], out
    finally:
        srv.close()


def test_saved_prefix_loads_and_answers_the_same(server, smollm2_path, tokens, document, tmp_path):
    prefix, question, _ = tokens
    state = str(tmp_path / "doc.state")
    res = run(["llama-completion", "-m", str(smollm2_path), "-no-cnv", "--temp", "0", "-n", "1", "-t", "2", "-c", "4096",
               "-p", QUESTION, "--squeeze", "--squeeze-prefix-file", document, "--squeeze-keep", KEEP,
               "--squeeze-save", state], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    want = server.complete(prefix + question)["content"]
    # with one cache stream (-kvu) and with one per slot (the state's one stream is loaded into slot 0's), where slot 1
    # then takes a copy of slot 0's stream and reads the prefix sparsely too
    for kv_args in (["-kvu"], []):
        loaded = SqueezeServer(smollm2_path, tmp_path, "-np", "2", *kv_args, "--squeeze", "--squeeze-load", state)
        try:
            assert f"loaded a prepared prefix of {len(prefix)} tokens" in loaded.log()
            out = loaded.complete(prefix + question)
            other = loaded.complete(prefix + question, id_slot=1)
        finally:
            loaded.close()
        assert out["timings"]["prompt_n"] == len(question) and out["id_slot"] == 0, (kv_args, out)
        assert out["content"] == want, kv_args
        assert other["id_slot"] == 1 and other["timings"]["prompt_n"] == len(question), (kv_args, other)
        assert "48213" in other["content"] and "densely" not in loaded.log(), kv_args


@pytest.mark.parametrize(("args", "message"), [
    (["--squeeze", "--squeeze-prefix-file", "/nonexistent.txt"], "cannot read --squeeze-prefix-file"),
    (["--squeeze", "--squeeze-load", "/nonexistent.state"], "failed to load the prepared prefix: cannot open"),
])
def test_bad_prefix_fails_at_start(smollm2_path, args, message):
    res = run(["llama-server", "-m", str(smollm2_path), "--port", str(free_port()), "-c", "2048", "-t", "2",
               "--no-warmup", *args], timeout=120)
    assert res.returncode != 0
    assert message in res.stderr + res.stdout


def test_bad_flags_fail_before_loading():
    res = run(["llama-server", "--squeeze-keep", "0.2", "-m", "/nonexistent.gguf"], timeout=60)
    assert res.returncode != 0 and "--squeeze-keep has no effect without --squeeze" in res.stderr + res.stdout


def test_chat_requests_reuse_a_prefix_prepared_as_a_system_message(smollm2_path, document, tmp_path):
    # --squeeze-chat: the prefix is the chat template's rendering of the file as a system message (up to where the
    # conversations that start with it diverge), so chat completions with that system message reuse it
    doc = Path(document).read_text()
    srv = SqueezeServer(smollm2_path, tmp_path, "-np", "2", "--squeeze", "--squeeze-prefix-file", document, "--squeeze-chat",
                 "--squeeze-keep", "0.3")
    try:
        n_prefix = int(re.search(r"holds the prepared fixed prefix \((\d+) tokens\)", srv.log()).group(1))
        n_doc = len(server_tokens_of(srv, doc))
        assert n_doc < n_prefix < n_doc + 16  # the document and the template's system and user headers
        body = {"messages": [{"role": "system", "content": doc},
                             {"role": "user", "content": "What is the secret number of Alice?"}],
                "max_tokens": 12, "temperature": 0}
        status, out = srv.post("/v1/chat/completions", body)
        assert status == 200, out
        assert out["timings"]["prompt_n"] < 30 and "48213" in out["choices"][0]["message"]["content"], out
        # a chat without that system message runs in the other slot, and slot 0 keeps the prefix
        status, out = srv.post("/v1/chat/completions", {**body, "messages": body["messages"][1:]})
        assert status == 200, out
        status, out = srv.post("/v1/chat/completions", body)
        assert status == 200 and out["timings"]["prompt_n"] < 30, out
        assert "no longer prepared" not in srv.log()
    finally:
        srv.close()


def test_llama_cli_answers_over_the_prefix(smollm2_path, document, tmp_path):
    # llama-cli renders the chat: the prefix file is its system prompt, and the prefix that prompt's rendering (at keep
    # 0.3 SmolLM2 finds the number in this chat form; at 0.1 it does not)
    common = ["llama-cli", "-m", str(smollm2_path), "-c", "4096", "-t", "2", "--no-warmup", "--temp", "0", "-n", "12",
              "-p", "What is the secret number of Alice?", "-st", "--squeeze", "--squeeze-keep", "0.3"]
    res = run([*common, "--squeeze-prefix-file", document, "--log-verbosity", "3"], timeout=300,
              stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "selected the slot holding the prepared fixed prefix" in res.stderr, res.stderr[-3000:]
    assert "48213" in res.stdout, res.stdout[-2000:]
    # -sysf may name the same document; another system prompt conflicts with the prefix file
    other = tmp_path / "other.txt"
    other.write_text("You are a pirate.")
    res = run([*common, "--squeeze-prefix-file", document, "-sysf", str(other)], timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode != 0 and "llama-cli takes --squeeze-prefix-file as the system prompt" in res.stderr
    res = run([*common, "--squeeze-load", str(tmp_path / "x.state")], timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode != 0 and "llama-cli --squeeze-load needs the prepared document as the system prompt" in res.stderr
