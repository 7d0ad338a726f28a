"""bench/cuda_op_profile.py's summary of saved Nsight Compute text output: each launch's metrics read with ncu's units
and thousands separators (and the advice and table lines around them skipped), the last launch of each kernel kept,
the SparQ op's and flash attention's times summed, against values worked out by hand; bad input fails with a
message."""
from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, run

TOOL = REPO / "bench" / "cuda_op_profile.py"

RULE = "    ----------------------- ----------- ------------"


def kernel(name: str, grid: str, duration: str, unit: str, dram: float, gbps: str, rate_unit: str, warps: float,
           issue: float) -> list[str]:
    """One kernel's report as ncu prints it (a subset of its sections, with an advice paragraph)."""
    return [
        f"  {name} {grid}x(256, 1, 1), Context 1, Stream 14, Device 0, CC 9.0",
        "    Section: GPU Speed Of Light Throughput", RULE,
        "    Metric Name             Metric Unit Metric Value", RULE,
        "    SM Frequency                    Ghz         1.44",
        "    Elapsed Cycles                cycle       26,969",
        "    Memory Throughput                 %        30.83",
        f"    DRAM Throughput                   %        {dram:.2f}",
        f"    Duration                         {unit}        {duration}",
        "    Compute (SM) Throughput           %        35.91", RULE,
        "    OPT   This kernel grid is too small to fill the available resources on this device, resulting in only 0.5 full",
        "          waves across all SMs. Look at Launch Statistics for more details.", "",
        "    Section: Memory Workload Analysis", RULE,
        "    Metric Name                            Metric Unit Metric Value", RULE,
        "    Local Memory Spilling Requests                                0",
        f"    Memory Throughput                      {rate_unit}       {gbps}",
        "    L2 Hit Rate                                      %        44.85", RULE, "",
        "    Section: Launch Statistics", RULE,
        "    Block Size                                                   256",
        "    Grid Size                                                    128",
        "    Registers Per Thread             register/thread             123", RULE, "",
        "    Section: Occupancy", RULE,
        "    Achieved Occupancy                        %        12.07",
        f"    Achieved Active Warps Per SM           warp         {warps:.2f}", RULE, "",
        "    Section: Scheduler Statistics", RULE,
        f"    Issued Warp Per Scheduler                        {issue:.2f}", RULE, "",
        "    Section: Warp State Statistics", RULE,
        "    Warp Cycles Per Issued Instruction             cycle        17.49",
        "    Warp Cycles Per Executed Instruction           cycle        17.50", RULE, "",
        "    Section: Instruction Statistics", RULE,
        "    Avg. Executed Instructions Per Scheduler        inst     9,581.09",
        "    Executed Instructions                           inst    5,058,688",
        "    Issued Instructions                             inst    5,058,731", RULE, "",
    ]


Q = "void <unnamed>::sparq_query<1>(<unnamed>::sparq_args, <unnamed>::sparq_scratch, long)"
A = "void <unnamed>::sparq_scores<block_q8_0, 1, 1>(<unnamed>::sparq_args, <unnamed>::sparq_scratch, long)"
FA = "void flash_attn_ext_vec<128, 1, 1, 1, 0>(const char *, const char *, float, int, long)"


def op_call(first: bool) -> list[str]:
    """One op call and one flash-attention call; the first (warm-up) call's times differ from the second's."""
    return [*kernel(Q, "(32, 1, 1)", "12.00" if first else "9.92", "us", 0.3, "9.23", "Gbyte/s", 7.9, 0.2),
            *kernel(A, "(4, 32, 1)", "19,500" if first else "18,560", "ns", 20.13, "966.54", "Gbyte/s", 7.72, 0.44),
            *kernel(FA, "(1, 12, 32)", "38.00" if first else "37.25", "us", 76.31, "3.82", "Tbyte/s", 11.25, 0.27)]


def write_saved(tmp_path, text: str | None = None):
    d = tmp_path / "out"
    d.mkdir()
    if text is None:
        text = "\n".join(["==PROF== Connected to process 1", "  Device 0: NVIDIA H200, compute capability 9.0",
                          '{"S": 8192, "B": 1}', "[1] python3.12@127.0.0.1", *op_call(True), *op_call(False)]) + "\n"
    (d / "llama2-7b_8192.txt").write_text(text)
    meta = {"bench": "cuda_op_profile", "git": {"commit": "abc1234"}, "gpu": {"gpus": [{"name": "test"}]},
            "ncu_commands": {}, "params": {"heads": ["llama2-7b"], "seqs": [8192]}}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def summarise(tmp_path, text_dir):
    out = tmp_path / "rec.json"
    res = run([sys.executable, str(TOOL), "--from-text", str(text_dir), "--out", str(out)], timeout=120)
    return res, (json.loads(out.read_text()) if out.exists() else None)


def test_last_launch_per_kernel_with_units_and_sums(tmp_path):
    res, rec = summarise(tmp_path, write_saved(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert rec["git"]["commit"] == "abc1234"
    (row,) = rec["rows"]
    assert (row["heads"], row["S"], row["B"]) == ("llama2-7b", 8192, 1)
    names = [k["name"] for k in row["kernels"]]
    assert names == ["sparq_query<1>", "sparq_scores<block_q8_0, 1, 1>", "flash_attn_ext_vec<128, 1, 1, 1, 0>"]
    q, a, fa = row["kernels"]
    assert q["us"] == pytest.approx(9.92) and a["us"] == pytest.approx(18.56) and fa["us"] == pytest.approx(37.25)
    assert a["mem_gbps"] == pytest.approx(966.54) and fa["mem_gbps"] == pytest.approx(3820.0)
    assert a["dram_pct"] == pytest.approx(20.13) and a["sm_pct"] == pytest.approx(35.91)
    assert a["grid"] == 128 and a["registers"] == 123 and a["sm_ghz"] == pytest.approx(1.44)
    assert a["warps_per_sm"] == pytest.approx(7.72) and a["issue_per_cycle"] == pytest.approx(0.44)
    assert a["occupancy_pct"] == pytest.approx(12.07)
    # 5,058,688 instructions over 128 blocks of 8 warps; the per-issue wait, not the per-execution one
    assert a["instructions"] == 5058688 and a["instructions_per_warp"] == pytest.approx(5058688 / 1024)
    assert a["cycles_per_issue"] == pytest.approx(17.49)
    assert row["sparq_us"] == pytest.approx(9.92 + 18.56) and row["flash_us"] == pytest.approx(37.25)
    assert len(rec["raw"]["llama2-7b_8192"]) == 6  # every launch, the warm-up call's too


def test_output_without_kernels_fails_with_a_message(tmp_path):
    res, rec = summarise(tmp_path, write_saved(tmp_path, "==PROF== Connected to process 1\nno kernels matched\n"))
    assert res.returncode != 0 and rec is None
    assert "no profiled kernel" in res.stderr


def test_unknown_heads_are_refused(tmp_path):
    res = run([sys.executable, str(TOOL), "--heads", "gpt-9", "--from-text", str(tmp_path)], timeout=60)
    assert res.returncode == 2 and "unknown gpt-9" in res.stderr
