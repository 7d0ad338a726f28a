"""The C bindings: every function the package calls is declared once, in sparq_llama/_bindings.py, with the
prototype its header gives, and the loaded libraries export it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import sparq_llama
from conftest import REPO
from sparq_llama import _bindings as C

PACKAGE = Path(sparq_llama.__file__).resolve().parent
BINDINGS = PACKAGE / "_bindings.py"
DECLARED = [fn for fn in vars(C).values() if isinstance(fn, C.CFunction)]


def _normalised(text: str) -> str:
    """C text with each whitespace run made one space, and none around '(' (headers align their names)."""
    return re.sub(r"\s*\(\s*", "(", re.sub(r"\s+", " ", text)).strip()


def _prototype_comments() -> dict[str, str]:
    """name -> the C prototype in the comment block right above its declaration, lines joined."""
    out: dict[str, str] = {}
    lines = BINDINGS.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("@c_function("):
            continue
        j = i
        while j > 0 and lines[j - 1].startswith("#"):
            j -= 1
        name = re.match(r"def (\w+)", next(s for s in lines[i:] if s.startswith("def "))).group(1)
        out[name] = _normalised(" ".join(s.lstrip("#") for s in lines[j:i]))
    return out


def test_no_module_but_the_bindings_sets_argtypes():
    outside = [f"{p.relative_to(REPO)}:{n}" for root in (PACKAGE, REPO / "tests") for p in sorted(root.rglob("*.py"))
               if p != BINDINGS and p.name != Path(__file__).name
               for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\.(argtypes|restype)\b", line)]
    assert outside == [], f"C functions bound outside sparq_llama/_bindings.py: {outside}"


def test_each_function_declared_once_with_its_prototype():
    names = [fn.name for fn in DECLARED]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert len(names) >= 30
    protos = _prototype_comments()
    assert sorted(protos) == sorted(names)
    for name, proto in protos.items():
        assert re.search(rf"\b{name}\(", proto) and proto.endswith(";"), f"{name}: no prototype above it ({proto!r})"


def test_prototypes_are_the_headers():
    ours = _normalised(" ".join(p.read_text() for p in sorted((REPO / "ggml_ops" / "include").glob("*.h"))))
    ggml_dir = REPO / "vendor" / "llama.cpp" / "ggml" / "include"
    ggml = _normalised(" ".join(p.read_text() for p in sorted(ggml_dir.glob("*.h")))) if ggml_dir.is_dir() else None
    checked = 0
    for name, proto in _prototype_comments().items():
        header = ours if proto.startswith("SPARQ_API") else ggml
        if header is None:
            continue  # llama.cpp not fetched in this checkout
        assert proto in header, f"{name}: {proto!r} is not a prototype of the headers"
        checked += 1
    assert checked >= 25


def test_every_declared_function_is_exported():
    assert C.missing(DECLARED) == []


@pytest.mark.parametrize("fn", DECLARED, ids=lambda fn: fn.name)
def test_declaration_binds(fn):
    bound = fn.bind()
    assert tuple(bound.argtypes) == tuple(fn.argtypes)
    assert bound.restype is fn.restype
