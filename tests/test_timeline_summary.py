"""bench/timeline_summary.py: the medians of the CUDA SparQ op's kernel timeline (SPARQ_CUDA_TIMELINE lines), the
hand-over gaps and the bodies, against values worked out by hand from a log with a missing mark and stray lines."""
from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, run

TOOL = REPO / "bench" / "timeline_summary.py"

HEADER = "sparq timeline n_kv {n} rows {r} (us: start / past wait / end):"
HEADER4 = "sparq timeline n_kv {n} rows {r} (us: start / past wait / end / last start):"  # with the last block start


def log4(n: int, r: int, *lines: str) -> str:
    """A log of four-mark lines for n cells and r rows."""
    return "\n".join(HEADER4.format(n=n, r=r) + line for line in lines)
LOG = "\n".join([
    "      S   B  sparq us  flash us",  # the benchmark's own output around the lines
    HEADER.format(n=32768, r=32) + " Q 0.00 1.00 5.00; A - - 40.00; P 38.00 41.00 50.00; B 45.00 51.00 60.00;"
                                   " S 55.00 61.00 72.00; LV 70.00 73.00 85.00;",
    HEADER.format(n=32768, r=32) + " Q 0.00 2.00 7.00; A - - 44.00; P 38.00 45.00 52.00; B 45.00 53.00 64.00;"
                                   " S 55.00 65.00 74.00; LV 70.00 75.00 87.00;",
    HEADER.format(n=32768, r=32) + " Q 0.00 3.00 6.00; A - - 42.00; P 38.00 43.00 54.00; B 45.00 55.00 62.00;"
                                   " S 55.00 63.00 76.00; LV 70.00 77.00 86.00;",
    HEADER.format(n=4096, r=8) + " A - - 10.00; P 9.00 10.50 20.00;",  # no kernel Q (another policy)
    '{"S": 32768, "B": 1, "sparq_us": 99.0}',
])


def summarise(tmp_path, log: str) -> tuple[dict, str]:
    """The tool's JSON (per "n_kv/rows": runs and per-kernel medians) and its printed table, for this log."""
    path, out = tmp_path / "timeline.log", tmp_path / "t.json"
    path.write_text(log)
    res = run([sys.executable, str(TOOL), str(path), "--json", str(out)], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(out.read_text()), res.stdout


def test_medians_gaps_and_bodies(tmp_path):
    data, _ = summarise(tmp_path, LOG)
    assert sorted(data) == ["32768/32", "4096/8"]
    assert data["32768/32"]["runs"] == 3
    k = data["32768/32"]["kernels"]
    assert k["Q"] == {"start": 0.0, "waited": 2.0, "end": 6.0}  # the first kernel: no gap, no body
    assert k["A"] == {"end": 42.0, "body": pytest.approx(36.0)}  # no start marks: end minus Q's end (35, 37, 36)
    # P: past its wait minus A's end (1, 1, 1); end minus the later of the two (9, 7, 11)
    assert k["P"]["gap"] == pytest.approx(1.0) and k["P"]["body"] == pytest.approx(9.0)
    assert k["B"]["gap"] == pytest.approx(1.0) and k["B"]["body"] == pytest.approx(9.0)  # 9, 11, 7
    assert k["S"]["end"] == 74.0
    assert k["LV"]["end"] == 86.0 and k["LV"]["body"] == pytest.approx(12.0)  # 12, 12, 9
    short = data["4096/8"]["kernels"]
    assert set(short) == {"A", "P"} and short["P"]["body"] == pytest.approx(9.5)


def test_table_output(tmp_path):
    _, printed = summarise(tmp_path, LOG)
    assert "n_kv 4096, rows 8, 1 runs" in printed and "n_kv 32768, rows 32, 3 runs" in printed


def test_the_pbs_chain_hands_over_from_kernel_a(tmp_path):
    # kernel PBS replaces P, B and S; its predecessor is kernel A, LV's is PBS
    data, _ = summarise(tmp_path, "\n".join(HEADER.format(n=32768, r=32) + line for line in (
        " Q 0.00 0.40 4.70; A - - 46.50; PBS 45.90 47.10 81.90; LV 48.20 82.30 91.00;",
        " Q 0.00 0.40 4.60; A - - 46.00; PBS 45.00 46.50 80.00; LV 47.00 80.50 90.00;",
        " Q 0.00 0.40 4.80; A - - 47.00; PBS 46.00 47.50 84.00; LV 49.00 84.60 92.00;")))
    k = data["32768/32"]["kernels"]
    assert set(k) == {"Q", "A", "PBS", "LV"}
    assert k["PBS"]["gap"] == pytest.approx(0.5)  # 0.6, 0.5, 0.5
    assert k["PBS"]["body"] == pytest.approx(34.8)  # 34.8, 33.5, 36.5
    assert k["LV"]["gap"] == pytest.approx(0.5) and k["LV"]["body"] == pytest.approx(8.7)  # 8.7, 9.5, 7.4


def test_the_last_block_start(tmp_path):
    # lines with the fourth mark (the last block's start); the chain's hand-over and bodies are read as before
    data, printed = summarise(tmp_path, log4(
        33024, 32,
        " Q 0.00 0.40 4.70 1.00; A - - 46.50 -; PBS 45.90 47.10 81.90 52.00; LV 48.20 82.30 91.00 83.00;",
        " Q 0.00 0.40 4.60 1.20; A - - 46.00 -; PBS 45.00 46.50 80.00 55.00; LV 47.00 80.50 90.00 81.00;",
        " Q 0.00 0.40 4.80 0.80; A - - 47.00 -; PBS 46.00 47.50 84.00 50.00; LV 49.00 84.60 92.00 85.50;"))
    k = data["33024/32"]["kernels"]
    assert k["PBS"]["last_start"] == pytest.approx(52.0) and k["Q"]["last_start"] == pytest.approx(1.0)
    assert "last_start" not in k["A"] and k["A"]["end"] == pytest.approx(46.5)
    assert k["PBS"]["body"] == pytest.approx(34.8) and k["LV"]["last_start"] == pytest.approx(83.0)
    assert "   last" in printed and "  52.00" in printed


def test_a_chain_without_kernel_q(tmp_path):
    # the q4 index has no kernel Q: the earliest recorded start is PBS's, so kernel A's end comes out negative
    data, _ = summarise(tmp_path, log4(
        33024, 8,
        " A - - -0.90 -; PBS 0.00 0.03 25.68 0.16; LV 26.79 26.80 35.24 26.95;",
        " A - - -1.10 -; PBS 0.00 0.04 25.20 0.20; LV 26.30 26.32 34.90 26.50;",
        " A - - -0.70 -; PBS 0.00 0.02 26.10 0.12; LV 27.20 27.21 35.80 27.40;"))
    k = data["33024/8"]["kernels"]
    assert k["A"] == {"end": pytest.approx(-0.9)}
    assert k["PBS"]["gap"] == pytest.approx(0.93) and k["PBS"]["body"] == pytest.approx(25.65)  # 25.65, 25.16, 26.08
    assert k["LV"]["body"] == pytest.approx(8.58)  # 8.44, 8.58, 8.59
