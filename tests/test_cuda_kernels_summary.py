"""bench/cuda_kernels.py's summary of saved Nsight Compute output: kernel names shortened, times read with ncu's
units and thousands separators, the last decode token found as the repeating run at the end of the launches, and the
attention kernels summed per layer, against values worked out by hand; bad input fails with a message."""
from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, run

TOOL = REPO / "bench" / "cuda_kernels.py"
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

# one decode token of a 2-layer model: (kernel name as ncu prints it, nanoseconds)
LAYER_DENSE = [("void rope_norm<1, 0, float, float>(const T3 *, T4 *, int)", 3000),
               ("void rope_norm<1, 0, float, __half>(const T3 *, T4 *, int)", 3200),
               ("void k_set_rows<float, long, __half>(const T1 *, const T2 *)", 3100),
               ("void flash_attn_ext_vec<128, 1, 1, 1, 0>(const char *, const char *)", 49000),
               ("void mul_mat_vec_q<8, 1, 0, 0, 0>(const void *, const void *)", 12000)]
LAYER_SPARQ = [("void rope_norm<1, 0, float, float>(const T3 *, T4 *, int)", 3000),
               ("void rope_norm<1, 0, float, float>(const T3 *, T4 *, int)", 3000),
               ("void k_set_rows<float, long, __half>(const T1 *, const T2 *)", 3400),
               ("void k_set_rows<float, long, __half>(const T1 *, const T2 *)", 3400),
               ("void <unnamed>::upkeep_kernel<1, 8>(<unnamed>::upkeep_args)", 10450),
               ("void <unnamed>::sparq_query<1>(<unnamed>::sparq_args, <unnamed>::sparq_scratch, long)", 7900),
               ("void <unnamed>::sparq_scores<block_q8_0, 1, 1>(<unnamed>::sparq_args, long)", 19500),
               ("void <unnamed>::sparq_pbs<8>(<unnamed>::sparq_args, <unnamed>::sparq_scratch, long)", 19700),
               ("void <unnamed>::sparq_logits_values<__half, 1, 32>(<unnamed>::sparq_args, long)", 11400),
               ("void mul_mat_vec_q<8, 1, 0, 0, 0>(const void *, const void *)", 12000)]
EMBED = ("void k_get_rows_float<float, float>(const T1 *, const int *)", 3500)
OUTPUT = ("void mul_mat_vec_q<8, 1, 1, 0, 0>(const void *, const void *)", 50000)


def token(layer):
    return [EMBED, *layer, *layer, OUTPUT]


def ncu_csv(launches) -> str:
    """ncu --csv output with the profiled program's own lines around and inside it, times in ns with separators."""
    rows = [f'"{i}","1","llama-bench","127.0.0.1","{name}","1","14","(128, 1, 1)","(32, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","ns","{ns:,}"' for i, (name, ns) in enumerate(launches)]
    return "\n".join(["==PROF== Connected to process 1", "| model | size |", HEADER, *rows[:3],
                      "| llama 7B Q8_0 | tg3 | 12.0 |", *rows[3:], "==PROF== Disconnected"]) + "\n"


def write_saved(tmp_path, layers: int = 2):
    d = tmp_path / "csv"
    d.mkdir()
    prefill = [("void mul_mat_q<8>(const char *)", 900000), ("void flash_attn_ext_f16<128>(const char *)", 70000)]
    for mode, layer in (("dense", LAYER_DENSE), ("sparq", LAYER_SPARQ)):
        (d / f"llama2-7b_{mode}.csv").write_text(ncu_csv(prefill * 3 + token(layer) * 4))
    meta = {"bench": "cuda_kernels", "git": {"commit": "abc1234"}, "gpu": {"gpus": [{"name": "test"}]},
            "ncu_commands": {}, "params": {"shapes": ["llama2-7b"], "layers": layers, "depth": 8192}}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def summarise(tmp_path, csv_dir):
    out = tmp_path / "rec.json"
    res = run([sys.executable, str(TOOL), "--from-csv", str(csv_dir), "--out", str(out)], timeout=120)
    return res, (json.loads(out.read_text()) if out.exists() else None)


def test_last_token_per_kernel_and_attention_per_layer(tmp_path):
    res, rec = summarise(tmp_path, write_saved(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert rec["git"]["commit"] == "abc1234" and rec["params"]["layers"] == 2
    rows = {r["mode"]: r for r in rec["rows"]}
    dense, sparq = rows["dense"], rows["sparq"]
    # one token: the embedding, two layers, the output
    assert dense["token_us"] == pytest.approx((3500 + 2 * sum(ns for _, ns in LAYER_DENSE) + 50000) / 1e3)
    assert sparq["token_us"] == pytest.approx((3500 + 2 * sum(ns for _, ns in LAYER_SPARQ) + 50000) / 1e3)
    # attention per layer: everything but the matmul
    assert dense["attention_per_layer_us"] == pytest.approx((3000 + 3200 + 3100 + 49000) / 1e3)
    assert dense["attention_kernels_per_layer"] == 4
    assert sparq["attention_per_layer_us"] == pytest.approx(
        (2 * 3000 + 2 * 3400 + 10450 + 7900 + 19500 + 19700 + 11400) / 1e3)
    assert sparq["attention_kernels_per_layer"] == 9
    k = {x["name"]: x for x in sparq["kernels"]}
    assert k["rope_norm<1, 0, float, float>"]["launches"] == 4
    assert k["rope_norm<1, 0, float, float>"]["mean_us"] == pytest.approx(3.0)
    assert k["sparq_pbs<8>"]["total_us"] == pytest.approx(2 * 19.7)
    assert "upkeep_kernel<1, 8>" in k and "k_get_rows_float<float, float>" in k
    assert rec["raw"]["llama2-7b_sparq"]["launches_profiled"] == 6 + 4 * len(token(LAYER_SPARQ))
    assert len(rec["raw"]["llama2-7b_sparq"]["last_token"]) == len(token(LAYER_SPARQ))
    assert "attention" in res.stdout and "sparq_pbs<8>" in res.stdout


def test_output_without_a_repeating_step_fails_clearly(tmp_path):
    d = write_saved(tmp_path)
    (d / "llama2-7b_sparq.csv").write_text(ncu_csv(token(LAYER_SPARQ)))  # a single token: nothing repeats
    res, rec = summarise(tmp_path, d)
    assert res.returncode != 0 and rec is None
    assert "no repeating decode step" in res.stderr


def test_output_without_an_ncu_table_fails_clearly(tmp_path):
    d = write_saved(tmp_path)
    (d / "llama2-7b_dense.csv").write_text("llama-bench: error: unknown argument\n")
    res, rec = summarise(tmp_path, d)
    assert res.returncode != 0 and rec is None
    assert "no ncu CSV table" in res.stderr


def test_bad_arguments_fail_clearly(tmp_path):
    res = run([sys.executable, str(TOOL), "--shapes", "llama9"], timeout=60)
    assert res.returncode == 2 and "unknown llama9" in res.stderr
    res = run([sys.executable, str(TOOL)], timeout=60)
    assert res.returncode == 2 and "--bin is required" in res.stderr
