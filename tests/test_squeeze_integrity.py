"""A saved prefix's two files carry checksums: the sidecar of each of its parts, and of the parts of the KV state file
saved with it. A damaged file, a cut-short one, or a KV state and sidecar that were not saved together are refused
before anything is applied, with the file and the part named, and the context then generates exactly what it
generated before (Python API); llama-completion stops with the same message and a non-zero exit."""
from __future__ import annotations

import re

import numpy as np
import pytest
import squeeze_files as sf
from conftest import run
from sparq_llama import Llama
from sparq_llama import squeeze as squeeze_api
from test_squeeze_decode import N_PREFIX, SETTINGS, _back_to_prefix, _greedy_after
from test_squeeze_decode import llm, toks  # noqa: F401  (the decode tests' model and text fixtures)

from llama_cpp import llama_cpp as lc  # isort: skip


@pytest.fixture(scope="module")
def question(toks) -> list[int]:
    return toks[700:716]


@pytest.fixture(scope="module")
def saved(llm, toks, tmp_path_factory):
    """A pair saved at keep 0.2 (doc.state, doc.state.squeeze) and another prefix's pair (other.state ...)."""
    d = tmp_path_factory.mktemp("saved")
    llm.prepare_fixed_context(toks[:N_PREFIX - 40], keep=0.2, **SETTINGS)
    llm.save_fixed_context(str(d / "other.state"))
    llm.prepare_fixed_context(toks[:N_PREFIX], keep=0.2, **SETTINGS)
    llm.save_fixed_context(str(d / "doc.state"))
    return d


def _layers(llm) -> list[int]:
    return list(range(lc.llama_model_n_layer(llm.model)))


class Refusals:
    """Writes bad.state and bad.state.squeeze and checks that loading them fails with the expected message."""

    def __init__(self, llm, saved, tmp_path):
        self.llm, self.tmp = llm, tmp_path
        self.state = (saved / "doc.state").read_bytes()
        self.sidecar = (saved / "doc.state.squeeze").read_bytes()
        self.path = tmp_path / "bad.state"

    def refused(self, match: str, state: bytes | None = None, sidecar: bytes | None = None) -> None:
        self.path.write_bytes(self.state if state is None else state)
        (self.tmp / "bad.state.squeeze").write_bytes(self.sidecar if sidecar is None else sidecar)
        with pytest.raises(ValueError, match=match):
            self.llm.load_fixed_context(str(self.path))


def test_saved_files_carry_the_checksums_of_their_parts(llm, saved):
    sidecar = (saved / "doc.state.squeeze").read_bytes()
    state = (saved / "doc.state").read_bytes()
    assert sf.version(sidecar) == 4
    parts = sf.parts(sidecar)
    assert len(parts) == len(sf.part_names(sidecar, _layers(llm)))
    for p in parts:  # the checksum as its definition computes it (the small parts: the Python copy is slow)
        if p.length <= 4096:
            assert sf.hash64(sidecar[p.payload:p.payload + p.length]) == p.checksum
    size, record = sf.state_record(sidecar)
    assert size == len(state)
    names = [name for name, *_ in record]
    assert names[:2] == ["header and prefix tokens", "cells"] and names[-1] == f"layer {len(_layers(llm)) - 1} V"
    assert sum(length for _, _, length, _ in record) == len(state)
    for name, offset, length, checksum in record:
        if length <= 4096:
            assert sf.hash64(state[offset:offset + length]) == checksum, name
    # the hash itself: fixed values of its definition, every tail length
    assert sf.hash64(b"") != sf.hash64(b"\0") != sf.hash64(b"\0" * 8)
    assert len({sf.hash64(bytes(range(n))) for n in range(70)}) == 70


def test_damaged_or_mismatched_files_are_refused_and_the_context_is_unchanged(llm, toks, question, saved, tmp_path):
    # the context holds another preparation (keep 0.1) than the files (0.2): a load, even a partial one, would show
    info = llm.prepare_fixed_context(toks[:N_PREFIX], keep=0.1, **SETTINGS)
    want = _greedy_after(llm, question, 4)
    _back_to_prefix(llm, N_PREFIX)
    r = Refusals(llm, saved, tmp_path)

    def unchanged() -> None:
        now = llm.fixed_context
        assert now.prepared and (now.keep, now.n_prefix) == (info.keep, info.n_prefix)
        got = _greedy_after(llm, question, 4)
        _back_to_prefix(llm, N_PREFIX)
        assert got[0] == want[0] and np.array_equal(got[1], want[1])

    # 4 KB overwritten in the middle of either file: a K or V layer of the state, some table of the sidecar
    r.refused(r"bad\.state: layer \d+ [KV] checksum mismatch \(file damaged", state=sf.overwrite_middle(r.state))
    r.refused(r"bad\.state\.squeeze: .+ checksum mismatch \(file damaged\)", sidecar=sf.overwrite_middle(r.sidecar))
    unchanged()
    # one byte flipped in each part of the sidecar: that part named
    for p, name in zip(sf.parts(r.sidecar), sf.part_names(r.sidecar, _layers(llm))):
        if p.length:
            r.refused(rf"bad\.state\.squeeze: {re.escape(name)} checksum mismatch",
                      sidecar=sf.flip(r.sidecar, p.payload + p.length // 2))
    unchanged()
    # ... and in each part of the KV state (its tokens: not the prefix the sidecar holds)
    for name, offset, length, _ in sf.state_record(r.sidecar)[1]:
        expect = ("holds other tokens than the prefix" if name == "header and prefix tokens"
                  else rf"bad\.state: {re.escape(name)} checksum mismatch")
        r.refused(expect, state=sf.flip(r.state, offset + length // 2))
    unchanged()
    # cut short, extended, framing damaged
    r.refused(r"bad\.state has \d+ bytes where .*bad\.state\.squeeze records", state=r.state[:-1])
    r.refused(r"bad\.state has \d+ bytes where", state=r.state + b"\0" * 8)
    r.refused(r"bad\.state\.squeeze: .+ is cut short", sidecar=r.sidecar[:len(r.sidecar) // 2])
    r.refused(r"bad\.state\.squeeze has bytes after its last part", sidecar=r.sidecar + b"\0")
    r.refused(r"bad\.state\.squeeze: layer count (checksum mismatch|is cut short)",
              sidecar=sf.flip(r.sidecar, sf.parts(r.sidecar)[2].at))  # its length field
    # a KV state and a sidecar that were not saved together (another prefix), either way round
    other_state = (saved / "other.state").read_bytes()
    other_sidecar = (saved / "other.state.squeeze").read_bytes()
    r.refused("bad.state holds other tokens than the prefix .* was saved with", state=other_state)
    r.refused("bad.state holds other tokens than the prefix .* was saved with", sidecar=other_sidecar)
    unchanged()
    # the good pair loads, as saved
    loaded = llm.load_fixed_context(str(saved / "doc.state"))
    assert loaded.prepared and loaded.keep == pytest.approx(0.2) and loaded.keep != info.keep


def test_a_version_3_sidecar_still_loads_unverified(llm, toks, question, saved, tmp_path):
    # the previous format (no checksums) is read as before; the pair then answers as the current format's does
    llm.load_fixed_context(str(saved / "doc.state"))
    want = _greedy_after(llm, question, 3)
    old = tmp_path / "old.state"
    old.write_bytes((saved / "doc.state").read_bytes())
    (tmp_path / "old.state.squeeze").write_bytes(sf.as_version_3((saved / "doc.state.squeeze").read_bytes()))
    llm.load_fixed_context(str(old))
    got = _greedy_after(llm, question, 3)
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


def test_a_sidecar_alone_is_verified_too(llm, toks, saved):
    # llama_squeeze_load (the sidecar over a cache that holds the prefix) checks its parts before replacing anything
    llm.load_fixed_context(str(saved / "doc.state"))
    before = llm.fixed_context
    bad = sf.overwrite_middle((saved / "doc.state.squeeze").read_bytes())
    path = saved / "alone.squeeze"
    path.write_bytes(bad)
    with pytest.raises(ValueError, match=r"alone\.squeeze: .+ checksum mismatch"):
        squeeze_api.load(llm.ctx, str(path), toks[:N_PREFIX])
    assert llm.fixed_context == before


GEN = ["-no-cnv", "--temp", "0", "-n", "4", "-t", "2", "-c", "2048", "-p", "\nQuestion: What is the number?"]


def test_the_cli_refuses_damaged_files(smollm2_path, document, tmp_path):
    state = tmp_path / "doc.state"
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "--squeeze", "--squeeze-prefix-file", document,
               "--squeeze-save", str(state)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    good_state, good_sidecar = state.read_bytes(), (tmp_path / "doc.state.squeeze").read_bytes()
    cases = [
        (sf.overwrite_middle(good_state), good_sidecar, r"doc\.state: layer \d+ [KV] checksum mismatch"),
        (good_state, sf.overwrite_middle(good_sidecar), r"doc\.state\.squeeze: .+ checksum mismatch"),
        (good_state[:-100], good_sidecar, r"doc\.state has \d+ bytes where"),
    ]
    for bad_state, bad_sidecar, expect in cases:
        state.write_bytes(bad_state)
        (tmp_path / "doc.state.squeeze").write_bytes(bad_sidecar)
        res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "--squeeze", "--squeeze-load", str(state)],
                  timeout=300)
        assert res.returncode != 0, expect
        assert "failed to load the prepared prefix" in res.stderr
        assert re.search(expect, res.stderr), res.stderr[-2000:]
    state.write_bytes(good_state)
    (tmp_path / "doc.state.squeeze").write_bytes(good_sidecar)
    res = run(["llama-completion", "-m", str(smollm2_path), *GEN, "--squeeze", "--squeeze-load", str(state)],
              timeout=300)
    assert res.returncode == 0 and "loaded a prepared prefix" in res.stderr, res.stderr[-2000:]
