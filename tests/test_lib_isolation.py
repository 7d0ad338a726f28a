"""Our shared libraries keep a statically linked C++ runtime private, so a process that already holds the system
libstdc++ still loads and runs a model.

Found on a GPU machine whose compiler (/opt/gcc) links libstdc++ statically into every library, each
copy exported its symbols, and after `import gguf` (which imports sentencepiece, which loads the system libstdc++)
the Python `Llama` crashed inside llama_model_load_from_file, in an ostream insert of llama_model::print_info.
CMakeLists.txt now links with --exclude-libs for the C++ runtime's archives. With a shared libstdc++ (the usual
case, and CI) both checks hold trivially. On a static-runtime build without the fix (checked on the CPU build with
-static-libstdc++) the export check fails (libggml.so exported the runtime); the load check passed there, as that
crash needs the CUDA build's layout, and is the end-to-end check on the GPU machine.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO, python
from sparq_llama._lib import lib_dir

# std::locale::classic(): defined only by the C++ runtime itself, so a library exporting it exports a runtime copy
RUNTIME_SYMBOL = "_ZNSt6locale7classicEv"


def _our_libraries() -> dict[str, Path]:
    """Each shared library in the library folder once, by its name (a build tree links libX.so -> libX.so.N.M)."""
    libs: dict[str, Path] = {}
    for p in sorted(lib_dir().glob("lib*.so*")):
        libs.setdefault(p.name.split(".so")[0] + ".so", p.resolve())
    return libs


def test_no_library_exports_a_cxx_runtime_copy():
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to build sparq-llama and to run this check"
    libs = _our_libraries()
    assert "libllama.so" in libs, f"no libllama.so in {lib_dir()}"
    exporting = []
    for name, lib in libs.items():
        out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
        if any(line.split()[-1] == RUNTIME_SYMBOL for line in out.splitlines() if line.strip()):
            exporting.append(name)
    assert not exporting, f"these libraries export a copy of the C++ runtime ({RUNTIME_SYMBOL}): {exporting}"


def test_model_loads_and_decodes_with_the_system_libstdcxx_loaded_first(tmp_path):
    # The model is written in a separate process: the writer (gguf) is not what is under test here.
    model = tmp_path / "tiny.gguf"
    vocab = REPO / "vendor" / "llama.cpp" / "models"
    write = python(f"from sparq_llama.eval import random_gguf; from pathlib import Path; "
                   f"random_gguf.write_model(random_gguf.SHAPES['tiny'], Path({str(model)!r}), Path({str(vocab)!r}))")
    assert write.returncode == 0, write.stderr[-2000:]
    code = textwrap.dedent(f"""
        import ctypes, ctypes.util, math
        name = ctypes.util.find_library("stdc++")
        assert name, "no system libstdc++ found"
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)   # as an extension module built against it would
        from sparq_llama import Llama
        llm = Llama({str(model)!r}, n_ctx=256, n_gpu_layers=99, flash_attn=True, verbose=False)
        llm.eval([1, 100, 200, 300])
        row = llm.scores[llm.n_tokens - 1]
        assert all(math.isfinite(float(x)) for x in row), "non-finite logits"
        print("decoded", llm.n_tokens)
        llm.close()
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stderr[-3000:]}"
    assert "decoded 4" in run.stdout
