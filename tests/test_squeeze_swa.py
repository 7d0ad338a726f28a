"""Centroid-sparse attention on a model with sliding-window layers (Gemma-3-270M: 18 layers, 15 of them windowed to
512 cells, 3 global; one KV head of d = 256), every result against an oracle:

* only the global layers read the prefix through the op (the windowed ones read a bounded window and stay dense);
* keep = 1 answers as dense attention does, up to the rounding of another attention kernel (llama.cpp's own two dense
  paths, flash attention on and off, differ by 0.03-0.06 of the logit scale here: measured);
* a small keep changes the logits (the op selects) and keeps dense's greedy tokens near the top;
* a saved prefix loads into a fresh context and answers bit for bit as the preparing one;
* llama-server loads a saved prefix of this model with one cache stream (-kvu) and with one per slot (its sequence
  state holds two caches' one-stream states, both rewritten for the slots' streams; a truncated file is refused
  clearly), and in either layout every slot evaluates only the question (llama-server resumes such a model's cached
  tokens only from a context checkpoint of the windowed cache: the prefix gets one where it is placed) and slot 0
  answers as the Python API.

The prefix (420 tokens) is shorter than the window, so a sequence state holds every cell of both caches and a state
round trip is exact (past the window llama.cpp saves only the windowed cache's visible cells, and the loaded cache's
other layout moves the logits by rounding, dense or not).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import squeeze_files
from conftest import free_port, run
from sparq_llama import Llama
from sparq_llama import squeeze as squeeze_api
from test_sparq_decode import TEXT, TOL_DENSE, Ctx, assert_logits_agree, rel_err
from test_squeeze_decode import _back_to_prefix, _greedy_after
from test_squeeze_server import N_PREDICT, SqueezeServer

from llama_cpp import llama_cpp as lc  # isort: skip

N_CTX = 1024
N_PREFIX = 420          # 320 clustered tokens + 100 calibration tokens, inside the 512-cell window
SETTINGS = {"centroids": 0.1, "progress": False}


def _gemma(path, **kw) -> Llama:
    return Llama(str(path), n_ctx=N_CTX, flash_attn=True, n_threads=2, n_threads_batch=2, verbose=False, **kw)


@pytest.fixture(scope="module")
def llm(gemma3_path):
    llm = _gemma(gemma3_path)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def doc_and_question(llm) -> tuple[list[int], list[int]]:
    toks = llm.tokenize(TEXT.encode(), add_bos=True)
    assert len(toks) > 612
    return toks[:N_PREFIX], toks[600:612]


@pytest.fixture(scope="module")
def dense_answer(llm, doc_and_question):
    """Dense greedy answer (16 steps) on the cache a preparation leaves (then cleared)."""
    doc, question = doc_and_question
    llm.prepare_fixed_context(doc, keep=1.0, **SETTINGS)
    llm.clear_fixed_context()
    out = _greedy_after(llm, question, 16)
    _back_to_prefix(llm, N_PREFIX)
    return out


def test_the_model_has_windowed_layers(llm):
    assert lc.llama_model_n_swa(llm.model) == 512 and lc.llama_model_n_layer(llm.model) == 18


def test_only_global_layers_are_prepared_and_keep_one_answers_as_dense(llm, doc_and_question, dense_answer):
    doc, question = doc_and_question
    info = llm.prepare_fixed_context(doc, keep=1.0, **SETTINGS)
    assert info.prepared and info.n_prefix == N_PREFIX and info.n_clustered == N_PREFIX - 100
    assert info.n_layers == 3, info   # layers 5, 11 and 17: the windowed 15 stay dense
    tokens, logits = _greedy_after(llm, question, 16)
    _back_to_prefix(llm, N_PREFIX)
    d_tokens, d_logits = dense_answer
    same = next((i for i, (a, b) in enumerate(zip(tokens, d_tokens)) if a != b), len(tokens))
    # rows up to the first different token saw the same tokens: another kernel's rounding only
    assert_logits_agree(logits[:same + 1], d_logits[:same + 1], "keep = 1 vs dense", tol=TOL_DENSE)
    assert same >= 3, f"keep = 1 and dense part at step {same}: {tokens} vs {d_tokens}"
    if same < len(tokens):  # a near tie that the rounding flips: dense's token is within tolerance of the top
        row = d_logits[same]
        assert row[d_tokens[same]] - row[tokens[same]] <= TOL_DENSE * np.abs(row).max()


@pytest.mark.parametrize("keep", [0.3, 0.1])
def test_small_keep_really_selects(llm, doc_and_question, dense_answer, keep):
    doc, question = doc_and_question
    d_tokens, _ = dense_answer
    ctx = Ctx.of(llm)
    rows = question + d_tokens[:15]   # dense's answer, teacher-forced
    llm.prepare_fixed_context(doc, keep=1.0, **SETTINGS)
    logits_all = ctx.prefill(rows, pos0=N_PREFIX, all_logits=True)[len(question) - 1:]
    _back_to_prefix(llm, N_PREFIX)
    info = llm.prepare_fixed_context(doc, keep=keep, **SETTINGS)
    assert info.keep == pytest.approx(keep), info
    logits = ctx.prefill(rows, pos0=N_PREFIX, all_logits=True)[len(question) - 1:]
    _back_to_prefix(llm, N_PREFIX)
    assert np.isfinite(logits).all()
    assert rel_err(logits, logits_all).max() > 1e-3, f"keep {keep}: the logits equal keep 1's: is the op used?"
    top5 = np.argsort(-logits, axis=1)[:, :5]
    hits = np.mean([d_tokens[i] in top5[i] for i in range(len(d_tokens))])
    assert hits >= 0.75, f"dense's greedy token in the centroid-sparse top 5 at only {hits:.0%} of steps"


@pytest.fixture(scope="module")
def saved(llm, doc_and_question, tmp_path_factory) -> str:
    """A prefix prepared at keep 0.2 and saved (state file and sidecar); the path of the state file."""
    doc, _ = doc_and_question
    llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    path = str(tmp_path_factory.mktemp("gemma") / "doc.state")
    llm.save_fixed_context(path)
    return path


def test_save_then_load_gives_the_same_outputs(llm, gemma3_path, doc_and_question, saved):
    _, question = doc_and_question
    assert llm.fixed_context.prepared and llm.fixed_context.n_prefix == N_PREFIX  # as saved (saving keeps it)
    want = _greedy_after(llm, question, 8)
    _back_to_prefix(llm, N_PREFIX)
    other = _gemma(gemma3_path, fixed_context=saved)
    try:
        info = other.fixed_context
        assert info.prepared and info.n_prefix == N_PREFIX and info.n_layers == 3
        assert info.keep == llm.fixed_context.keep
        got = _greedy_after(other, question, 8)
    finally:
        other.close()
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])


def test_server_with_a_stream_per_slot_loads_the_saved_prefix(gemma3_path, doc_and_question, saved, tmp_path):
    # the saved state holds two caches' one-stream states (full-attention layers, windowed layers): both are rewritten
    # for the slots' streams; slot 1 then takes a copy of slot 0's stream and answers bit for bit as slot 0
    doc, question = doc_and_question
    srv = SqueezeServer(gemma3_path, tmp_path, "-np", "2", "--squeeze", "--squeeze-load", saved)
    try:
        log = srv.log()
        # (a one-stream state cannot load into two streams without the rewrite: llama.cpp refuses the count)
        assert f"loaded a prepared prefix of {N_PREFIX} tokens" in log
        out = srv.complete(doc + question, n_probs=2)
        other = srv.complete(doc + question, id_slot=1, n_probs=2)
    finally:
        srv.close()
    log = srv.log()
    for r, slot in ((out, 0), (other, 1)):
        assert r["id_slot"] == slot and r["timings"]["prompt_n"] == len(question), r
    assert out["content"] == _python_answer(gemma3_path, saved, doc + question)
    assert other["completion_probabilities"] == out["completion_probabilities"]
    assert "copies the prepared fixed prefix's cache stream from slot 0" in log
    assert "no longer prepared" not in log and "densely" not in log, log[-3000:]


@pytest.mark.parametrize("cut", [1, 4096])
def test_server_refuses_a_truncated_saved_prefix_clearly(gemma3_path, saved, tmp_path, cut):
    # a file cut short is refused at start, with a stream per slot and with one stream: its size is not the one its
    # sidecar records (whose record names the parts of both caches' states, found by reading the first one's layout)
    data = Path(saved).read_bytes()
    bad = tmp_path / "bad.state"
    bad.write_bytes(data[:-cut])
    (tmp_path / "bad.state.squeeze").write_bytes(Path(saved + ".squeeze").read_bytes())
    for kv_args in ([], ["-kvu"]):
        res = run(["llama-server", "-m", str(gemma3_path), "-c", "2048", "-t", "2", "--no-warmup", "-np", "2", *kv_args,
                   "--squeeze", "--squeeze-load", str(bad), "--port", str(free_port())], timeout=120)
        assert res.returncode != 0, kv_args
        out = res.stderr + res.stdout
        assert "failed to load the prepared prefix" in out and "bad.state has" in out and "records" in out, out[-3000:]
    names = [name for name, *_ in squeeze_files.state_record(Path(saved + ".squeeze").read_bytes())[1]]
    assert "cache 0 layer 0 K" in names and "cache 1 layer 0 K" in names, names
    # the Python API refuses it the same way; the KV state alone fails its layout check (llama.cpp's loader would
    # abort the process here)
    llm = _gemma(gemma3_path)
    try:
        with pytest.raises(ValueError, match="bad.state has .* records"):
            llm.load_fixed_context(str(bad))
        with pytest.raises(ValueError, match="does not read as a KV state"):
            squeeze_api.load_state_file(llm.ctx, str(bad), 2048)
    finally:
        llm.close()


def _server_tokens(path, prefix_text: bytes, question_text: bytes) -> tuple[list[int], list[int]]:
    """A prefix file's tokens as --squeeze-prefix-file tokenizes it, and a question's (no BOS)."""
    vocab = Llama(str(path), n_ctx=512, vocab_only=True, verbose=False)
    try:
        return (vocab.tokenize(prefix_text, add_bos=True, special=True),
                vocab.tokenize(question_text, add_bos=False, special=True))
    finally:
        vocab.close()


def _python_answer(path, saved: str, prompt: list[int]) -> str:
    """The oracle: the Python API over the same saved prefix (2 threads, as the servers)."""
    llm = _gemma(path, fixed_context=saved)
    try:
        return llm.create_completion(prompt, max_tokens=N_PREDICT, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()


def test_server_with_one_stream_loads_the_saved_prefix(gemma3_path, doc_and_question, saved, tmp_path):
    doc, question = doc_and_question
    srv = SqueezeServer(gemma3_path, tmp_path, "-np", "2", "-kvu", "--squeeze", "--squeeze-load", saved)
    try:
        assert f"loaded a prepared prefix of {N_PREFIX} tokens" in srv.log()
        out = srv.complete(doc + question, n_probs=2)
        again = srv.complete(doc + question)
        other = srv.complete(doc + question, id_slot=1, n_probs=2)
    finally:
        srv.close()
    log = srv.log()
    # With sliding-window layers the server reuses cached tokens only through a context checkpoint; the prefix gets one
    # when it is placed in a slot (before, every such prompt was evaluated in full and the prefix dropped)
    assert "context checkpoint of the fixed prefix" in log
    assert out["id_slot"] == 0 and out["timings"]["prompt_n"] == len(question), out
    assert out["content"] == _python_answer(gemma3_path, saved, doc + question)
    # the same prompt again: resumed from a checkpoint the server took near the first prompt's end (its own caching)
    assert again["id_slot"] == 0 and again["timings"]["prompt_n"] <= len(question), again
    # slot 1 shares the prefix's cells and evaluates only the question too. Its restored checkpoint puts the windowed
    # cache's cells elsewhere, and this model moves with the summation order of 2 threads (up to 0.09 of the logit
    # scale, dense too: measured), so the texts may part later; the first token and its log-probabilities agree
    assert other["id_slot"] == 1 and other["timings"]["prompt_n"] == len(question), other
    first, first_other = out["completion_probabilities"][0], other["completion_probabilities"][0]
    assert first["token"] == first_other["token"]
    assert abs(first["logprob"] - first_other["logprob"]) < 0.1, (first, first_other)
    assert "no longer prepared" not in log and "densely" not in log, log[-3000:]


def test_server_with_a_stream_per_slot_prepares_and_shares_the_prefix(gemma3_path, tmp_path):
    # the stream per slot layout prepares the prefix from a file (a saved one needs -kvu here, above); slot 1 takes a
    # copy of slot 0's stream (the same cells in the same places) and answers bit for bit as slot 0
    text = TEXT[:1900]
    prefix_file = tmp_path / "doc.txt"
    prefix_file.write_text(text)
    prefix, question = _server_tokens(gemma3_path, text.encode(), TEXT[2400:2460].encode())
    srv = SqueezeServer(gemma3_path, tmp_path, "-np", "2", "--squeeze", "--squeeze-prefix-file", str(prefix_file),
                        "--squeeze-keep", "0.2")
    try:
        assert f"holds the prepared fixed prefix ({len(prefix)} tokens)" in srv.log()
        out = srv.complete(prefix + question, n_probs=2)
        other = srv.complete(prefix + question, id_slot=1, n_probs=2)
    finally:
        srv.close()
    log = srv.log()
    assert "copies the prepared fixed prefix's cache stream from slot 0" in log
    for r, slot in ((out, 0), (other, 1)):
        assert r["id_slot"] == slot and r["timings"]["prompt_n"] == len(question), r
    assert other["completion_probabilities"] == out["completion_probabilities"]
    assert "no longer prepared" not in log and "densely" not in log, log[-3000:]


@pytest.fixture(scope="module")
def long_document(tmp_path_factory) -> str:
    """A prefix longer than the 512-cell window (~1740 tokens): a play with a needle; the path of its file."""
    from sparq_llama import texts

    play = texts.read(texts.names()[0])
    path = tmp_path_factory.mktemp("long") / "doc.txt"
    path.write_text(play[:2500] + "\n\nThe secret number of Alice is 48213.\n\n" + play[2500:6000])
    return str(path)


def test_server_shares_a_prefix_longer_than_the_window(gemma3_path, long_document, tmp_path):
    # Past the window llama-server keeps only the window's cells (no --swa-full). A slot sharing slot 0's cells (-kvu)
    # gets windowed cells of its own: cells held by both sequences would fill the windowed cache and fail slot 1's
    # decode ("Context size has been exceeded", HTTP 500). Both slots evaluate only the question.
    prefix, question = _server_tokens(gemma3_path, Path(long_document).read_bytes(),
                                      b"\nQuestion: What is the secret number of Alice?\nAnswer: The secret number of Alice is")
    assert len(prefix) > 3 * 512
    srv = SqueezeServer(gemma3_path, tmp_path, "-np", "2", "-kvu", "--squeeze", "--squeeze-prefix-file", long_document,
                        "--squeeze-keep", "0.1")
    try:
        out = [srv.post("/completion", {"prompt": prefix + question, "n_predict": 4, "temperature": 0, "id_slot": s})
               for s in (0, 1)]
        log = srv.log()
    finally:
        srv.close()
    for slot, (status, r) in enumerate(out):
        assert status == 200, (slot, r)
        assert r["id_slot"] == slot and r["timings"]["prompt_n"] == len(question), r
    assert "no longer prepared" not in log and "densely" not in log and "failed to find" not in log, log[-3000:]


def test_preparing_where_the_window_dropped_what_the_calibration_tokens_need(gemma3_path, doc_and_question):
    """llama_squeeze_prepare decodes the prefix's last n_calib tokens again; a windowed cache that keeps only its
    window (swa_full off; here 768 cells: 512 + a 64-token ubatch, padded) has dropped positions they attend to (with
    400 calibration tokens, the first attends back to 511 before it), and decoding them
    again would silently change the prefix: that fails with the reason. Evaluating only the prefix's first
    n_prefix - n_calib tokens instead lets prepare decode the rest itself (and keep = 1 then answers as dense does)."""
    from sparq_llama import texts

    model = lc.llama_model_load_from_file(str(gemma3_path).encode(), lc.llama_model_default_params())
    try:
        vocab = lc.llama_model_get_vocab(model)
        text = texts.read(texts.names()[0])[:6000].encode()
        buf = (lc.llama_token * 4096)()
        n = lc.llama_tokenize(vocab, text, len(text), buf, 4096, True, True)
        doc = list(buf[:n])
        _, question = doc_and_question
        n_tail = 400
        cfg = squeeze_api.SqueezeConfig(keep=1.0, centroids=0.1, n_calib=n_tail)
        with Ctx(model, n_batch=64, n_ctx=4096, swa_full=False) as ctx:
            ctx.prefill(doc)
            with pytest.raises(ValueError, match="keeps only its window and no longer holds position"):
                squeeze_api.prepare(ctx.ctx, doc, cfg)
            assert not squeeze_api.info(ctx.ctx).prepared
            lc.llama_memory_seq_rm(ctx.mem, 0, -1, -1)
            ctx.prefill(doc[:-n_tail])
            info = squeeze_api.prepare(ctx.ctx, doc, cfg)
            assert info.prepared and info.n_prefix == len(doc) and info.n_clustered == len(doc) - n_tail
            assert lc.llama_memory_seq_pos_max(ctx.mem, 0) == len(doc) - 1
            got = ctx.prefill(question, pos0=len(doc), all_logits=True)
        with Ctx(model, n_batch=64, n_ctx=4096, swa_full=False) as ctx:   # the oracle: dense, the same ubatches
            ctx.prefill(doc[:-n_tail])
            ctx.prefill(doc[-n_tail:], pos0=len(doc) - n_tail)
            want = ctx.prefill(question, pos0=len(doc), all_logits=True)
        assert_logits_agree(got, want, "keep = 1 after a prepare that decoded the tail vs dense", tol=TOL_DENSE)
    finally:
        lc.llama_model_free(model)


def _query_norm_weights(path: Path, il: int) -> np.ndarray:
    """Layer il's k-means weights from its query norm in the GGUF (the float64 reference's rule)."""
    import gguf
    from sparq_llama.reference_squeeze import query_norm_weights
    return query_norm_weights(next(t.data for t in gguf.GGUFReader(str(path)).tensors
                                   if t.name == f"blk.{il}.attn_q_norm.weight"))


def _sidecar_assignments(path: Path) -> dict[int, np.ndarray]:
    """Per active layer of a saved prefix's sidecar (format 4: framed parts), its assignment [n_head_kv, P]."""
    import struct
    data = path.read_bytes()
    assert data[4:8] == struct.pack("<I", 4), "a sidecar of format 4 is expected"
    parts, at = [], 8
    while at < len(data):
        n = struct.unpack_from("<Q", data, at)[0]
        parts.append(data[at + 16:at + 16 + n])
        at += 16 + n
    n_layers = struct.unpack_from("<I", parts[2])[0]
    out = {}
    for i in range(n_layers):
        head, assign = parts[3 + 5 * i], parts[3 + 5 * i + 2]
        il, active = struct.unpack_from("<IB", head)
        n_reason = struct.unpack_from("<Q", head, 5)[0]
        d, n_head_kv, n_cent, n_coarse, width = struct.unpack_from("<5q", head, 13 + n_reason)
        if active:
            out[il] = np.frombuffer(assign[8:], dtype=np.int32).reshape(n_head_kv, -1)
    return out


def test_global_layers_cluster_keys_weighted_by_the_query_norm(llm, doc_and_question, gemma3_path, tmp_path):
    # Gemma-3 has QK-norm: its queries weigh each key component by the query norm's weight (the rotary pair's rms),
    # so the prefix's keys are clustered centred and so weighted. Oracle: the float64 k-means of the keys as the
    # cache holds them (f16), captured from the model's graph, with the weights read from the GGUF
    from sparq_llama.eval.agreement import QKCapture
    from sparq_llama.eval.engine import Engine, EngineConfig
    from sparq_llama.reference_squeeze import kmeans_cosine
    doc, _ = doc_and_question
    config = squeeze_api.SqueezeConfig()
    info = llm.prepare_fixed_context(doc, keep=0.2, **SETTINGS)
    path = tmp_path / "gemma.squeeze"
    squeeze_api.save(llm.ctx, str(path))
    got = _sidecar_assignments(path)
    assert sorted(got) == [5, 11, 17]
    engine = Engine(EngineConfig(str(gemma3_path), n_ctx=N_CTX, n_threads=2))
    cap = QKCapture(engine, n_ctx=N_PREFIX, keep_q_from=N_PREFIX)
    try:
        cap.prefill(doc)
        keys = {il: np.concatenate(cap.k[il])[:info.n_clustered, 0] for il in got}   # one KV head
    finally:
        cap.close()
        engine.close()
    n_cent = max(1, round(SETTINGS["centroids"] * info.n_clustered))   # as the preparation rounds it (32 here)
    for il, assign in got.items():
        k16 = keys[il].astype(np.float16).astype(np.float64)
        assert assign.shape == (1, info.n_clustered) and assign.max() < n_cent
        weighted = kmeans_cosine(k16, n_cent, n_iter=config.n_iter, center=True,
                                 weights=_query_norm_weights(gemma3_path, il)).assignment
        plain = kmeans_cosine(k16, n_cent, n_iter=config.n_iter, center=True).assignment
        agree, agree_plain = float((assign[0] == weighted).mean()), float((assign[0] == plain).mean())
        # float32 against float64: a near tie that moves one key moves the centroids after it, so a few percent of
        # the keys may part (measured 100% / 95.3% / 93.4% for layers 5 / 11 / 17); the unweighted clustering
        # agrees with only 53-62%
        assert agree >= 0.9 and agree >= agree_plain + 0.25, (il, agree, agree_plain)
