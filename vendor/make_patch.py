#!/usr/bin/env python3
"""Write one patch of the series from edits made in vendor/llama.cpp (a developer tool).

    python3 vendor/make_patch.py vendor/patches/0003-llama-sparq-hooks.patch src/llama-graph.cpp ...

    python3 vendor/make_patch.py --base DIR vendor/patches/0010-x.patch ggml/src/ggml.c ...

Each FILE (relative to the llama.cpp root) is diffed against the pristine sdist copy, or with --base against
DIR/FILE: a copy of the file as the earlier patches of the series leave it (copy the files out of
vendor/llama.cpp before editing them), for a patch that touches a file an earlier patch already changes.
Regenerate the patch before building, or the configure-time fetch (which sees a changed series) would not
match the tree.
"""
from __future__ import annotations

import difflib
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch  # noqa: E402


def pristine_text(rel: str) -> str:
    pin = fetch.load_pin()
    sdist = fetch.cache_dir() / "sdist" / pin["sdist"]
    prefix = pin["tree_in_sdist"].rstrip("/") + "/"
    with tarfile.open(sdist) as tar:
        try:
            member = tar.getmember(prefix + rel)
        except KeyError:
            return ""  # a new file
        return tar.extractfile(member).read().decode()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    base = None
    if argv[0] == "--base":
        base, argv = Path(argv[1]), argv[2:]
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, files = Path(argv[0]), argv[1:]
    tree = fetch.DEFAULT_DEST
    chunks = []
    for rel in sorted(files):
        old_text = (base / rel).read_text() if base else pristine_text(rel)
        old = old_text.splitlines(keepends=True)
        new = (tree / rel).read_text().splitlines(keepends=True)
        diff = list(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}", n=3))
        if not diff:
            print(f"make_patch: {rel} is unchanged", file=sys.stderr)
            return 1
        chunks.append(f"diff -ru a/{rel} b/{rel}\n" + "".join(diff))
    out.write_text("".join(chunks))
    print(f"make_patch: wrote {out} ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
