#!/usr/bin/env bash
# Issue 7 (centroid-sparse attention) on a lent GPU machine without a package registry, in stages:
#   bench/device_squeeze.sh build test       build (incremental in build/cuda), CUDA op + k-means tests, CPU centroid tests
#   bench/device_squeeze.sh sanitize         compute-sanitizer memcheck and racecheck on the CUDA tests (small cases)
#   bench/device_squeeze.sh ncu              per-kernel times (ncu) of a decode step at 64k, keep 10%
#   bench/device_squeeze.sh opbench cluster  op vs flash attention (32k/64k prefix, keep 30/20/10%, Llama-2-7B heads);
#                                            clustering time of a 32k prefix (32 layers x 32 KV heads, 5% clusters)
#   bench/device_squeeze.sh clusterres       the clustering with each layer's keys already on the GPU
#   bench/device_squeeze.sh build e2e        llama-bench with the KV on the GPU: a 32k / 64k prefix prepared at keep
#                                            30/20/10% (5% clusters) vs dense, question prefill and decode (Llama-2 shape)
# Carry `.device`: the source pack (python vendor/fetch.py --pack .device/llama.cpp-src.tgz) and the wheels of
# llama-cpp-python (built without its native library), diskcache and gguf in .device/wheels. Logs and results go
# to $OUT; SPARQ_COMMIT names the commit for the records.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
REPO=$PWD
BUILD=$REPO/build/cuda
export PYTHONPATH=$REPO/py:/tmp/site PYTHONUNBUFFERED=1 SPARQ_LLAMA_LIB_DIR=$BUILD/bin
status=0
CUDA_TESTS=tests/test_op_centroid_attn_cuda.py

setup_python() {
    [ -d /tmp/site/llama_cpp ] && return
    for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
}

stage_build() {
    local t0=$(date +%s)
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DSPARQ_LLAMA_SOURCE="$REPO/.device/llama.cpp-src.tgz" -DPython3_EXECUTABLE="$(command -v python3)" \
        > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; return 1; }
    cmake --build "$BUILD" --target llama -j "$(nproc)" > "$OUT/build.log" 2>&1 \
        || { grep -B2 -A12 "error" "$OUT/build.log" | head -80; return 1; }
    grep -A3 "centroid-attn.cu\|cluster-update.cu" "$OUT/build.log" | grep -i "warning" | head -10
    echo "build: $(( $(date +%s) - t0 )) s"
}

stage_test() {
    python3 -c "import sparq_llama, json; print(json.dumps(sparq_llama.devices()))"
    python3 -m pytest -q -p no:cacheprovider --maxfail=20 -rf $CUDA_TESTS 2>&1 | tee "$OUT/test_cuda.log" | tail -15
    python3 -m pytest -q -p no:cacheprovider --maxfail=20 -rf tests/test_op_centroid_attn.py tests/test_op_kmeans.py \
        tests/test_reference_squeeze.py 2>&1 | tee "$OUT/test_cpu.log" | tail -4
}

stage_sanitize() {
    local small="(matches_reference_and_cpu and (0-0.1 or 3-0.3 or 6-0.1 or 8-0.3)) or selected_cells or threshold_zero or without_visible or (kmeans and not 7b)"
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x $CUDA_TESTS \
        -k "$small" > "$OUT/memcheck.log" 2>&1; echo "memcheck rc $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
    compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x $CUDA_TESTS \
        -k "(matches_reference_and_cpu and (1-0.1 or 6-0.3)) or (selected_cells and 3) or (kmeans_matches and 32)" \
        > "$OUT/racecheck.log" 2>&1; echo "racecheck rc $?"; grep -E "HAZARD|RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
}

stage_opbench() {
    python3 bench/squeeze_op_cuda.py --runs 50 --out "$OUT/squeeze_op_cuda.json"
}

stage_ncu() {  # per-kernel GPU times of one decode step at 64k, keep 10% (the op's four kernels and flash attention)
    ncu --metrics gpu__time_duration.sum --csv python3 bench/squeeze_op_cuda.py --prefixes 65536 --keeps 0.1 --runs 3 \
        --out /tmp/ncu_op.json > "$OUT/ncu_op_64k.csv" 2>&1
    python3 bench/ncu_summary.py "$OUT/ncu_op_64k.csv"
}

stage_cluster() {
    python3 bench/squeeze_cluster.py --shape llama2-7b --prefix 32768 --backend cuda --out "$OUT/squeeze_cluster_cuda.json" 2>&1 \
        | grep -v "it/s\]$" | tail -3
}

stage_clusterres() {  # the same with each layer's keys already on the GPU (no per-layer upload or backend start)
    python3 bench/squeeze_cluster.py --shape llama2-7b --prefix 32768 --backend cuda --resident \
        --out "$OUT/squeeze_cluster_cuda_resident.json" 2>&1 | tail -2
}

stage_e2e() {
    local m; m=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from cuda_e2e import model_path; print(model_path(Path('/tmp/models'), 'llama2-7b'))" | tail -1) || return 1
    for depth in 32768 65536; do
        python3 bench/squeeze_llama_bench.py --bench "$BUILD/bin/llama-bench" --model "$m" --ngl 99 --fa 1 --depth $depth \
            --keep 0,0.3,0.2,0.1 --centroids 0.05 --n-prompt 32 --n-gen 32 --reps 3 --tag "h100_llama2_$((depth / 1024))k" \
            2>&1 | tee "$OUT/squeeze_e2e_$depth.log"
        cp "bench/results/squeeze_llama_bench_h100_llama2_$((depth / 1024))k.json" "$OUT/" 2>/dev/null
    done
}

stage_e2e32() {  # stage e2e at 32k only, tagged by $TAG (session 10: question prefill with --squeeze-prefill auto)
    local m; m=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from cuda_e2e import model_path; print(model_path(Path('/tmp/models'), 'llama2-7b'))" | tail -1) || return 1
    python3 bench/squeeze_llama_bench.py --bench "$BUILD/bin/llama-bench" --model "$m" --ngl 99 --fa 1 --depth 32768 \
        --keep 0,0.3,0.2,0.1 --centroids 0.05 --n-prompt 32 --n-gen 32 --reps 3 --tag "${TAG:-h100_llama2_32k}" \
        2>&1 | tee "$OUT/squeeze_e2e_32768.log"
    cp "bench/results/squeeze_llama_bench_${TAG:-h100_llama2_32k}.json" "$OUT/" 2>/dev/null
}

setup_python
for stage in "$@"; do
    echo "=== $stage ($(date +%T))"
    "stage_$stage" || { status=1; echo "stage $stage failed"; [ "$stage" = build ] && exit 1; }
done
exit $status
