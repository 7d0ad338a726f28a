"""llama-bench's centroid-sparse sweep (-squeeze-keep, -squeeze-centroids, -squeeze-var, -squeeze-init): the -d prefix is prepared once per
test and stays prepared over the repetitions; bad values fail clearly before any test runs."""
from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, run

from sparq_llama.eval import random_gguf


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return random_gguf.write_model(random_gguf.SHAPES["tiny"], tmp_path_factory.mktemp("m") / "tiny.gguf",
                                   REPO / "vendor" / "llama.cpp" / "models")


def test_keep_sweep_prepares_the_depth_once_and_keeps_it(tiny_model):
    res = run(["llama-bench", "-m", str(tiny_model), "-p", "8", "-n", "4", "-d", "400", "-r", "3", "-t", "2",
               "-squeeze-keep", "0,0.5,0.2", "-squeeze-centroids", "0.1", "-o", "json", "-v"], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    # dense once (the cluster count changes nothing without a prefix), then pp and tg per keep
    assert sorted((r["squeeze_keep"], r["n_prompt"], r["n_gen"]) for r in rows) == [
        (0.0, 0, 4), (0.0, 8, 0), (0.2, 0, 4), (0.2, 8, 0), (0.5, 0, 4), (0.5, 8, 0)]
    assert all(r["n_depth"] == 400 and r["avg_ts"] > 0 and len(r["samples_ns"]) == 3 for r in rows)
    assert all(r["squeeze_centroids"] == pytest.approx(0.1) for r in rows if r["squeeze_keep"] > 0)
    # prepared once per sparse test (four), never dropped by the repetitions' removals after the prefix
    assert res.stderr.count("centroid-sparse prefix prepared in") == 4, res.stderr[-3000:]
    assert "dropped" not in res.stderr
    assert res.stderr.count("centroid-sparse prefix of sequence 0: 400 tokens") == 4


def test_var_sweep_reaches_the_kept_rule(tiny_model):
    # -squeeze-var 0,1: one test per kept rule with a prefix, dense once; each preparation logs the rule it was given
    res = run(["llama-bench", "-m", str(tiny_model), "-p", "0", "-n", "2", "-d", "400", "-r", "1", "-t", "2",
               "-squeeze-keep", "0,0.2", "-squeeze-centroids", "0.1", "-squeeze-var", "0,1", "-o", "json", "-v"],
              timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    assert sorted((r["squeeze_keep"], r["squeeze_var"]) for r in rows) == [(0.0, 0.0), (0.2, 0.0), (0.2, 1.0)]
    rules = re.findall(r"centroid-sparse prefix of sequence 0: 400 tokens .*? keep 0.2, var_weight (\S+)\n", res.stderr)
    assert sorted(rules) == ["0", "1"], res.stderr[-3000:]


def test_init_sweep_reaches_the_clustering(tiny_model):
    # -squeeze-init even,kpp: one test per seeding with a prefix, dense once; each preparation logs the seeding it ran
    res = run(["llama-bench", "-m", str(tiny_model), "-p", "0", "-n", "2", "-d", "400", "-r", "1", "-t", "2",
               "-squeeze-keep", "0,0.2", "-squeeze-centroids", "0.1", "-squeeze-init", "even,kpp", "-o", "json", "-v",
               "--progress"], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    assert sorted((r["squeeze_keep"], r["squeeze_init"]) for r in rows) == [(0.0, "even"), (0.2, "even"), (0.2, "kpp")]
    assert "init even)" in res.stderr and "init kpp)" in res.stderr, res.stderr[-3000:]
    seeds = re.findall(r"centroid-sparse prefix of sequence 0: 400 tokens .*?, (\S+) seeds\)", res.stderr)
    assert sorted(seeds) == ["even", "k-means++"], res.stderr[-3000:]


@pytest.mark.parametrize("args, message", [
    (["-squeeze-keep", "0.1", "-p", "0", "-n", "4"], "-squeeze-keep needs a prefix to cluster"),
    (["-squeeze-keep", "1.5", "-d", "64"], "invalid parameter for argument: -squeeze-keep"),
    (["-squeeze-keep", "abc", "-d", "64"], "invalid parameter for argument: -squeeze-keep"),
    (["-squeeze-keep", "0.1", "-squeeze-centroids", "0", "-d", "64"], "invalid parameter for argument: -squeeze-centroids"),
    (["-squeeze-keep", "0.1", "-squeeze-var", "101", "-d", "64"], "invalid parameter for argument: -squeeze-var"),
    (["-squeeze-keep", "0.1", "-squeeze-var", "-1", "-d", "64"], "invalid parameter for argument: -squeeze-var"),
    (["-squeeze-keep", "0.1", "-squeeze-init", "kmeans++", "-d", "64"], "invalid parameter for argument: -squeeze-init"),
    (["-squeeze-keep", "0.1", "-squeeze-init", "even,", "-d", "64"], "invalid parameter for argument: -squeeze-init"),
])
def test_bad_squeeze_values_fail_before_any_test(tiny_model, args, message):
    res = run(["llama-bench", "-m", str(tiny_model), "-r", "1", "-t", "1", *args], timeout=120)
    assert res.returncode == 1
    assert message in res.stderr + res.stdout
    # no result row (the table's header may be printed before the settings are checked)
    assert [line for line in res.stdout.splitlines() if line.startswith("| ") and not line.startswith(("| model", "| -"))] == []
