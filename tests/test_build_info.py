import json
import shutil

import sparq_llama
from conftest import PIN, run


def test_build_info_reports_our_build():
    info = sparq_llama.build_info()
    assert info["name"] == "sparq-llama"
    assert info["version"] == sparq_llama.__version__
    assert info["llama_cpp_commit"] == PIN["llama_cpp_commit"]
    assert info["llama_cpp_python"] == PIN["version"]
    assert info["ops"] == ["sparq_attn", "centroid_attn"]
    assert info["backends"][0] == "CPU"
    assert set(info["backends"]) <= {"CPU", "CUDA", "RPC"}
    assert "RPC" in info["backends"]  # the package always builds the RPC backend (ggml-rpc-server, --rpc)


def test_rpc_backend_is_registered():
    # what the build info says, as llama.cpp itself sees it: the RPC backend is in the loaded libraries
    from llama_cpp import llama_cpp as lc

    assert lc.llama_supports_rpc() == ("RPC" in sparq_llama.build_info()["backends"])


def test_build_info_is_from_the_loaded_libllama():
    # the library llama-cpp-python bound is ours (it exports our symbols and sits in our lib dir)
    from llama_cpp import llama_cpp as lc

    assert lc._base_path.resolve() == sparq_llama.lib_dir()
    assert hasattr(lc._lib, "sparq_llama_build_info")


def test_devices_include_the_cpu():
    devs = sparq_llama.devices()
    assert any(d["name"] == "CPU" for d in devs), devs
    assert all(d["description"] for d in devs)


def test_info_command_json_and_text():
    exe = shutil.which("sparq-llama")
    assert exe, "the sparq-llama console script is not on PATH"
    res = run([exe, "info", "--json"])
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info == {**sparq_llama.build_info(), "lib_dir": info["lib_dir"], "devices": info["devices"]}
    assert any(d["name"] == "CPU" for d in info["devices"])
    res = run([exe, "info"])
    assert res.returncode == 0 and f"llama.cpp {PIN['llama_cpp_commit']}" in res.stdout and "CPU" in res.stdout


def test_cli_help_and_bad_command():
    exe = shutil.which("sparq-llama")
    res = run([exe, "--help"])
    assert res.returncode == 0 and "info" in res.stdout and "demo" in res.stdout
    res = run([exe, "no-such-command"])
    assert res.returncode == 2 and "invalid choice" in res.stderr
