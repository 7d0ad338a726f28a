"""sparq_llama.Llama: a real generation, strict kwargs, library loading rules, from_pretrained."""
import os
import shutil
from pathlib import Path

import pytest
import sparq_llama
from conftest import python


def test_greedy_generation_answers_paris(smollm2):
    out = smollm2.create_chat_completion(
        # an explicit system prompt: with the template's default one this 135M Q4_1 model rambles
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the capital of France?"}],
        temperature=0.0, top_k=1, max_tokens=24, seed=1)
    answer = out["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer


def test_is_a_llama_cpp_llama(smollm2):
    import llama_cpp

    assert isinstance(smollm2, llama_cpp.Llama)
    assert smollm2.n_ctx() == 1024
    assert smollm2.detokenize(smollm2.tokenize(b"Hamlet", add_bos=False)) == b"Hamlet"


def test_unknown_kwarg_raises_type_error(smollm2_path):
    with pytest.raises(TypeError, match=r"n_ctxx.*did you mean 'n_ctx'"):
        sparq_llama.Llama(str(smollm2_path), n_ctxx=256, verbose=False)
    with pytest.raises(TypeError, match="no_such_option"):
        sparq_llama.Llama(str(smollm2_path), no_such_option=True, verbose=False)


def test_known_kwargs_reach_llama_cpp(smollm2_path):
    llm = sparq_llama.Llama(str(smollm2_path), n_ctx=256, n_batch=64, n_threads=1, verbose=False)
    try:
        assert llm.n_ctx() == 256 and llm.n_batch == 64 and llm.context_params.n_threads == 1
    finally:
        llm.close()


def test_llama_cpp_imported_first_from_elsewhere_is_a_clear_import_error(tmp_path):
    other = tmp_path / "other-lib"
    shutil.copytree(sparq_llama.lib_dir(), other)
    env = {"LLAMA_CPP_LIB_PATH": str(other)}
    res = python("import llama_cpp; import sparq_llama", env=env)
    assert res.returncode == 1
    assert "ImportError: llama_cpp was imported before sparq_llama" in res.stderr
    assert "Import sparq_llama before llama_cpp" in res.stderr


def test_foreign_llama_cpp_lib_path_is_a_clear_import_error(tmp_path):
    res = python("import sparq_llama", env={"LLAMA_CPP_LIB_PATH": str(tmp_path)})
    assert res.returncode == 1 and "names another libllama" in res.stderr


def test_import_order_sparq_first_then_llama_cpp_works():
    res = python("import sparq_llama, llama_cpp; from llama_cpp import llama_cpp as lc; "
                 "print(lc._base_path)")
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).resolve() == sparq_llama.lib_dir()


def test_from_pretrained_through_huggingface_hub(smollm2_path, tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
    calls = []

    class FakeFS:  # the listing from_pretrained matches its glob against
        def ls(self, repo_id, recursive=False):
            return [f"{repo_id}/{smollm2_path.name}", f"{repo_id}/README.md"]

    def fake_download(repo_id, filename, subfolder=None, local_dir=None, **kw):
        calls.append((repo_id, filename, subfolder))
        dest = Path(local_dir) / filename
        if not dest.exists():
            os.symlink(smollm2_path, dest)
        return str(dest)

    monkeypatch.setattr(hub, "HfFileSystem", FakeFS)
    monkeypatch.setattr(hub, "hf_hub_download", fake_download)
    llm = sparq_llama.Llama.from_pretrained(repo, "*Q4_1.gguf", local_dir=tmp_path, n_ctx=256, verbose=False)
    try:
        assert type(llm) is sparq_llama.Llama
        assert calls and calls[0][:2] == (repo, smollm2_path.name)
        assert llm.n_ctx() == 256
    finally:
        llm.close()
    with pytest.raises(TypeError, match="n_ctxx"):
        sparq_llama.Llama.from_pretrained(repo, "*Q4_1.gguf", local_dir=tmp_path, n_ctxx=128)


def test_prepare_fixed_context_progress_covers_evaluation_and_clustering(smollm2_path, monkeypatch):
    import tqdm.auto
    from sparq_llama import texts

    events: list[tuple[str, str, int]] = []

    class Bar:
        """Records what prepare_fixed_context shows: (event, description, position in %)."""

        def __init__(self, total, desc, **_):
            assert total == 100
            self.n, self.desc = 0, desc
            events.append(("open", desc, 0))

        def update(self, k):
            self.n += k
            events.append(("update", self.desc, self.n))

        def set_description(self, desc):
            self.desc = desc
            events.append(("describe", desc, self.n))

        def close(self):
            events.append(("close", self.desc, self.n))

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    llm = sparq_llama.Llama(str(smollm2_path), n_ctx=1024, n_batch=64, flash_attn=True, n_threads=2, verbose=False)
    try:
        tokens = llm.tokenize(texts.read(texts.names()[0]).encode())[:600]
        llm.prepare_fixed_context(tokens, keep=0.2)
        assert llm.fixed_context.prepared and llm.fixed_context.n_prefix == 600
    finally:
        llm.close()
    assert events[0] == ("open", "evaluating the fixed context", 0)
    evaluating = [n for kind, desc, n in events if kind == "update" and desc == "evaluating the fixed context"]
    # one step per batch of 64 tokens (10 batches), to the evaluation's 85% of the bar
    assert len(evaluating) == 10 and evaluating == sorted(evaluating) and evaluating[-1] == 85, events
    switch = events.index(("describe", "clustering the fixed context", 85))
    assert all(desc == "evaluating the fixed context" for _, desc, _ in events[:switch])
    clustering = [n for kind, desc, n in events[switch:] if kind == "update"]
    assert len(clustering) >= 3 and clustering == sorted(clustering) and clustering[-1] == 100, events
    assert events[-1] == ("close", "clustering the fixed context", 100)
