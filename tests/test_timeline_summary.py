"""bench/timeline_summary.py: the medians of the CUDA SparQ op's kernel timeline (SPARQ_CUDA_TIMELINE lines), the
hand-over gaps and the bodies, against values worked out by hand from a log with a missing mark and stray lines."""
from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, run

TOOL = REPO / "bench" / "timeline_summary.py"

HEADER = "sparq timeline n_kv {n} rows {r} (us: start / past wait / end):"
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
