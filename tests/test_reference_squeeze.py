"""The float64 reference of centroid-sparse attention, clustering and calibration (sparq_llama.reference_squeeze),
checked against dense attention, a brute-force selection written out here, and synthetic clusters."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from sparq_llama.reference import dense_attn
from sparq_llama.reference_squeeze import (
    calibrate_threshold,
    centroid_attn,
    group_scores,
    kept_fraction,
    kmeans_cosine,
    kpp_seed_rows,
    kpp_uniform,
)


def blobs(rng: np.random.Generator, n_blobs: int, per_blob: int, d: int, spread: float = 0.05):
    """Keys around n_blobs random directions (with random norms), and their true blob of each key."""
    centres = rng.standard_normal((n_blobs, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    truth = np.repeat(np.arange(n_blobs), per_blob)
    keys = centres[truth] + spread * rng.standard_normal((truth.size, d))
    keys *= rng.uniform(0.5, 3.0, size=(truth.size, 1))
    perm = rng.permutation(truth.size)
    return keys[perm], truth[perm]


def clustered_case(rng: np.random.Generator, n_head: int, n_head_kv: int, n_kv: int, n_prefix: int, d: int,
                   n_cent: int):
    q = rng.standard_normal((n_head, 3, d))
    k = rng.standard_normal((n_head_kv, n_kv, d))
    v = rng.standard_normal((n_head_kv, n_kv, d))
    cent = np.zeros((n_head_kv, n_cent, d))
    sizes = np.zeros((n_head_kv, n_cent), dtype=np.int64)
    cc = np.full((n_head_kv, n_kv), -1, dtype=np.int64)
    for h in range(n_head_kv):
        cl = kmeans_cosine(k[h, :n_prefix], n_cent)
        cent[h], sizes[h], cc[h, :n_prefix] = cl.centroids, cl.sizes, cl.assignment
    return q, k, v, cent, sizes, cc


def brute_selection(q, k, cent, sizes, cc, keep, vis, group):
    """Selected cells per (KV head, row), written out loop by loop from the definition."""
    n_head, n_q, d = q.shape
    n_head_kv, n_kv, _ = k.shape
    G = n_head // n_head_kv
    sel = {}
    for h, t in itertools.product(range(n_head_kv), range(n_q)):
        s = np.zeros(cent.shape[1])
        for g in range(G):
            z = [q[h*G + g, t] @ cent[h, i] / math.sqrt(d) for i in range(cent.shape[1])]
            norm = sum(sizes[h, j] * math.exp(z[j]) for j in range(len(z)) if sizes[h, j] > 0)
            sg = [math.exp(z[i]) / norm if sizes[h, i] > 0 else 0.0 for i in range(len(z))]
            s = np.maximum(s, sg) if group == "max" else s + np.array(sg) / G
        live = [i for i in range(len(s)) if sizes[h, i] > 0]
        budget = max(1, math.ceil(np.float32(keep) * np.float32(sizes[h].sum())))
        kept, before = set(), 0
        for i in sorted(live, key=lambda i: (-s[i], i)):
            if before >= budget:
                break
            kept.add(i)
            before += sizes[h, i]
        sel[h, t] = [j for j in range(n_kv) if vis[t, j] and (cc[h, j] < 0 or cc[h, j] in kept)]
    return sel


@pytest.mark.parametrize("group", ["max", "mean"])
@pytest.mark.parametrize("seed", range(6))
def test_selection_and_output_match_brute_force(seed: int, group: str) -> None:
    rng = np.random.default_rng(seed)
    n_head, n_head_kv = [(4, 4), (8, 2), (6, 1)][seed % 3]
    q, k, v, cent, sizes, cc = clustered_case(rng, n_head, n_head_kv, 90, 70, 16, 7)
    vis = rng.random((3, 90)) > 0.2
    keep = 0.3
    out, sel = centroid_attn(q, k, v, cent, sizes, cc, keep, vis, group=group, return_selection=True)
    want = brute_selection(q, k, cent, sizes, cc, keep, vis, group)
    G = n_head // n_head_kv
    for h, t in itertools.product(range(n_head_kv), range(3)):
        assert sel[h][t].tolist() == want[h, t]
        cells = np.array(want[h, t])
        m = np.zeros((1, cells.size), dtype=bool) | True
        dense = dense_attn(q[h*G:(h + 1)*G, t:t + 1], k[h:h + 1, cells], v[h:h + 1, cells], m)
        np.testing.assert_allclose(out[h*G:(h + 1)*G, t], dense[:, 0], rtol=1e-12, atol=1e-12)
    # a small keep really drops cells
    assert sum(len(want[key]) for key in want) < vis.sum() * n_head_kv


@pytest.mark.parametrize("keep", [0.05, 0.1, 0.2, 0.5])
def test_budget_reads_keep_of_the_clustered_cells(keep: float) -> None:
    rng = np.random.default_rng(5)
    q, k, v, cent, sizes, cc = clustered_case(rng, 8, 2, 420, 400, 16, 40)
    _, sel = centroid_attn(q, k, v, cent, sizes, cc, keep, return_selection=True)
    budget = math.ceil(np.float32(keep) * np.float32(400))
    for h in range(2):
        for t in range(3):
            cells = sel[h][t]
            clustered = cells[cc[h, cells] >= 0]
            kept = set(cc[h, clustered].tolist())
            s = group_scores(q[h*4:(h + 1)*4, t], cent[h], sizes[h], 0.25)
            last = min(kept, key=lambda i: (s[i], -i))  # the boundary: the last kept in the order
            # the kept clusters reach the budget, and without the boundary they do not
            assert clustered.size >= budget > clustered.size - sizes[h, last]
            # every kept cluster scores at least every dropped one
            dropped = [i for i in range(40) if sizes[h, i] > 0 and i not in kept]
            assert all(s[i] <= s[last] for i in dropped)
            assert set(range(400, 420)) <= set(cells.tolist())


def test_keep_one_is_dense() -> None:
    rng = np.random.default_rng(1)
    q, k, v, cent, sizes, cc = clustered_case(rng, 8, 2, 120, 100, 32, 10)
    mask = rng.random((3, 120)) > 0.3
    out = centroid_attn(q, k, v, cent, sizes, cc, 1.0, mask, softcap=5.0)
    np.testing.assert_allclose(out, dense_attn(q, k, v, mask, softcap=5.0), rtol=1e-12, atol=1e-12)


def test_unclustered_cells_are_always_read_and_best_cluster_kept() -> None:
    rng = np.random.default_rng(2)
    q, k, v, cent, sizes, cc = clustered_case(rng, 2, 2, 60, 40, 8, 5)
    _, sel = centroid_attn(q, k, v, cent, sizes, cc, 0.0, return_selection=True)  # a budget of one cell
    for h in range(2):
        for t in range(3):
            cells = sel[h][t]
            assert set(range(40, 60)) <= set(cells.tolist())  # every unclustered cell
            kept = set(cc[h, cells[cells < 40]].tolist())
            assert len(kept) == 1  # only the best cluster
            s = group_scores(q[h:h + 1, t], cent[h], sizes[h], 1 / math.sqrt(8))
            assert kept == {int(np.argmax(s))}


def test_two_levels_with_open_coarse_level_equal_one_level() -> None:
    rng = np.random.default_rng(3)
    q, k, v, cent, sizes, cc = clustered_case(rng, 4, 2, 80, 64, 16, 8)
    c_cent = np.zeros((2, 3, 16))
    c_sizes = np.zeros((2, 3), dtype=np.int64)
    parent = np.zeros((2, 8), dtype=np.int64)
    for h in range(2):
        cl = kmeans_cosine(cent[h], 3)
        parent[h] = cl.assignment
        c_sizes[h] = np.bincount(cl.assignment, weights=sizes[h], minlength=3)
        for c in range(3):
            members = parent[h] == c
            c_cent[h, c] = (cent[h, members] * sizes[h, members, None]).sum(0) / max(1, sizes[h, members].sum())
    coarse = (c_cent, c_sizes, parent)
    # the coarse normaliser stands in for the fine one: keep 1 keeps all the same
    one = centroid_attn(q, k, v, cent, sizes, cc, 1.0)
    two = centroid_attn(q, k, v, cent, sizes, cc, 1.0, coarse=coarse, threshold_coarse=0.0)
    np.testing.assert_allclose(two, one, rtol=1e-12, atol=1e-12)
    # a closed coarse level keeps only the best coarse cluster's fine clusters
    _, sel = centroid_attn(q, k, v, cent, sizes, cc, 1.0, coarse=coarse, threshold_coarse=1e9, return_selection=True)
    for h in range(2):
        for t in range(3):
            cells = sel[h][t]
            assert len(set(parent[h, cc[h, cells[cells < 64]]].tolist())) == 1


def test_kmeans_recovers_blobs_and_is_deterministic() -> None:
    rng = np.random.default_rng(4)
    keys, truth = blobs(rng, 6, 40, 24)
    order = np.argsort(truth, kind="stable")  # blob after blob, like the topics of a document
    keys, truth = keys[order], truth[order]
    a = kmeans_cosine(keys, 6, n_iter=20)
    b = kmeans_cosine(keys, 6, n_iter=20)
    assert np.array_equal(a.assignment, b.assignment) and np.array_equal(a.centroids, b.centroids)
    assert a.assignment.tolist() == truth.tolist()  # strided initial centroids: one per blob here
    # centroids are the means of the members' unnormalised keys; sizes count the members
    for c in range(6):
        np.testing.assert_allclose(a.centroids[c], keys[a.assignment == c].mean(axis=0), rtol=1e-12)
    assert a.sizes.tolist() == np.bincount(a.assignment, minlength=6).tolist()


def test_kmeans_converges_to_a_fixed_point() -> None:
    rng = np.random.default_rng(8)
    keys, _ = blobs(rng, 12, 30, 16, spread=0.3)
    keys = keys[rng.permutation(len(keys))]
    cl = kmeans_cosine(keys, 12, n_iter=100)
    assert cl.n_iter < 100  # stopped because no assignment changed
    xn = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    dirs = np.array([xn[cl.assignment == c].sum(0) for c in range(12)])
    dirs /= np.maximum(np.linalg.norm(dirs, axis=1, keepdims=True), 1e-300)
    live = cl.sizes > 0
    sim = np.where(live, xn @ dirs.T, -np.inf)
    assert (np.argmax(sim, axis=1) == cl.assignment).all()  # every key sits with its most similar centroid
    # better than the initial (strided) assignment's cosine objective
    init = xn[(np.arange(12) * len(keys)) // 12]
    assert (sim.max(axis=1)).sum() >= (xn @ init.T).max(axis=1).sum()


def test_kmeans_edge_cases() -> None:
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((10, 4))
    one = kmeans_cosine(keys, 1)
    assert (one.assignment == 0).all() and one.sizes.tolist() == [10]
    every = kmeans_cosine(keys, 10)
    assert sorted(every.assignment.tolist()) == list(range(10))
    dup = kmeans_cosine(np.ones((5, 3)), 3)  # identical keys: ties go to the highest cluster, others stay empty
    assert dup.sizes.tolist() == [0, 0, 5]
    for bad in (0, 11, 2.5):
        with pytest.raises(ValueError, match="n_clusters"):
            kmeans_cosine(keys, bad)
    with pytest.raises(ValueError, match="keys"):
        kmeans_cosine(keys[0], 1)
    with pytest.raises(ValueError, match="n_iter"):
        kmeans_cosine(keys, 2, n_iter=0)


def test_kpp_seeding_gives_a_rare_key_a_cluster_of_its_own() -> None:
    # 600 keys near one direction and one key orthogonal to it (a needle among a haystack): k-means++ draws a seed in
    # proportion to the squared distance from the seeds so far, so the far key is a seed almost surely and has a
    # cluster of its own from the first assignment; the evenly spaced seeds miss it and it joins a haystack cluster
    # (on data this plain, later iterations empty a cluster around it too: real needles are less far out)
    rng = np.random.default_rng(21)
    d = 16
    base = np.zeros(d)
    base[0] = 1.0
    keys = base + 0.005 * rng.standard_normal((601, d))
    needle = 350  # not one of the evenly spaced rows (i * 601) // 6
    keys[needle] = 0.0
    keys[needle, 1] = 2.0
    kpp = kmeans_cosine(keys, 6, n_iter=1, init="kpp")
    assert kpp.sizes[kpp.assignment[needle]] == 1
    even = kmeans_cosine(keys, 6, n_iter=1)
    assert even.sizes[even.assignment[needle]] > 1


def test_kpp_seed_rows_rules() -> None:
    rng = np.random.default_rng(22)
    keys, _ = blobs(rng, 10, 30, 12, spread=0.2)
    xn = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    for n in (1, 7, 64, 65, 200, 300):
        rows = kpp_seed_rows(xn, n)
        assert rows[0] == 0 and len(rows) == n and len(set(rows.tolist())) == n  # row 0 first, distinct rows
        assert np.array_equal(rows, kpp_seed_rows(xn, n))                      # a pure function of its inputs
    assert not np.array_equal(kpp_seed_rows(xn, 40, head=0), kpp_seed_rows(xn, 40, head=1))  # a stream per head
    # draws are uniform in (0, 1) and differ per counter
    u = [kpp_uniform(h, r, j) for h in range(3) for r in range(3) for j in range(50)]
    assert 0.0 < min(u) and max(u) < 1.0 and len(set(u)) == len(u) and abs(np.mean(u) - 0.5) < 0.05
    # fewer distinct keys than clusters: once every direction is a seed the distances vanish, and the rest are the
    # lowest rows not yet seeds
    dup = np.repeat(np.eye(3), 4, axis=0)  # 12 keys, 3 directions
    rows = kpp_seed_rows(dup, 8)
    assert len(set(rows.tolist())) == 8 and {r // 4 for r in rows.tolist()} == {0, 1, 2}
    assert kpp_seed_rows(np.ones((5, 3)), 3).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="init"):
        kmeans_cosine(keys, 4, init="random")


@pytest.mark.parametrize("keep", [0.1, 0.2, 0.3, 0.5])
def test_calibration_hits_the_kept_fraction(keep: float) -> None:
    rng = np.random.default_rng(6)
    q, k, v, cent, sizes, cc = clustered_case(rng, 8, 2, 400, 400, 16, 40)
    rows = []
    for h in range(2):
        for t in range(3):
            rows.append((group_scores(q[h*4:(h + 1)*4, t], cent[h], sizes[h], 0.25), sizes[h]))
    thr = calibrate_threshold(rows, keep)
    got = np.mean([kept_fraction(s, n, thr) for s, n in rows])
    assert got >= keep
    # the largest such threshold: the next larger score keeps less than asked
    higher = min((x for s, _ in rows for x in s if x > thr), default=None)
    if higher is not None:
        assert np.mean([kept_fraction(s, n, higher) for s, n in rows]) < keep


def test_calibration_bounds_and_errors() -> None:
    rows = [(np.array([0.5, 0.3, 0.2]), np.array([1, 1, 1]))]
    assert calibrate_threshold(rows, 1.0) == 0.0
    assert kept_fraction(rows[0][0], rows[0][1], calibrate_threshold(rows, 0.2)) == pytest.approx(1 / 3)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="keep"):
            calibrate_threshold(rows, bad)
    with pytest.raises(ValueError, match="calibration rows"):
        calibrate_threshold([], 0.5)


def test_centroid_attn_input_errors() -> None:
    rng = np.random.default_rng(7)
    q, k, v, cent, sizes, cc = clustered_case(rng, 4, 2, 20, 10, 8, 3)
    with pytest.raises(ValueError, match="group"):
        centroid_attn(q, k, v, cent, sizes, cc, 0.1, group="min")
    with pytest.raises(ValueError, match="cell_cluster"):
        centroid_attn(q, k, v, cent, sizes, cc[:, :5], 0.1)
    bad = cc.copy()
    bad[0, 0] = 3
    with pytest.raises(ValueError, match="cell_cluster"):
        centroid_attn(q, k, v, cent, sizes, bad, 0.1)
    with pytest.raises(ValueError, match="centroids"):
        centroid_attn(q, k, v, cent[:, :, :4], sizes, cc, 0.1)
    with pytest.raises(ValueError, match="sizes"):
        centroid_attn(q, k, v, cent, -sizes, cc, 0.1)
    with pytest.raises(ValueError, match="finite"):
        centroid_attn(q, k, v, cent, sizes, cc, math.nan)
