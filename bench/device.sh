#!/usr/bin/env bash
# The GPU driver: builds sparq-llama with CUDA on a machine without a package registry, tests it and runs the CUDA
# benchmarks, in stages (run from the repository root; each stage fits one call of a lent machine):
#
#   bench/device.sh build test              build (incremental in build/cuda; ~5.5 min cold), the CUDA tests
#   bench/device.sh sanitize                compute-sanitizer memcheck and racecheck on the tests' small cases
#   bench/device.sh fit                     -fit with SparQ on a GPU an 8B model nearly fills (tests/test_fit_cuda.py,
#                                           about 3 min; its summary line in $OUT/test_fit_cuda.log and cuda_checks.json)
#   bench/device.sh op                      benchmark (a): the op vs flash attention      -> $OUT/cuda_op.json
#   bench/device.sh e2e                     benchmark (b): llama-bench end to end         -> $OUT/cuda_e2e.json
#                                           (with BASE_COMMIT: both builds, $OUT/cuda_e2e_ab.json)
#   bench/device.sh batched                 benchmark (c): llama-batched-bench            -> $OUT/cuda_batched.json
#   bench/device.sh kernels                 each kernel's time in a decode step of a model (ncu, dense and SparQ)
#                                                                                         -> $OUT/cuda_kernels.json
#   bench/device.sh profile                 what limits each kernel of the op's decode step (ncu sections, B = 1)
#                                                                                         -> $OUT/cuda_op_profile.json
#   bench/device.sh squeeze                 centroid-sparse op and clustering time        -> $OUT/squeeze_op_cuda.json,
#                                                                                            $OUT/squeeze_cluster_cuda.json
# test and sanitize add their summaries (and log tails) to $OUT/cuda_checks.json. Each file in $OUT is named as the
# record it replaces in bench/results/; logs go to $OUT too. SPARQ_COMMIT names the commit in the records (a device
# copy of the tree may carry no .git); it defaults to `git rev-parse HEAD` where that works.
#
# A/B against another commit: BASE_COMMIT=<sha> makes `build` also build that commit's tree (a `git worktree` in
# build/base-src, or, where the device copy has no .git, the archive .device/base.tar made beforehand with
# `git archive -o .device/base.tar <sha>`) into build/base-src/build/cuda, from its own source pack .device/base-src.tgz where
# present (its vendor/patches may differ; made as below from a checkout of <sha>), else from the same pack. `test` and
# `op` then run on both builds, each with its own Python package and library (SPARQ_LLAMA_LIB_DIR), the base's own
# test files and bench/cuda_op.py:
#   SPARQ_COMMIT=$(git rev-parse --short HEAD) BASE_COMMIT=<sha> SEQS=4096,32768,65536 BATCHES=1 ROUNDS=2 \
#       bash bench/device.sh build test op       # -> cuda_op.json / cuda_op_base.json (per round), a table of both
#
# A library built on another machine (bench/prebuild.sh; no GPU needed there): PREBUILT=<its .tgz> makes `build`
# unpack it into build/cuda/bin instead of compiling (seconds instead of ~5 minutes of the lent machine). Carry the
# tarball's folder with the tree. It holds the library, llama-bench and llama-batched-bench (the test, sanitize, op,
# e2e, batched and kernels stages); the other tools need a build here. The driver library is preloaded, since the
# other machine linked against a stub of it.
#   bash bench/prebuild.sh && PREBUILT=.prebuilt/pb.tgz bash bench/device.sh build test
#
# Knobs (environment): TARGETS (the build's CMake targets, default the library and the five tools), OP_ARGS (more arguments of bench/cuda_op.py, e.g. "--index f16 --select q"),
# OP_SELECT (selection paths the op stage measures, each under SPARQ_CUDA_SELECT, default "auto"; more than one:
# cuda_op_<path>.json each and a table of all),
# SELECT (selection paths the SparQ op tests run, default "auto cluster sweep bound": the test-only
# switch SPARQ_CUDA_SELECT), SPARQ_TESTS_K (a pytest -k expression for the SparQ op tests), TEST_PARTS (which of the
# test stage's parts run, default "sparq centroid model"; sanitize takes its sparq and centroid), SANITIZE_SELECT (the
# selection paths sanitize runs, default "cluster sweep bound"), BASE_SELECT (for the base build, default "auto"), RUNS,
# SEQS, BATCHES, ROUNDS (op; BATCHES also batched), CACHE_TYPE (batched: K and V of that type, e.g. q8_0, into
# $OUT/cuda_batched_<type>.json),
# CUDA_ARCH (default 90), OUT (default /tmp/out), DEPTHS (e2e). ccache is used where the machine has it, or where .device/debs
# carries its Debian packages (unpacked into /tmp/cc; `apt-get download ccache libhiredis0.14`); cache in build/ccache.
#
# Preparing `.device` where a package registry is reachable (carry it with the tree; 64 MiB at most):
#   python vendor/fetch.py --pack .device/llama.cpp-src.tgz          # the patched, trimmed llama.cpp source pack
#   CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" pip wheel --no-deps llama-cpp-python==0.3.36 -w .device/wheels
#   pip download --no-deps diskcache gguf -d .device/wheels         # pure-Python wheels the tests and benches import
# The device's python3 must have numpy and pytest; the wheels are unpacked into /tmp/site, not installed.
set -uo pipefail
OUT=${OUT:-/tmp/out}
REPO=$PWD
BUILD=$REPO/build/cuda
BASE_SRC=$REPO/build/base-src
BASE_BUILD=$BASE_SRC/build/cuda   # same depth below its tree as build/cuda: ccache (base dir $REPO) shares the upstream objects
SELECT=${SELECT:-auto cluster sweep bound}
SANITIZE_SELECT=${SANITIZE_SELECT:-cluster sweep bound}
TEST_PARTS=${TEST_PARTS:-sparq centroid model}
BASE_SELECT=${BASE_SELECT:-auto}
export PYTHONUNBUFFERED=1 DEVICE_SH_STAGES="$*"
export SPARQ_COMMIT=${SPARQ_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
status=0

setup_python() {
    [ -d /tmp/site/llama_cpp ] && return
    for w in .device/wheels/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/site; done
}

setup_ccache() {
    command -v ccache > /dev/null && return
    ls .device/debs/*.deb > /dev/null 2>&1 || return 0
    [ -x /tmp/cc/usr/bin/ccache ] || for d in .device/debs/*.deb; do dpkg -x "$d" /tmp/cc; done
    export PATH=/tmp/cc/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/cc/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

# The builds to run on: "name tree build commit" per line (head, then the base where one was built).
builds() {
    echo "head $REPO $BUILD $SPARQ_COMMIT"
    if [ -n "${BASE_COMMIT:-}" ] && [ -f "$BASE_BUILD/bin/llama-bench" ]; then echo "base $BASE_SRC $BASE_BUILD $BASE_COMMIT"; fi
}

# Runs the rest of the line with one build's Python package and library.
with_build() {  # tree build commit cmd...
    local tree=$1 build=$2 commit=$3; shift 3
    (cd "$tree" && PYTHONPATH=$tree/py:/tmp/site SPARQ_LLAMA_LIB_DIR=$build/bin SPARQ_COMMIT=$commit "$@")
}

cmake_build() {  # source-tree build-dir log-prefix source-pack
    local src=$1 dir=$2 log=$3 pack=$4 launcher=()
    if command -v ccache > /dev/null; then
        export CCACHE_DIR=$REPO/build/ccache CCACHE_BASEDIR=$REPO
        launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    fi
    cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
        -DSPARQ_LLAMA_SOURCE="$pack" -DPython3_EXECUTABLE="$(command -v python3)" "${launcher[@]}" \
        > "$OUT/$log-configure.log" 2>&1 || { tail -30 "$OUT/$log-configure.log"; return 1; }
    cmake --build "$dir" --target ${TARGETS:-llama llama-bench llama-batched-bench llama-completion llama-server} -j "$(nproc)" \
        > "$OUT/$log-build.log" 2>&1 || { grep -B2 -A12 "error" "$OUT/$log-build.log" | head -80; return 1; }
}

base_tree() {  # the base commit's source in build/base-src
    [ -f "$BASE_SRC/CMakeLists.txt" ] && [ "$(cat "$BASE_SRC/.base-commit" 2>/dev/null)" = "$BASE_COMMIT" ] && return
    rm -rf "$BASE_SRC"; git worktree prune 2>/dev/null
    if git rev-parse --verify -q "$BASE_COMMIT^{commit}" > /dev/null; then
        git worktree add -f --detach "$BASE_SRC" "$BASE_COMMIT" > /dev/null || return 1
    elif [ -f .device/base.tar ]; then
        mkdir -p "$BASE_SRC" && tar -xf .device/base.tar -C "$BASE_SRC" || return 1
    else
        echo "BASE_COMMIT $BASE_COMMIT: no such commit here and no .device/base.tar"; return 1
    fi
    echo "$BASE_COMMIT" > "$BASE_SRC/.base-commit"
}

# The library of bench/prebuild.sh's tarball into build/cuda/bin, with the names the loader asks for; the CUDA
# toolkit's libraries on the search path and the driver library preloaded (the tarball's was linked against a stub).
unpack_prebuilt() {
    mkdir -p "$BUILD/bin" && tar -xzf "$PREBUILT" -C "$BUILD/bin" || return 1
    local f
    for f in "$BUILD"/bin/*.so.*.*; do
        ln -sf "$(basename "$f")" "${f%%.so.*}.so.0"; ln -sf "$(basename "$f")" "${f%%.so.*}.so"
    done
    local cuda; cuda=$(dirname "$(readlink -f "$(command -v nvcc)")")/..
    export LD_LIBRARY_PATH=$BUILD/bin:$cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    LD_PRELOAD=$(ldconfig -p | grep -m1 "libcuda.so.1 " | sed "s/.*=> //"); export LD_PRELOAD
    [ -n "$LD_PRELOAD" ] || { echo "no libcuda.so.1 on this machine"; return 1; }
    if [ -d "$BUILD/bin/vocab" ]; then  # the tokenizers the random-weight models copy, where a build would leave them
        mkdir -p vendor/llama.cpp/models
        for f in "$BUILD"/bin/vocab/*.gguf; do
            [ -e "vendor/llama.cpp/models/$(basename "$f")" ] || cp "$f" vendor/llama.cpp/models/
        done
    fi
    echo "build: unpacked $PREBUILT ($(ls "$BUILD"/bin/*.so.*.* | wc -l) libraries)"
}

stage_build() {
    if [ -n "${PREBUILT:-}" ]; then
        [ -z "${BASE_COMMIT:-}" ] || { echo "PREBUILT holds one build: BASE_COMMIT needs both built here"; return 1; }
        unpack_prebuilt; return
    fi
    local t0=$(date +%s)
    cmake_build "$REPO" "$BUILD" head "$REPO/.device/llama.cpp-src.tgz" || return 1
    echo "build ($SPARQ_COMMIT): $(( $(date +%s) - t0 )) s"
    if [ -n "${BASE_COMMIT:-}" ]; then
        t0=$(date +%s)
        local pack=$REPO/.device/base-src.tgz; [ -f "$pack" ] || pack=$REPO/.device/llama.cpp-src.tgz
        base_tree && cmake_build "$BASE_SRC" "$BASE_BUILD" base "$pack" || return 1
        echo "build base ($BASE_COMMIT): $(( $(date +%s) - t0 )) s"
    fi
}

# Adds one check (a test or sanitizer run) to $OUT/cuda_checks.json: its command, exit status, summary lines, log tail.
record_check() {  # name commit rc log command
    python3 - "$OUT/cuda_checks.json" "$@" <<'PY'
import json, os, re, sys
from pathlib import Path
sys.path.insert(0, "bench")
from record import provenance
out, name, commit, rc, log, command = Path(sys.argv[1]), *sys.argv[2:]
text = Path(log).read_text(errors="replace")
summary = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)|ERROR SUMMARY|RACECHECK SUMMARY", l)]
rec = json.loads(out.read_text()) if out.exists() else {**provenance("cuda_checks"), "checks": []}
rec["command"] = "bash bench/device.sh " + os.environ.get("DEVICE_SH_STAGES", "")
rec["checks"].append({"name": name, "commit": commit, "command": command, "rc": int(rc), "summary": summary[-3:],
                      "log_tail": text[-3000:]})
out.write_text(json.dumps(rec, indent=1) + "\n")
PY
}

check() {  # name tree build commit env... -- cmd...: runs one check with a build, records it
    local name=$1 tree=$2 build=$3 commit=$4; shift 4
    local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    local log="$OUT/$name.log"
    with_build "$tree" "$build" "$commit" env "${envs[@]}" "$@" > "$log" 2>&1
    local rc=$?
    record_check "$name" "$commit" "$rc" "$log" "${envs[*]} $*"
    echo "$name: exit $rc; $(grep -E '[0-9]+ (passed|failed)|ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -2 | tr '\n' ' ')"
    return $rc
}

# The CUDA test runs capture Python's output only (--capture=sys): an abort in the library (GGML_ABORT, a failed
# CUDA_CHECK) ends the process before pytest could print what it captured, and with fd capture its message was lost.
stage_test() {
    local rc=0 name tree build commit path paths
    python3 -c "import sparq_llama, json; print(json.dumps(sparq_llama.devices()))"
    while read -r name tree build commit; do
        paths=$SELECT; [ "$name" = base ] && paths=$BASE_SELECT
        for path in $paths; do
            [[ " $TEST_PARTS " == *" sparq "* ]] || break
            check "test_sparq_${path}_$name" "$tree" "$build" "$commit" SPARQ_CUDA_SELECT=$path -- \
                python3 -m pytest -q --capture=sys -p no:cacheprovider tests/test_op_sparq_attn_cuda.py ${SPARQ_TESTS_K:+-k "$SPARQ_TESTS_K"} || rc=1
        done
        [[ " $TEST_PARTS " == *" centroid "* ]] && { check "test_centroid_$name" "$tree" "$build" "$commit" -- \
            python3 -m pytest -q --capture=sys -p no:cacheprovider tests/test_op_centroid_attn_cuda.py || rc=1; }
        [[ " $TEST_PARTS " == *" model "* ]] && { check "test_model_gpu_$name" "$tree" "$build" "$commit" -- \
            python3 -X faulthandler -m pytest -q --capture=sys -p no:cacheprovider tests/test_squeeze_cuda.py tests/test_lib_isolation.py \
            tests/test_sparq_kv_index_cuda.py || rc=1; }
    done < <(builds)
    return $rc
}

# llama.cpp's memory fitting with SparQ on: the fitted context leaves room for the derived state and runs (the head build)
stage_fit() {
    check "test_fit_cuda" "$REPO" "$BUILD" "$SPARQ_COMMIT" -- \
        python3 -m pytest -q -s -p no:cacheprovider tests/test_fit_cuda.py
}

# compute-sanitizer over the CUDA op tests' small cases: SparQ rows through both selection paths (the cluster kernel
# at 4 to 36 cells per thread: 5000- to 70000-cell rows), the index types, qsigma with and without kstat, quantized
# and mixed K/V types, the centroid op and k-means. Time-boxed.
SPARQ_MEMCHECK="(random_case and (33 or 77 or 250 or 401)) or (window_and_sinks and 5) or (long_sequences and on and (shape0 or shape1 or shape2 or shape5 or shape6)) or (index_select_and_kv_type and (q4_1 or q5_0 or q8_0-q8 or f32-f16)) or (mixed_k_and_v and off) or (exact_and_window and q5_1) or (long_rows_with_q8 and (shape1 or shape3)) or (peaked_rows and (g4-20000 or perm))"
SPARQ_RACECHECK="(random_case and 33) or (window_and_sinks and 2) or (long_sequences and on and (shape0 or shape5 or shape6)) or (index_select_and_kv_type and (q5_1-q8 or bf16-none)) or (mixed_k_and_v and q4_0 and off) or (long_rows_with_q8 and shape3) or (peaked_rows and g1-33000)"
CENTROID_MEMCHECK="(matches_reference_and_cpu and (0-0.1 or 3-0.3 or 6-0.1 or 8-0.3)) or selected_cells or threshold_zero or without_visible or (kmeans and not 7b)"
CENTROID_RACECHECK="(matches_reference_and_cpu and (1-0.1 or 6-0.3)) or (selected_cells and 3) or (kmeans_matches and 32)"

stage_sanitize() {
    local rc=0 path tool
    for path in $SANITIZE_SELECT; do
        [[ " $TEST_PARTS " == *" sparq "* ]] || break
        check "memcheck_sparq_$path" "$REPO" "$BUILD" "$SPARQ_COMMIT" SPARQ_CUDA_SELECT=$path -- timeout 300 \
            compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
            tests/test_op_sparq_attn_cuda.py -k "$SPARQ_MEMCHECK" || rc=1
        check "racecheck_sparq_$path" "$REPO" "$BUILD" "$SPARQ_COMMIT" SPARQ_CUDA_SELECT=$path -- timeout 300 \
            compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
            tests/test_op_sparq_attn_cuda.py -k "$SPARQ_RACECHECK" || rc=1
    done
    [[ " $TEST_PARTS " == *" centroid "* ]] || return $rc
    check memcheck_centroid "$REPO" "$BUILD" "$SPARQ_COMMIT" -- timeout 300 \
        compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
        tests/test_op_centroid_attn_cuda.py -k "$CENTROID_MEMCHECK" || rc=1
    check racecheck_centroid "$REPO" "$BUILD" "$SPARQ_COMMIT" -- timeout 300 \
        compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x \
        tests/test_op_centroid_attn_cuda.py -k "$CENTROID_RACECHECK" || rc=1
    return $rc
}

stage_op() {
    local round name tree build commit path suffix files=()
    for round in $(seq "${ROUNDS:-1}"); do  # builds and selection paths interleaved, so a drift of the machine hits all
        while read -r name tree build commit; do
            for path in ${OP_SELECT:-auto}; do
                suffix=$([ "$name" = base ] && echo _base)$([ "${OP_SELECT:-auto}" != auto ] && echo "_$path")
                suffix=$suffix$([ "$round" -gt 1 ] && echo "_r$round")
                with_build "$tree" "$build" "$commit" env SPARQ_CUDA_SELECT="$path" python3 bench/cuda_op.py \
                    --runs "${RUNS:-50}" --seqs "${SEQS:-4096,8448,32768,33024,65792,131072}" --batches "${BATCHES:-1,16}" \
                    ${OP_ARGS:-} --out "$OUT/cuda_op$suffix.json" 2>&1 | tee "$OUT/cuda_op$suffix.log" | grep -v "^wrote"
                files+=("$OUT/cuda_op$suffix.json")
            done
        done < <(builds)
    done
    [ ${#files[@]} -gt 1 ] && python3 - "${files[@]}" <<'PY'
import json, re, sys
from collections import defaultdict
t, cols = defaultdict(lambda: defaultdict(list)), []
for f in sys.argv[1:]:
    col = re.sub(r"_r\d+$", "", re.sub(r"^.*cuda_op", "", f.removesuffix(".json"))).lstrip("_") or "head"
    cols += [col] if col not in cols else []
    for r in json.load(open(f))["rows"]:
        if "sparq_us" in r:
            t[(r["S"], r["B"])][col].append(r["sparq_us"])
print(f"{'S':>7} {'B':>3} " + " ".join(f"{c + ' us':>16}" for c in cols))
for (s, b), v in sorted(t.items()):
    print(f"{s:>7} {b:>3} " + " ".join(f"{' / '.join(f'{x:.1f}' for x in v[c]):>16}" for c in cols))
PY
    return 0
}

stage_e2e() {  # with a base build: both builds compared (cuda_e2e_ab.json), ROUNDS rounds interleaved
    local name=cuda_e2e ab=()
    if [ -n "${BASE_COMMIT:-}" ] && [ -f "$BASE_BUILD/bin/llama-bench" ]; then
        name=cuda_e2e_ab; ab=(--base-bin "$BASE_BUILD/bin" --rounds "${ROUNDS:-2}")
    fi
    with_build "$REPO" "$BUILD" "$SPARQ_COMMIT" python3 bench/cuda_e2e.py --bin "$BUILD/bin" "${ab[@]}" --models /tmp/models \
        ${DEPTHS:+--depths "$DEPTHS"} --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -v "^running"
}

stage_batched() {
    local name=cuda_batched${CACHE_TYPE:+_$CACHE_TYPE}
    python3 bench/cuda_batched.py --bin "$BUILD/bin" --models /tmp/models ${BATCHES:+--batches "$BATCHES"} \
        ${CACHE_TYPE:+--cache-type "$CACHE_TYPE"} --out "$OUT/$name.json" 2>&1 \
        | tee "$OUT/$name.log" | grep -v "^running"
}

stage_kernels() {  # ncu over llama-bench on models cut to 4 layers; its CSVs stay in /tmp/cuda_kernels
    python3 bench/cuda_kernels.py --bin "$BUILD/bin" --models /tmp/models --keep-csv /tmp/cuda_kernels \
        --out "$OUT/cuda_kernels.json" 2>&1 | tee "$OUT/cuda_kernels.log" | grep -v "^running"
}

stage_profile() {  # ncu sections of the op's kernels alone (B = 1); its text output stays in /tmp/cuda_op_profile
    python3 bench/cuda_op_profile.py --keep /tmp/cuda_op_profile --out "$OUT/cuda_op_profile.json" 2>&1 \
        | tee "$OUT/cuda_op_profile.log" | grep -v "^running"
}

stage_squeeze() {
    python3 bench/squeeze_op_cuda.py --runs 50 --out "$OUT/squeeze_op_cuda.json" 2>&1 | tee "$OUT/squeeze_op_cuda.log"
    for init in even kpp; do  # clustering a 32k prefix of the 7B shape with its keys on the GPU, both seedings
        python3 bench/squeeze_cluster.py --shape llama2-7b --prefix 32768 --backend cuda --resident --init $init \
            --append --out "$OUT/squeeze_cluster_cuda.json" 2>&1 | tee -a "$OUT/squeeze_cluster_cuda.log" | tail -2
    done
}

setup_python
setup_ccache
export PYTHONPATH=$REPO/py:/tmp/site SPARQ_LLAMA_LIB_DIR=$BUILD/bin
for stage in "$@"; do
    echo "=== $stage ($(date +%T))"
    "stage_$stage" || { status=1; echo "stage $stage failed"; [ "$stage" = build ] && exit 1; }
done
exit $status
