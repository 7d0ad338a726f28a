"""Spherical k-means as ggml graphs (ggml_cluster_update + ggml_mul_mat + ggml_argmax; sparq_llama.ops.kmeans_cosine)
against the float64 reference (sparq_llama.reference_squeeze.kmeans_cosine)."""
from __future__ import annotations

import numpy as np
import pytest
from sparq_llama import ops
from sparq_llama.reference_squeeze import kmeans_cosine, kpp_seed_rows
from test_reference_squeeze import blobs


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_matches_reference_on_separated_blobs(n_threads: int) -> None:
    rng = np.random.default_rng(11)
    problems = []
    for h in range(4):
        keys, truth = blobs(rng, 8, 25 + 5 * h, 32, spread=0.1)
        order = np.argsort(truth, kind="stable")
        problems.append(keys[order][:200])
    x = np.stack(problems)
    got = ops.kmeans_cosine(x, 8, n_iter=10, n_threads=n_threads)
    want = [kmeans_cosine(x[h].astype(np.float32).astype(np.float64), 8, n_iter=10) for h in range(4)]
    for h in range(4):
        assert got[h].assignment.tolist() == want[h].assignment.tolist()
        assert got[h].sizes.tolist() == want[h].sizes.tolist()
        # the problems of one call iterate together: until none changes (an unchanged one keeps its result)
        assert got[h].n_iter == max(w.n_iter for w in want)
        np.testing.assert_allclose(got[h].centroids, want[h].centroids, rtol=1e-5, atol=1e-5)
        # the table's variances (GGML_CLUSTER_TABLE_VAR): each member's squared deviation from the mean, summed
        np.testing.assert_allclose(got[h].variances, want[h].variances, rtol=1e-4, atol=1e-7)


def test_centred_rows_match_the_reference() -> None:
    # keys as a prefix's often are: blobs around one large shared key (Gemma-3's mean key holds about half of a key's
    # energy), clustered by the directions of the keys minus their mean; the table stays that of the keys themselves
    rng = np.random.default_rng(14)
    problems = []
    for h in range(3):
        keys, truth = blobs(rng, 8, 25, 32, spread=0.3)
        problems.append(keys[np.argsort(truth, kind="stable")] + 6.0 * rng.standard_normal(32))
    x = np.stack(problems).astype(np.float32)
    got = ops.kmeans_cosine(x, 8, n_iter=10, center=True, n_threads=2)
    for h in range(3):
        x64 = x[h].astype(np.float64)
        want = kmeans_cosine(x64, 8, n_iter=10, center=True)
        assert got[h].assignment.tolist() == want.assignment.tolist()
        assert want.assignment.tolist() != kmeans_cosine(x64, 8, n_iter=10).assignment.tolist()  # centring matters here
        np.testing.assert_allclose(got[h].centroids, want.centroids, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got[h].variances, want.variances, rtol=1e-4, atol=1e-6)
        for c in np.flatnonzero(want.sizes):
            np.testing.assert_allclose(want.centroids[c], x64[want.assignment == c].mean(0), rtol=1e-12, atol=1e-12)


def test_weighted_rows_match_the_reference() -> None:
    # blobs told apart in a few components only, which per-component weights (a QK-norm model's query weights)
    # emphasise: the clusters follow the weighted directions, per problem its own weights; the table stays that of
    # the keys themselves
    rng = np.random.default_rng(15)
    d, problems, weights = 32, [], []
    for h in range(3):
        keys, truth = blobs(rng, 8, 25, d, spread=0.3)
        problems.append(keys[np.argsort(truth, kind="stable")] + 2.0 * rng.standard_normal(d))
        weights.append(np.where(np.arange(d) % 4 == h, 6.0, 0.5) * rng.uniform(0.8, 1.2, d))
    x = np.stack(problems).astype(np.float32)
    w = np.stack(weights).astype(np.float32)
    got = ops.kmeans_cosine(x, 8, n_iter=10, center=True, weights=w, n_threads=2)
    for h in range(3):
        x64 = x[h].astype(np.float64)
        want = kmeans_cosine(x64, 8, n_iter=10, center=True, weights=w[h].astype(np.float64))
        assert got[h].assignment.tolist() == want.assignment.tolist()
        assert want.assignment.tolist() != kmeans_cosine(x64, 8, n_iter=10, center=True).assignment.tolist()
        np.testing.assert_allclose(got[h].centroids, want.centroids, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got[h].variances, want.variances, rtol=1e-4, atol=1e-6)
    # one row of weights serves every problem; weights of ones change nothing
    shared = ops.kmeans_cosine(x, 8, n_iter=10, center=True, weights=w[1], n_threads=2)
    assert shared[1].assignment.tolist() == got[1].assignment.tolist()
    ones = ops.kmeans_cosine(x, 8, n_iter=10, center=True, weights=np.ones(d), n_threads=2)
    plain = ops.kmeans_cosine(x, 8, n_iter=10, center=True, n_threads=2)
    assert [c.assignment.tolist() for c in ones] == [c.assignment.tolist() for c in plain]
    with pytest.raises(ValueError, match="weights must be"):
        ops.kmeans_cosine(x, 8, weights=np.ones(d + 1))
    with pytest.raises(ValueError, match="weights must have"):
        kmeans_cosine(x[0], 8, weights=np.ones(d - 1))


def test_random_keys_converge_to_the_reference_fixed_point() -> None:
    # overlapping clusters: float32 and float64 may part ways at near-ties, so check the properties instead:
    # deterministic, a fixed point (every row sits with its most similar centroid direction), a proper table
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 500, 16)).astype(np.float32)
    a = ops.kmeans_cosine(x, 25, n_iter=50)
    b = ops.kmeans_cosine(x, 25, n_iter=50)
    for h in range(3):
        assert np.array_equal(a[h].assignment, b[h].assignment) and np.array_equal(a[h].centroids, b[h].centroids)
        assert a[h].n_iter < 50
        xn = x[h] / np.linalg.norm(x[h], axis=1, keepdims=True)
        dirs = np.array([xn[a[h].assignment == c].sum(0) for c in range(25)])
        dirs /= np.maximum(np.linalg.norm(dirs, axis=1, keepdims=True), 1e-30)
        sim = np.where(a[h].sizes > 0, xn @ dirs.T, -np.inf)
        best = sim.max(axis=1)
        assert (sim[np.arange(500), a[h].assignment] >= best - 1e-5).all()
        assert a[h].sizes.sum() == 500
        for c in np.flatnonzero(a[h].sizes):
            np.testing.assert_allclose(a[h].centroids[c], x[h][a[h].assignment == c].mean(0), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(a[h].variances[c], x[h][a[h].assignment == c].astype(np.float64).var(0),
                                       rtol=1e-4, atol=1e-7)
        assert (a[h].variances[a[h].sizes == 0] == 0).all()


def test_edge_cases_and_errors() -> None:
    rng = np.random.default_rng(13)
    keys = rng.standard_normal((10, 4))
    one = ops.kmeans_cosine(keys, 1)
    assert (one.assignment == 0).all() and one.sizes.tolist() == [10]
    every = ops.kmeans_cosine(keys, 10)
    assert sorted(every.assignment.tolist()) == list(range(10))
    dup = ops.kmeans_cosine(np.ones((5, 3)), 3)  # ties go to the highest cluster, as in the reference
    assert (dup.variances == 0).all()  # identical members: no spread (computed about the mean, no cancellation)
    assert dup.sizes.tolist() == kmeans_cosine(np.ones((5, 3)), 3).sizes.tolist() == [0, 0, 5]
    for bad in (0, 11):
        with pytest.raises(ValueError, match="n_clusters"):
            ops.kmeans_cosine(keys, bad)
    with pytest.raises(ValueError, match="n_iter"):
        ops.kmeans_cosine(keys, 2, n_iter=0)
    with pytest.raises(ValueError, match="keys"):
        ops.kmeans_cosine(keys[0], 1)


def test_variances_of_tight_clusters_far_from_the_origin() -> None:
    # the variances are taken about the final means (a pass after them), not as E[x^2] - mean^2: keys at 300 +- 0.01
    # per component would lose every digit to cancellation in float32
    rng = np.random.default_rng(15)
    centers = 300.0 * rng.standard_normal((6, 32))
    x = (centers[rng.integers(0, 6, size=(2, 600))] + 0.01 * rng.standard_normal((2, 600, 32))).astype(np.float32)
    got = ops.kmeans_cosine(x, 6, n_iter=5, n_threads=2)
    for h in range(2):  # the float64 variances of the members it chose (which blob a near-tie joins does not matter)
        for c in np.flatnonzero(got[h].sizes):
            want = x[h][got[h].assignment == c].astype(np.float64).var(0)
            np.testing.assert_allclose(got[h].variances[c], want, rtol=2e-2, atol=1e-7)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("n_clusters", [1, 9, 64, 65, 150])
def test_kpp_seeding_matches_reference(n_threads: int, n_clusters: int) -> None:
    # the seeds drawn by the graphs (f32 similarities, pooled maxima, host draws) are the reference's (f64) draw for
    # draw: each problem draws as its head index, rounds of 64 seeds; one iteration then assigns as the reference
    rng = np.random.default_rng(16)
    x = np.stack([blobs(rng, 12, 25, 24, spread=0.15)[0] for _ in range(3)]).astype(np.float32)
    got = ops.kmeans_cosine(x, n_clusters, n_iter=1, init="kpp", n_threads=n_threads)
    for h in range(3):
        want = kmeans_cosine(x[h].astype(np.float64), n_clusters, n_iter=1, init="kpp", head=h)
        assert got[h].assignment.tolist() == want.assignment.tolist()
        assert got[h].sizes.tolist() == want.sizes.tolist()
    full = ops.kmeans_cosine(x, 12, n_iter=20, init="kpp")
    for h in range(3):
        want = kmeans_cosine(x[h].astype(np.float64), 12, n_iter=20, init="kpp", head=h)
        assert full[h].assignment.tolist() == want.assignment.tolist()
        np.testing.assert_allclose(full[h].centroids, want.centroids, rtol=1e-5, atol=1e-5)


def test_kpp_seeding_on_random_keys_and_duplicates() -> None:
    # overlapping random keys: the seeds still come out as the reference's (a draw lands near a boundary of the
    # running sums with probability ~1e-7 here); all keys alike: the rows that are not seeds yet, lowest first
    rng = np.random.default_rng(17)
    x = rng.standard_normal((2, 900, 32)).astype(np.float32)
    got = ops.kmeans_cosine(x, 120, n_iter=1, init="kpp")
    for h in range(2):
        xn = x[h].astype(np.float64)
        xn /= np.linalg.norm(xn, axis=1, keepdims=True)
        rows = kpp_seed_rows(xn, 120, head=h)
        want = np.argmax(xn @ xn[rows].T[:, ::-1], axis=1)  # one assignment from the seeds, ties to the higher
        assert got[h].assignment.tolist() == (119 - want).tolist()
    dup = ops.kmeans_cosine(np.ones((2, 5, 3), dtype=np.float32), 3, init="kpp")
    ref = kmeans_cosine(np.ones((5, 3)), 3, init="kpp")
    assert dup[0].sizes.tolist() == dup[1].sizes.tolist() == ref.sizes.tolist() == [0, 0, 5]
    with pytest.raises(ValueError, match="init"):
        ops.kmeans_cosine(x[0], 4, init="random")
