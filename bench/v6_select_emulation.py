#!/usr/bin/env python3
"""Python emulation of kernel v6a's selections (ggml_ops/src/cuda/sparq-attn.cu: bucket_shift, bucket_find, kernel S's
list-path top, kernel P's bucket threshold) against a sort, on random lists: a CPU-side check of the logic only.

    python3 bench/v6_select_emulation.py
"""
import numpy as np
rng = np.random.default_rng(0)
NB = 8*256
def bucket_shift(lo, hi):
    s = 0
    while ((hi - lo) >> s) >= NB: s += 1
    return s
def bucket_find(keys, need, lo, shift):
    hist = np.zeros(NB, np.int64)
    for k in keys:
        if k != 0: hist[(int(k) - lo) >> shift] += 1
    # thread t owns bins NB-1-8t .. NB-8-8t
    tots = [sum(hist[NB-1-8*t-e] for e in range(8)) for t in range(256)]
    above_t = np.concatenate([[0], np.cumsum(tots)[:-1]])
    res = None
    for t in range(256):
        above = above_t[t]
        if above < need and above + tots[t] >= need:
            cum = above
            for e in range(8):
                c = hist[NB-1-8*t-e]
                if cum < need and cum + c >= need:
                    assert res is None
                    res = (NB-1-8*t-e, cum, c)
                cum += c
    assert res is not None
    return res
def score_key(c):  # float32 bits + 1
    return int(np.float32(c).view(np.uint32)) + 1
def s_select(scores, cells, n_top, cell_bits):
    cmask = (1 << cell_bits) - 1
    keys = [(score_key(sc) << cell_bits) | (cmask - j) for sc, j in zip(scores, cells)]
    k32 = [k >> cell_bits for k in keys]
    kmin, kmax = min(k32), max(k32)
    sh = bucket_shift(kmin, kmax)
    b, above, count = bucket_find(k32, n_top, kmin, sh)
    sel = []; bnd = []
    for k, kk in zip(keys, k32):
        bn = (kk - kmin) >> sh
        if bn > b: sel.append(cmask - (k & cmask))
        elif bn == b: bnd.append(k)
    assert len(bnd) == count
    need = n_top - above
    if count <= 128:
        for k in bnd:
            rk = sum(u > k for u in bnd)
            if rk < need: sel.append(cmask - (k & cmask))
    else:
        top = sorted(keys, reverse=True)[:n_top]; thr = top[-1]
        sel = [cmask - (k & cmask) for k in keys if k >= thr]
    return sorted(sel)
def ref(scores, cells, n_top):
    order = sorted(zip(scores, cells), key=lambda t: (-np.float32(t[0]), t[1]))
    return sorted(j for _, j in order[:n_top])
for trial in range(300):
    n_kv = int(rng.integers(200, 40000)); cell_bits = max(1, int(np.ceil(np.log2(n_kv))))
    n = int(rng.integers(1, 1500)); n_top = int(rng.integers(1, n + 1))
    cells = rng.choice(n_kv, size=min(n, n_kv), replace=False); n = len(cells); n_top = min(n_top, n)
    kind = trial % 4
    if kind == 0: scores = np.exp(rng.normal(0, 3, n)).astype(np.float32) * 1e-4
    elif kind == 1: scores = rng.choice(np.float32([0.0, 1e-3, 2e-3, 0.5]), n)   # many ties
    elif kind == 2: scores = np.full(n, np.float32(0.25))
    else: scores = rng.random(n).astype(np.float32)
    scores = scores.astype(np.float32)
    got = s_select(list(scores), list(cells), n_top, cell_bits)
    exp = ref(list(scores), list(cells), n_top)
    assert got == exp, (trial, kind, n, n_top)
    assert len(got) == n_top
# P: threshold = lower bound of the bucket holding the (rank+1)-th key: at least rank+1 keys >= it, and <= exact
for trial in range(200):
    n = int(rng.integers(2, 2048))
    keys = [score_key(x) if rng.random() > 0.1 else 0 for x in np.exp(rng.normal(0, 3, n)).astype(np.float32) * 1e-5]
    valid = [k for k in keys if k]
    if not valid: continue
    rank = int(rng.integers(0, len(valid)))
    kmin, kmax = min(valid), max(valid); sh = bucket_shift(kmin, kmax)
    b, above, count = bucket_find(keys, rank + 1, kmin, sh)
    thr = kmin + (b << sh)
    exact = sorted(valid, reverse=True)[rank]
    assert thr <= exact and sum(k >= thr for k in valid) >= rank + 1 and thr <= kmax, trial
print("ok")
