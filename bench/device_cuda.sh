#!/usr/bin/env bash
# Issue 6 on a lent GPU machine without a package registry, in stages (each one call of the device tool):
#   bench/device_cuda.sh build test op       build (incremental in build/cuda), CUDA op tests, benchmark (a)
#   bench/device_cuda.sh build profile       per-kernel times (ncu) at a few lengths
#   bench/device_cuda.sh build offload       partial offload and graph splits, dense vs SparQ
#   bench/device_cuda.sh sanitize e2e        compute-sanitizer memcheck + racecheck, benchmark (b)
#   bench/device_cuda.sh batched greedy      benchmark (c), greedy text CPU vs GPU on SmolLM2
#   bench/device_cuda.sh build gap; gapncu   where SparQ's end-to-end time goes beyond the op (Llama-2 shape)
#   bench/device_cuda.sh build recheck       op tests of the threshold paths, (b) at 32k/64k, squeeze prepare time
#   bench/device_cuda.sh build fused test centroidtest   session 9: fused V-sum upkeep measured, all CUDA op tests
#   bench/device_cuda.sh build gap64 gap64ncu sampleab sweepab   session 12: kernel S's fallbacks at 64k, A/B of
#                                            kernel P's sample and kernel B's sweep (env switches, one call each)
#   bench/device_cuda.sh build test final12; e2e; batched; squeezegpu   session 12's records, the GPU prefill test
#   bench/device_cuda.sh build test pycrash isolation squeezegpu   session 13: the Python Llama's crash on the CUDA
#                                            build (a static C++ runtime exported by each library), located and fixed
#   bench/device_cuda.sh build batchprof; batchtg   session 13: benchmark (c)'s batched step, op and end to end
#   bench/device_cuda.sh build lvab; batchtg          session 13: kernel LV's wide slice for many rows, A/B
#   bench/device_cuda.sh build test squeezegpu isolation   session 14: b25f9e9's switch reading and llama-server
#                                            --squeeze on the GPU (tests/test_squeeze_cuda.py), at one commit
#   bench/device_cuda.sh build test timeline timing8   session 15: the op's kernels as they run (SPARQ_CUDA_TIMELINE),
#                                            tail phases (the A/B stages releaseab and qab of 9074b42 and 4c58db3 are s15ab)
#   bench/device_cuda.sh build s16test s16ab s16timing s16e2e; TIMELINE_VARIANTS="early pbs0" ... timeline
#                                            session 16: kernel PBS (P, B, S as one cluster kernel per row) tested and
#                                            measured against P, B, S, op and end to end
#   bench/device_cuda.sh build s17steps               session 17: a decode step's GPU kernels at 32k, dense vs SparQ
#                                            (PyTorch's profiler: the device machine has no nsys)
#   bench/device_cuda.sh build s17test; s16e2e    session 17: kernel PBS up to 40960 cells (20 per thread), tests, op A/B, end to end
#   SEQS=33024,49408,65792 ROUNDS=1 ... build s17test; E2E_DEPTHS=65536 ... s16e2e   session 17: PBS up to 73728 cells, at 64k
#   bench/device_cuda.sh build s18test; s18op; HEADS=llama2-7b SEQS=33024,65792 s18op; E2E_SHAPE=llama3-8b ... s16e2e
#                                            session 18: kernel PBS with clusters of 16 for few long rows
#   bench/device_cuda.sh s19anatomy           session 19: kernel A for few GQA rows in the harness (what its time is made of)
#   bench/device_cuda.sh build s20kpp squeezegpu   session 20: k-means++ seeding on the GPU (tests, clustering time)
#   bench/device_cuda.sh build s17memcheck; s17racecheck   session 17: compute-sanitizer over PBS rows of 4 to 36 cells per thread
#   bench/device_cuda.sh build test testold s15e2e          session 15: the final chain's tests, with its parts off
#                                            too, and end to end on vs off (s15ab: the op, on, off, each part off)
# Carry `.device`: the source pack (python vendor/fetch.py --pack .device/llama.cpp-src.tgz), the wheels of
# llama-cpp-python (built without its native library), diskcache and gguf in .device/wheels, and for `greedy`
# the SmolLM2 file in parts .device/m/smollm2.part* (the carry limit is 64 MiB: parts travel in separate calls
# and collect in /tmp/m). Logs and results go to $OUT; SPARQ_COMMIT names the commit for the records.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/m
REPO=$PWD
BUILD=$REPO/build/cuda
export PYTHONPATH=$REPO/py:/tmp/site PYTHONUNBUFFERED=1 SPARQ_LLAMA_LIB_DIR=$BUILD/bin
# llama-bench as benchmark (b) runs it (the model's -m follows): full offload, f16 KV, SparQ k1 32, k2 128 on every layer
LB_SPARQ=("$BUILD/bin/llama-bench" -ngl 99 -fa 1 -ctk f16 -ctv f16 -k1 32 -k2 128 -sparq-min-kv 0)
status=0

setup_python() {
    [ -d /tmp/site/llama_cpp ] && return
    for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
}
collect_model_parts() {  # .device/m and .dev2/m (a second carried folder) may each hold parts
    for p in .device/m/smollm2.part* .dev2/m/smollm2.part*; do [ -f "$p" ] && cp "$p" /tmp/m/; done
}

stage_build() {
    local t0=$(date +%s)
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DSPARQ_LLAMA_SOURCE="$REPO/.device/llama.cpp-src.tgz" -DPython3_EXECUTABLE="$(command -v python3)" \
        > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; return 1; }
    cmake --build "$BUILD" --target llama llama-bench llama-batched-bench llama-completion llama-server -j "$(nproc)" \
        > "$OUT/build.log" 2>&1 || { grep -B2 -A12 "error" "$OUT/build.log" | head -80; return 1; }
    echo "build: $(( $(date +%s) - t0 )) s"
}

stage_test() {
    python3 -c "import sparq_llama, json; print(json.dumps(sparq_llama.devices()))"
    python3 -m pytest -q -p no:cacheprovider --maxfail=30 tests/test_op_sparq_attn_cuda.py 2>&1 | tee "$OUT/test_cuda.log" | tail -15
}

stage_op() {
    python3 bench/cuda_op.py --runs 50 --out "$OUT/cuda_op.json"
}

stage_profile() {
    for s in 4096 32768 131072; do
        ncu --metrics gpu__time_duration.sum --csv python3 bench/cuda_profile.py --seq $s --batch 1 --runs 2 \
            > "$OUT/ncu_$s.csv" 2>&1
        echo "S = $s:"; python3 bench/ncu_summary.py "$OUT/ncu_$s.csv"
    done
    python3 bench/cuda_profile.py --seq 32768 --batch 1 --runs 1 --heads 32 8 > /dev/null 2>&1
    ncu --metrics gpu__time_duration.sum --csv python3 bench/cuda_profile.py --seq 65536 --batch 1 --runs 2 --heads 32 8 \
        > "$OUT/ncu_l3_65536.csv" 2>&1
    echo "Llama-3 heads, S = 65536:"; python3 bench/ncu_summary.py "$OUT/ncu_l3_65536.csv"
}

stage_timing() {
    # tail phase timings printed by the kernels (cycles at the SM clock)
    for s in 4096 32768 131072; do
        echo "Llama-2 heads, S = $s:"; SPARQ_CUDA_TIMING=1 python3 bench/cuda_profile.py --seq $s --batch 1 --runs 1 2>/dev/null | sort | uniq -c
    done
    echo "Llama-3 heads, S = 65536:"; SPARQ_CUDA_TIMING=1 python3 bench/cuda_profile.py --seq 65536 --batch 1 --runs 1 --heads 32 8 2>/dev/null | sort | uniq -c
}

stage_offload() {
    # partial offload (-ngl below the layer count) and where the graph splits, dense vs SparQ, on a small
    # random-weight model of the Llama-2 layout (4 layers)
    local m=/tmp/models/small.gguf
    python3 - <<'PY'
import sys; sys.path.insert(0, "bench")
import random_gguf as r
r.write_model(r.Shape("small", "ggml-vocab-llama-spm.gguf", 512, 4, 8, 8, 1024, 10000.0), __import__("pathlib").Path("/tmp/models/small.gguf"))
PY
    for ngl in 0 2 99; do
        "$BUILD/bin/llama-bench" -m $m -ngl $ngl -fa 1 -p 0 -n 8 -d 2048 -r 1 -sparq 0,1 -k1 16 -k2 64 -sparq-min-kv 0 -o json \
            > "$OUT/offload_bench_ngl$ngl.json" 2> "$OUT/offload_bench_ngl$ngl.log" \
            && python3 -c "import json,sys; [print('ngl $ngl', 'sparq' if r['sparq'] else 'dense', round(r['avg_ts'],1), 't/s') for r in json.load(open(sys.argv[1]))]" "$OUT/offload_bench_ngl$ngl.json" \
            || { echo "llama-bench -ngl $ngl failed"; tail -5 "$OUT/offload_bench_ngl$ngl.log"; }
        for mode in dense sparq; do
            local extra=(); [ $mode = sparq ] && extra=(--sparq --k1 16 --k2 64 --sparq-min-kv 0)
            "$BUILD/bin/llama-completion" -m $m -ngl $ngl -fa on -c 8192 -n 16 --temp 0 -no-cnv -v -f README.md "${extra[@]}" \
                > "$OUT/offload_${mode}_ngl$ngl.txt" 2> "$OUT/offload_${mode}_ngl$ngl.log" || echo "completion $mode -ngl $ngl failed"
            echo "ngl $ngl $mode: $(grep -o 'graph splits = [0-9]*' "$OUT/offload_${mode}_ngl$ngl.log" | head -1), $(grep -c 'sparq' "$OUT/offload_${mode}_ngl$ngl.log") sparq log lines"
        done
    done
}

shape_model() {  # prints the path of the random-weight Q8_0 model of shape $1 (default llama2-7b), made on first use
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from cuda_e2e import model_path; print(model_path(Path('/tmp/models'), '${1:-llama2-7b}'))" | tail -1
}

make_small_model() {  # random-weight Llama-2 layout, 4 layers (bench/random_gguf.py)
    [ -f /tmp/models/small.gguf ] && return
    python3 - <<'PYEOF'
import sys; sys.path.insert(0, "bench")
import random_gguf as r
r.write_model(r.Shape("small", "ggml-vocab-llama-spm.gguf", 512, 4, 8, 8, 1024, 10000.0), __import__("pathlib").Path("/tmp/models/small.gguf"))
PYEOF
}

stage_completion() {
    # llama-completion vs llama-bench decode cost with SparQ on the GPU (session 4 saw 10x llama-bench's):
    # eval time per token at two context sizes, with and without CUDA graphs, and the scheduler's splits
    make_small_model
    local m=/tmp/models/small.gguf
    head -c 12000 README.md > /tmp/prompt.txt
    for mode in dense sparq; do
        local extra=(); [ $mode = sparq ] && extra=(--sparq --k1 16 --k2 64 --sparq-min-kv 0)
        for c in 8192 4608; do
            "$BUILD/bin/llama-completion" -m $m -ngl 99 -fa on -c $c -n 64 --temp 0 -no-cnv -f /tmp/prompt.txt "${extra[@]}" \
                > /dev/null 2> "$OUT/compl_${mode}_c$c.log" || echo "completion $mode -c $c failed"
            echo "$mode -c $c: $(grep -o 'eval time = .*' "$OUT/compl_${mode}_c$c.log" | tail -1)"
        done
        GGML_CUDA_DISABLE_GRAPHS=1 "$BUILD/bin/llama-completion" -m $m -ngl 99 -fa on -c 8192 -n 64 --temp 0 -no-cnv \
            -f /tmp/prompt.txt "${extra[@]}" > /dev/null 2> /tmp/nographs.log
        echo "$mode -c 8192 no CUDA graphs: $(grep -o 'eval time = .*' /tmp/nographs.log | tail -1)"
        GGML_SCHED_DEBUG=2 "$BUILD/bin/llama-completion" -m $m -ngl 99 -fa on -c 8192 -n 3 --temp 0 -no-cnv -v \
            -f /tmp/prompt.txt "${extra[@]}" 2>&1 > /dev/null | head -c 8000000 > "$OUT/sched_${mode}.log"
        echo "$mode: $(grep -c 'SPLIT' "$OUT/sched_${mode}.log") split lines, $(grep -o 'graph splits = [0-9]*' "$OUT/sched_${mode}.log" | sort | uniq -c | tr '\n' ' ')"
    done
    "$BUILD/bin/llama-bench" -m $m -ngl 99 -fa 1 -p 0 -n 64 -d 4352 -r 2 -sparq 0,1 -k1 16 -k2 64 -sparq-min-kv 0 2>/dev/null | grep tg
}

stage_firststep() {
    # per-step decode times from the -v log's "n_past" stamps: where the first SparQ step's extra cost goes,
    # with lazy (the default) and eager module loading
    make_small_model
    head -c 12000 README.md > /tmp/prompt.txt
    for loading in LAZY EAGER; do
        for mode in dense sparq; do
            local extra=(); [ $mode = sparq ] && extra=(--sparq --k1 16 --k2 64 --sparq-min-kv 0)
            CUDA_MODULE_LOADING=$loading "$BUILD/bin/llama-completion" -m /tmp/models/small.gguf -ngl 99 -fa on -c 8192 \
                -n 6 --temp 0 -no-cnv -v -f /tmp/prompt.txt "${extra[@]}" 2>&1 > /dev/null \
                | grep -E "n_past = |load time|common_init_: warming|llama_context: constructing" > /tmp/steps.log
            echo "$loading $mode: $(python3 - /tmp/steps.log <<'PYEOF'
import re, sys
stamps = []
for line in open(sys.argv[1]):
    m = re.match(r"(\d+)\.(\d+)\.(\d+)\.(\d+)", line)
    t = int(m[1])*60 + int(m[2]) + int(m[3])/1e3 + int(m[4])/1e6 if m else None  # min.s.ms.us
    if "n_past" in line and t is not None:
        stamps.append(t)
    elif "load time" in line:
        print(line.strip().split("I ")[-1], end="; ")
print("steps (ms):", " ".join(f"{(b - a)*1000:.1f}" for a, b in zip(stamps, stamps[1:])))
PYEOF
)"
        done
    done
}

stage_ncu() {
    # ncu sections of one decode step's kernels (S = 32k, Llama-2 heads)
    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats --section SchedulerStats -k regex:sparq --launch-skip 8 --launch-count 8 \
        python3 bench/cuda_profile.py --seq 32768 --batch 1 --runs 3 > "$OUT/ncu_sections.txt" 2>&1
    grep -E "^  [a-z].*sparq_|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" \
        "$OUT/ncu_sections.txt" | sed 's/(<unnamed>::sparq_args.*)x/ x/' | head -60
}

stage_opcheck() {  # benchmark (a) at B = 1 for three lengths: a quick look at a kernel variant
    python3 bench/cuda_op.py --runs 30 --seqs 4096,32768,131072 --batches 1 --out "$OUT/op_check.json" 2>&1 | grep -v "^wrote"
}

stage_testradix() {
    # the CUDA op tests with v5c's radix selection in kernels P and S (SPARQ_CUDA_RADIX_SELECT, the A/B of v6a)
    SPARQ_CUDA_RADIX_SELECT=1 python3 -m pytest -q -p no:cacheprovider --maxfail=30 tests/test_op_sparq_attn_cuda.py 2>&1 \
        | tee "$OUT/test_cuda_radix.log" | tail -3
}

stage_variants() {
    # benchmark (a) at B = 1: the default (v6: bucket selection + kernel LV) and the radix selection (same build)
    for sel in bucket radix; do
        echo "selection: $sel"
        local env=(); [ $sel = radix ] && env=(SPARQ_CUDA_RADIX_SELECT=1)
        env "${env[@]}" python3 bench/cuda_op.py --runs 30 --seqs 4096,32768,65536,131072 --batches 1 \
            --out "$OUT/op_check_$sel.json" 2>&1 | grep -v "^wrote"
    done
}

stage_ncu32() {
    # per-kernel times (ncu) at S = 32k, Llama-2 heads: bucket (default) and radix selection
    for sel in bucket radix; do
        local env=(); [ $sel = radix ] && env=(SPARQ_CUDA_RADIX_SELECT=1)
        env "${env[@]}" ncu --metrics gpu__time_duration.sum --csv python3 bench/cuda_profile.py --seq 32768 --batch 1 \
            --runs 2 > "$OUT/ncu32_$sel.csv" 2>&1
        echo "S = 32768, selection $sel:"; python3 bench/ncu_summary.py "$OUT/ncu32_$sel.csv"
    done
}

stage_smlayer() {
    # -sm layer over every GPU of the machine vs one GPU: the same greedy text with SparQ (k2 = 512 makes kernel
    # S opt into more than 48 KB of shared memory, which is per device), and llama-bench's rates
    nvidia-smi -L
    make_small_model
    local m=/tmp/models/small.gguf
    head -c 12000 README.md > /tmp/prompt.txt
    for mode in dense sparq; do
        local extra=(); [ $mode = sparq ] && extra=(--sparq --k1 16 --k2 512 --sparq-min-kv 0)
        for sm in none layer; do
            "$BUILD/bin/llama-completion" -m $m -ngl 99 -sm $sm -fa on -c 8192 -n 48 --temp 0 -no-cnv -f /tmp/prompt.txt \
                "${extra[@]}" > "$OUT/sm_${sm}_${mode}.txt" 2> "$OUT/sm_${sm}_${mode}.log" || echo "completion -sm $sm $mode failed"
            echo "-sm $sm $mode: devices with model layers: $(grep -o 'CUDA[0-9] model buffer' "$OUT/sm_${sm}_${mode}.log" | sort -u | tr '\n' ' ')$(grep -o 'eval time = .*' "$OUT/sm_${sm}_${mode}.log" | tail -1)"
        done
        if cmp -s "$OUT/sm_none_${mode}.txt" "$OUT/sm_layer_${mode}.txt"; then echo "$mode: -sm layer text == one GPU"; else
            echo "$mode: -sm layer text != one GPU"; fi
    done
    "$BUILD/bin/llama-bench" -m $m -ngl 99 -sm layer -fa 1 -p 0 -n 32 -d 4096 -r 2 -sparq 0,1 -k1 16 -k2 512 -sparq-min-kv 0 \
        2>/dev/null | grep -E "tg|sparq"
    CUDA_VISIBLE_DEVICES=1 python3 -m pytest -q -p no:cacheprovider tests/test_op_sparq_attn_cuda.py \
        -k "(random_case and (33 or 77 or 250)) or long_sequences" 2>&1 | tail -2
}

stage_sanitize() {
    local t="tests/test_op_sparq_attn_cuda.py"
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x "$t" \
        -k "(random_case and (33 or 77 or 250 or 401)) or (window_and_sinks and 1) or empty_rows or k2_covering or long_sequences" \
        > "$OUT/memcheck.log" 2>&1; echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
    compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x "$t" \
        -k "(random_case and (33 or 77)) or (window_and_sinks and 2) or (long_sequences and on)" \
        > "$OUT/racecheck.log" 2>&1; echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
}

stage_e2e() {
    python3 bench/cuda_e2e.py --bin "$BUILD/bin" --models /tmp/models --part b --reps 2 2>&1 | tee "$OUT/e2e.log" | grep -v "^running"
    cp bench/results/cuda_e2e.json "$OUT/" 2>/dev/null
}

stage_batched() {
    python3 bench/cuda_e2e.py --bin "$BUILD/bin" --models /tmp/models --part c 2>&1 | tee "$OUT/batched.log" | grep -v "^running"
    cp bench/results/cuda_batched.json "$OUT/" 2>/dev/null
}

stage_greedy() {
    ls /tmp/m/smollm2.part0 /tmp/m/smollm2.part1 > /dev/null || return 1
    cat /tmp/m/smollm2.part0 /tmp/m/smollm2.part1 > /tmp/m/smollm2.gguf
    local prompt="The history of the Roman Empire begins with the founding of the city. Over many centuries the small \
settlement on the Tiber grew into a republic, then into an empire that ruled the whole Mediterranean. Its roads, laws \
and language shaped the continent for a thousand years after its fall. Historians still argue about why it fell:"
    local common=(-m /tmp/m/smollm2.gguf -p "$prompt" -n 96 --temp 0 -no-cnv -c 2048 -fa on --sparq-min-kv 0)
    for k2 in 4096 64; do
        "$BUILD/bin/llama-completion" "${common[@]}" --sparq --k1 16 --k2 $k2 -dev none -t 16 > "$OUT/greedy_cpu_k2_$k2.txt" 2>/dev/null
        "$BUILD/bin/llama-completion" "${common[@]}" --sparq --k1 16 --k2 $k2 -ngl 99 > "$OUT/greedy_gpu_k2_$k2.txt" 2>"$OUT/greedy_gpu_k2_$k2.log"
        if cmp -s "$OUT/greedy_cpu_k2_$k2.txt" "$OUT/greedy_gpu_k2_$k2.txt"; then echo "greedy k2=$k2: CPU == GPU"; else
            echo "greedy k2=$k2: CPU != GPU"; diff <(tr ' ' '\n' < "$OUT/greedy_cpu_k2_$k2.txt") <(tr ' ' '\n' < "$OUT/greedy_gpu_k2_$k2.txt") | head -5; fi
    done
    grep -c "sparq_attn\|SparQ on" "$OUT/greedy_gpu_k2_64.log"
}

stage_gap() {
    # Where SparQ's end-to-end time goes beyond the op (Llama-2 shape, llama-bench tg, -sparq-min-kv 0):
    #   1. dense vs SparQ (policies sparq and window) at 32k and 64k;
    #   2. llama-completion at 32k: dense, SparQ, SparQ with the mean (V-sum upkeep) off: ms per token;
    #   3. ncu of the op's kernels inside llama-bench's decode steps at 32k (vs bench/cuda_profile.py's);
    #   4. SPARQ_CUDA_TIMING at 64k: the tail phases and any exact-selection fallback of kernel S;
    #   5. ncu of every kernel of decode steps at depth 0 (the kernel inventory per step, dense vs SparQ).
    # Parts 3-5 are stage gapncu (one device call each: gap after build, gapncu in the next, warm call).
    local m; m=$(shape_model) || return 1
    local lb=("${LB_SPARQ[@]}" -m "$m")
    "${lb[@]}" -p 0 -n 32 -r 3 -d 32768,65536 -sparq 0,1 -sparq-policy sparq,window -o json > "$OUT/gap_bench.json" 2> "$OUT/gap_bench.log" \
        && python3 -c "import json,sys; [print(f\"d {r['n_depth']} {'sparq-'+r['sparq_policy'] if r['sparq'] else 'dense'}: {r['avg_ts']:.1f} t/s, {1000/r['avg_ts']:.2f} ms\") for r in json.load(open(sys.argv[1]))]" "$OUT/gap_bench.json" \
        || { echo "gap bench failed"; tail -5 "$OUT/gap_bench.log"; }
    completion_32k "$m" gap
}

completion_32k() {  # MODEL TAG: llama-completion after a ~32k-token prompt, dense / SparQ / SparQ without the mean
    local m=$1 tag=$2
    python3 -c "import random; random.seed(1); w=open('README.md').read().split(); print(' '.join(random.choice(w) for _ in range(13500)))" > /tmp/prompt32k.txt
    for mode in dense sparq sparq_mean_off; do
        local extra=()
        [ $mode != dense ] && extra=(--sparq --k1 32 --k2 128 --sparq-min-kv 0)
        [ $mode = sparq_mean_off ] && extra+=(--sparq-mean off)
        "$BUILD/bin/llama-completion" -m "$m" -ngl 99 -fa on -c 40960 -n 96 --temp 0 -no-cnv --ignore-eos -f /tmp/prompt32k.txt "${extra[@]}" \
            > /dev/null 2> "$OUT/${tag}_compl_$mode.log" || echo "completion $mode failed"
        echo "completion $mode: $(grep -o 'prompt eval time = .*tokens' "$OUT/${tag}_compl_$mode.log" | tail -1 | sed 's/ *(.*//'); $(grep -o ' eval time = .*' "$OUT/${tag}_compl_$mode.log" | grep -v prompt | tail -1)"
    done
}

tg_llama2() {  # MODEL TAG: llama-bench tg32 at 32k and 64k, dense vs SparQ (Llama-2 shape, benchmark (b)'s settings)
    local m=$1 tag=$2
    "$BUILD/bin/llama-bench" -m "$m" -ngl 99 -fa 1 -ctk f16 -ctv f16 -p 0 -n 32 -r 3 -d 32768,65536 -sparq 0,1 -k1 32 -k2 128 \
        -sparq-min-kv 0 -o json > "$OUT/${tag}_bench.json" 2> "$OUT/${tag}_bench.log" \
        && python3 -c "import json,sys; [print(f\"d {r['n_depth']} {'sparq' if r['sparq'] else 'dense'}: {r['avg_ts']:.1f} t/s, {1000/r['avg_ts']:.2f} ms\") for r in json.load(open(sys.argv[1]))]" "$OUT/${tag}_bench.json" \
        || { echo "$tag bench failed"; tail -5 "$OUT/${tag}_bench.log"; }
}

squeeze_prepare_32k() {  # MODEL TAG: centroid-sparse prepare of a 32k prefix (random tokens), its phase times
    local m=$1 tag=$2
    "$BUILD/bin/llama-bench" -m "$m" -ngl 99 -fa 1 -p 0 -n 4 -r 1 -d 32768 -squeeze-keep 0.1 -o json -v \
        > "$OUT/${tag}_squeeze_prepare32k.json" 2> "$OUT/${tag}_squeeze_prepare32k.log"
    grep -E "prepared in|preparation phases" "$OUT/${tag}_squeeze_prepare32k.log" | head -3
}

stage_gapncu() {  # parts 3-5 of stage_gap
    local m; m=$(shape_model) || return 1
    local lb=("${LB_SPARQ[@]}" -m "$m")
    ncu --metrics gpu__time_duration.sum --csv -k regex:sparq "${lb[@]}" -p 0 -n 3 -r 1 -d 32768 -sparq 1 \
        > "$OUT/gap_ncu_sparq32k.csv" 2> "$OUT/gap_ncu_sparq32k.log"
    echo "ncu, op kernels in llama-bench decode at 32k:"; python3 bench/ncu_summary.py "$OUT/gap_ncu_sparq32k.csv"
    SPARQ_CUDA_TIMING=1 "${lb[@]}" -p 0 -n 2 -r 1 -d 65536 -sparq 1 > "$OUT/gap_timing64k.txt" 2>&1
    echo "timing at 64k: $(grep -c 'exact fallback' "$OUT/gap_timing64k.txt") fallback lines"; grep 'exact fallback' "$OUT/gap_timing64k.txt" | head -5
    grep -E "^(P|S):" "$OUT/gap_timing64k.txt" | head -4
    for mode in dense sparq; do
        local sq=0; [ $mode = sparq ] && sq=1
        ncu --metrics gpu__time_duration.sum --csv "${lb[@]}" -p 0 -n 3 -r 1 -d 0 -sparq $sq > "$OUT/gap_ncu_all_$mode.csv" 2> /dev/null
        echo "ncu, every kernel, depth 0, $mode:"; python3 bench/ncu_summary.py "$OUT/gap_ncu_all_$mode.csv" --total | head -45
    done
}

stage_gap64() {
    # Session 12: SparQ's per-token time grows ~66 us per layer per 32k cells in llama-bench (1.39x at 32k,
    # 1.70x at 64k) but the op bench's only ~30 us: where the rest goes. Exact-selection fallbacks of kernel S
    # (SPARQ_CUDA_TIMING) at 32k and 64k; stage gap64ncu: ncu of the op's kernels at 64k (median and max per kernel).
    local m; m=$(shape_model) || return 1
    local lb=("${LB_SPARQ[@]}" -m "$m")
    for d in 32768 65536; do
        SPARQ_CUDA_TIMING=1 "${lb[@]}" -p 0 -n 8 -r 1 -d $d -sparq 1 > "$OUT/gap64_timing_$d.txt" 2>&1
        echo "timing at $d: $(grep -c 'exact fallback' "$OUT/gap64_timing_$d.txt") fallback lines of $(grep -c '^S:' "$OUT/gap64_timing_$d.txt") S lines"
        grep 'exact fallback' "$OUT/gap64_timing_$d.txt" | sort | uniq -c | sort -rn | head -4 || true
    done
}

stage_gap64ncu() {
    local m; m=$(shape_model) || return 1
    local lb=("${LB_SPARQ[@]}" -m "$m")
    ncu --metrics gpu__time_duration.sum --csv -k regex:sparq "${lb[@]}" -p 0 -n 3 -r 1 -d 65536 -sparq 1 \
        > "$OUT/gap64_ncu_sparq.csv" 2> "$OUT/gap64_ncu_sparq.log"
    echo "ncu, op kernels in llama-bench decode at 64k:"; python3 bench/ncu_summary.py "$OUT/gap64_ncu_sparq.csv"
}

stage_tg() {  # benchmark (b)'s Llama-2 rows at 32k and 64k, -r 3
    local m; m=$(shape_model) || return 1
    tg_llama2 "$m" tg
}

stage_sampleab() {
    # Session 12: kernel P's threshold sample, new (rank >= 16, target 8 n_top) vs before (SPARQ_CUDA_SAMPLE_V6=1),
    # interleaved in one call: llama-bench tg32 at 32k and 64k (Llama-2 shape), dense, SparQ, SparQ with the old sample
    local m; m=$(shape_model) || return 1
    local lb=("${LB_SPARQ[@]}" -m "$m" -p 0 -n 32 -r 3 -o json)
    for round in 1; do
        for d in 32768 65536; do
            "${lb[@]}" -d $d -sparq 0 > "$OUT/sampleab_${round}_${d}_dense.json" 2>/dev/null
            "${lb[@]}" -d $d -sparq 1 > "$OUT/sampleab_${round}_${d}_new.json" 2>/dev/null
            SPARQ_CUDA_SAMPLE_V6=1 "${lb[@]}" -d $d -sparq 1 > "$OUT/sampleab_${round}_${d}_v6.json" 2>/dev/null
            python3 - "$OUT" $round $d <<'PYEOF'
import json, sys
out, rnd, d = sys.argv[1:]
ms = {v: 1000 / json.load(open(f"{out}/sampleab_{rnd}_{d}_{v}.json"))[0]["avg_ts"] for v in ("dense", "new", "v6")}
print(f"round {rnd} d {d}: dense {ms['dense']:.2f} ms, sparq new {ms['new']:.2f} ms ({ms['dense']/ms['new']:.2f}x), "
      f"sparq v6 sample {ms['v6']:.2f} ms ({ms['dense']/ms['v6']:.2f}x)")
PYEOF
        done
    done
}

stage_sweepab() {
    # Session 12: kernel B's one-round sweep (visibility from kernel A's logits, positions only where the chunk can
    # hold window or sink cells) vs the v6 sweep (SPARQ_CUDA_SWEEP_V6=1): op tests, ncu per kernel at 32k and 64k
    # (Llama-2 heads, B = 1), ncu sections of both sweeps at 64k, the op bench at 32k/64k/128k for both
    python3 -m pytest -q -p no:cacheprovider tests/test_op_sparq_attn_cuda.py 2>&1 | tee "$OUT/test_cuda.log" | tail -2
    for v in new v6; do
        local env=(); [ $v = v6 ] && env=(SPARQ_CUDA_SWEEP_V6=1)
        for sq in 32768 65536; do
            env "${env[@]}" ncu --metrics gpu__time_duration.sum --csv python3 bench/cuda_profile.py --seq $sq --batch 1 --runs 2 \
                > "$OUT/sweepab_ncu_${v}_$sq.csv" 2>&1
            echo "sweep $v, S = $sq:"; python3 bench/ncu_summary.py "$OUT/sweepab_ncu_${v}_$sq.csv"
        done
        env "${env[@]}" ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
            -k regex:sparq_sweep --launch-skip 1 --launch-count 1 python3 bench/cuda_profile.py --seq 65536 --batch 1 --runs 2 \
            > "$OUT/sweepab_detail_$v.txt" 2>&1
        grep -E "Duration|Achieved Occupancy|Warp Cycles Per Issued|L2 Hit Rate|DRAM Throughput|Memory Throughput|Stall" "$OUT/sweepab_detail_$v.txt" | head -12
    done
    for v in new v6; do
        local env=(); [ $v = v6 ] && env=(SPARQ_CUDA_SWEEP_V6=1)
        env "${env[@]}" python3 bench/cuda_op.py --runs 50 --seqs 32768,65536,131072 --batches 1 --out "$OUT/sweepab_op_$v.json" 2>&1 | tail -4
    done
}

stage_final12() {
    # Session 12's measurement of record (after the sample, the one-round sweep, B at 8 blocks per SM): ncu per kernel
    # at 32k and 64k, the op bench at B = 1, llama-bench tg at 32k / 64k for the Llama-2 shape (-r 3)
    for sq in 32768 65536; do
        ncu --metrics gpu__time_duration.sum --csv python3 bench/cuda_profile.py --seq $sq --batch 1 --runs 2 > "$OUT/final12_ncu_$sq.csv" 2>&1
        echo "S = $sq:"; python3 bench/ncu_summary.py "$OUT/final12_ncu_$sq.csv"
    done
    python3 bench/cuda_op.py --runs 50 --seqs 4096,32768,65536,131072 --batches 1 --out "$OUT/final12_op.json" 2>&1 | tail -6
    local m; m=$(shape_model) || return 1
    tg_llama2 "$m" final12
}

stage_squeezegpu() {
    # the GPU branch of the centroid-sparse prefill mode auto (tests/test_squeeze_cuda.py) and the centroid op's CUDA tests
    # (separate runs: at 8b9a1af the Python Llama segfaulted loading a model with this CUDA build, which took the whole
    # pytest process down; fixed in session 13, see stage_isolation)
    python3 -m pytest -q -p no:cacheprovider tests/test_op_centroid_attn_cuda.py 2>&1 | tee "$OUT/test_centroid_gpu.log" | tail -2
    python3 -X faulthandler -m pytest -q -p no:cacheprovider tests/test_squeeze_cuda.py 2>&1 | tee "$OUT/test_squeeze_gpu.log" | tail -4
}

stage_pycrash() {
    # session 13: where the Python Llama crashed loading a model with the CUDA build (session 12: SIGSEGV inside
    # llama_model_load_from_file, also at n_gpu_layers 0): the binaries on the same tiny model, then the Python load
    # after `import gguf` (which imports sentencepiece, which loads the system libstdc++: the crash needs that) with
    # each setting that differs; the native stack of a crash from cuda-gdb (an LD_PRELOAD backtrace handler printed
    # nothing there, so it was dropped)
    python3 -c "import sys; sys.path.insert(0, 'bench'); import random_gguf; from pathlib import Path; random_gguf.write_model(random_gguf.SHAPES['tiny'], Path('/tmp/tiny.gguf'))"
    "$BUILD/bin/llama-completion" -m /tmp/tiny.gguf -ngl 99 -fa on -n 4 -p "hello" -no-cnv > "$OUT/pycrash_bin.log" 2>&1
    echo "llama-completion -ngl 99: rc $?"
    for args in "n_gpu_layers=0" "n_gpu_layers=99, use_mmap=False" "n_gpu_layers=99"; do
        printf 'import gguf\nfrom sparq_llama import Llama\nllm = Llama("/tmp/tiny.gguf", %s, n_ctx=256, flash_attn=True, verbose=False)\nprint("loaded", llm.n_vocab())\nllm.close()\n' "$args" > /tmp/pycrash.py
        python3 /tmp/pycrash.py > "$OUT/pycrash_py.log" 2>&1
        local rc=$?
        echo "python Llama($args): rc $rc"
        if [ $rc -ne 0 ] && command -v cuda-gdb > /dev/null; then
            timeout 200 cuda-gdb -batch -ex run -ex bt --args python3 /tmp/pycrash.py 2>&1 | grep -E "^#[0-9]" | head -12
        fi
    done
}

stage_isolation() {
    # session 13: the toolchain links libstdc++ statically? (a two-line library, with and without --exclude-libs),
    # then the built libraries and the regression test (tests/test_lib_isolation.py)
    printf '#include <sstream>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n' > /tmp/iso.cpp
    for flags in "" "-Wl,--exclude-libs,libstdc++.a:libstdc++_nonshared.a:libsupc++.a"; do
        c++ -shared -fPIC -O1 /tmp/iso.cpp -o /tmp/iso.so $flags
        echo "c++ ($(command -v c++)) flags '$flags': NEEDED $(readelf -d /tmp/iso.so | grep -c 'libstdc++'), exports locale::classic: $(nm -D --defined-only /tmp/iso.so | grep -c _ZNSt6locale7classicEv)"
    done
    for lib in "$BUILD"/bin/lib*.so; do
        echo "$(basename "$lib"): exports locale::classic $(nm -D --defined-only "$lib" | grep -c _ZNSt6locale7classicEv)"
    done
    python3 -m pytest -q -p no:cacheprovider tests/test_lib_isolation.py 2>&1 | tee "$OUT/test_isolation.log" | tail -3
}

stage_batchprof() {
    # session 13: where benchmark (c)'s batched decode goes (B = 8 with 8k prompts: 1.40x against a 3.0x target).
    # The op alone (bench (a) and ncu per kernel) at 8k for B = 1 and 8, and the Llama-3 heads at 16k, B = 8.
    python3 bench/cuda_op.py --runs 20 --seqs 8192 --batches 1,8 --out "$OUT/batchprof_op.json" | tail -3
    for b in 1 8; do
        ncu --metrics gpu__time_duration.sum --csv python3 bench/cuda_profile.py --seq 8192 --batch $b --runs 2 \
            > "$OUT/batchprof_ncu_b${b}.csv" 2>&1
        echo "ncu, Llama-2 heads, S = 8192, B = $b:"; python3 bench/ncu_summary.py "$OUT/batchprof_ncu_b${b}.csv"
    done
    ncu --metrics gpu__time_duration.sum --csv python3 bench/cuda_profile.py --seq 16384 --batch 8 --runs 2 --heads 32 8 \
        > "$OUT/batchprof_ncu_l3_b8.csv" 2>&1
    echo "ncu, Llama-3 heads, S = 16384, B = 8:"; python3 bench/ncu_summary.py "$OUT/batchprof_ncu_l3_b8.csv"
}

stage_batchtg() {
    # session 13: llama-batched-bench at B = 8 (Llama-2 shape, 8k prompts): dense, SparQ, SparQ without the mean
    local m; m=$(shape_model) || return 1
    local base=("$BUILD/bin/llama-batched-bench" -m "$m" -c 65792 -b 2048 -ub 512 -ngl 99 -fa on -npp 8192 -ntg 32 -npl 8)
    for mode in dense sparq sparq_mean_off; do
        local extra=()
        [ $mode != dense ] && extra=(--sparq --k1 32 --k2 128 --sparq-min-kv 0)
        [ $mode = sparq_mean_off ] && extra+=(--sparq-mean off)
        "${base[@]}" "${extra[@]}" > "$OUT/batchtg_$mode.log" 2>&1 || echo "batched $mode failed"
        echo "$mode: $(grep -E '^\|? *8192 *\|' "$OUT/batchtg_$mode.log" | tail -1)"
    done
}

stage_lvab() {
    # session 13: kernel LV's wide slice (128 output components per block, the head's logits over I2 computed once)
    # against the narrow one (32), forced by SPARQ_CUDA_LV_SLICE: every CUDA op test through each, the op bench
    # at 8k and 32k for B = 1, 4, 8, and ncu of LV at B = 8
    for sl in 32 128; do
        echo "tests, LV slice $sl: $(SPARQ_CUDA_LV_SLICE=$sl python3 -m pytest -q -p no:cacheprovider tests/test_op_sparq_attn_cuda.py 2>&1 | tee "$OUT/lvab_test_$sl.log" | tail -1)"
    done
    for sl in 32 128 auto; do
        echo "op bench, LV slice $sl:"
        SPARQ_CUDA_LV_SLICE=$sl python3 bench/cuda_op.py --runs 20 --seqs 8192,32768 --batches 1,4,8 --out "$OUT/lvab_op_$sl.json" | tail -6
    done
    for sl in 32 128; do
        SPARQ_CUDA_LV_SLICE=$sl ncu --metrics gpu__time_duration.sum --csv python3 bench/cuda_profile.py --seq 8192 --batch 8 --runs 2 \
            > "$OUT/lvab_ncu_$sl.csv" 2>&1
        echo "ncu S = 8192, B = 8, LV slice $sl: $(python3 bench/ncu_summary.py "$OUT/lvab_ncu_$sl.csv" | grep logits_values)"
    done
}

stage_recheck() {
    # After the session-8 changes (threshold at the zero score in kernels P and B; the decode step's V-sum upkeep;
    # the faster calibration): the CUDA op tests of the threshold paths, benchmark (b) for the Llama-2 shape at 32k
    # and 64k, and the centroid-sparse prepare of a 32k prefix with its phase times. Sized for ~150 s after a build.
    python3 -m pytest -q -p no:cacheprovider tests/test_op_sparq_attn_cuda.py -k "underflow or window_and_sinks" 2>&1 \
        | tee "$OUT/test_recheck.log" | tail -2
    local m; m=$(shape_model) || return 1
    tg_llama2 "$m" recheck
    squeeze_prepare_32k "$m" recheck
}

stage_fused() {
    # Session 9: the decode step's V-sum upkeep as one op (ggml_sparq_vsum_rows) and the clustering's larger head
    # chunks: the op's CUDA tests, then (b) at 32k/64k, llama-completion's upkeep cost (SparQ vs mean off), and
    # the centroid-sparse prepare phases of a 32k prefix.
    python3 -m pytest -q -p no:cacheprovider tests/test_op_sparq_attn_cuda.py -k vsum 2>&1 | tee "$OUT/test_vsum.log" | tail -2
    local m; m=$(shape_model) || return 1
    tg_llama2 "$m" fused
    completion_32k "$m" fused
    squeeze_prepare_32k "$m" fused
}

stage_cluster() {
    # session 10: the clustering of a 32k 7B-shape prefix with its keys on the GPU (ggml_cluster_assign replaced
    # ggml_argmax in the k-means graph)
    python3 bench/squeeze_cluster.py --shape llama2-7b --prefix 32768 --backend cuda --resident \
        --out "$OUT/squeeze_cluster_resident.json" 2>&1 | grep -v "^wrote" | tail -4
}

stage_prepare() {  # the centroid-sparse prepare of a 32k prefix and its phase times
    local m; m=$(shape_model) || return 1
    squeeze_prepare_32k "$m" prepare
}

stage_timeline() {
    # Session 15: the op's kernels as they run under dependent launches (SPARQ_CUDA_TIMELINE: per kernel the first
    # block's start, the first block past its wait, the last warp's end), B = 1 and 8, with kernel A's early
    # release (the default) and without it (SPARQ_CUDA_A_RELEASE_EXIT=1); medians by bench/timeline_summary.py
    # (cuda_op.py --one: the device's printf lines go to the log; the op's own times are not comparable here: the
    # printing kernel runs inside the timed region). TIMELINE_BATCHES, TIMELINE_SEQS and HEADS (cuda_op.py --heads)
    # pick other shapes (session 18: HEADS=llama3-8b TIMELINE_BATCHES=1 TIMELINE_SEQS="33024 65792")
    for rel in ${TIMELINE_VARIANTS:-early exit}; do
        local env=(); [ $rel = exit ] && env=(SPARQ_CUDA_A_RELEASE_EXIT=1); [ $rel = old ] && env=("${S15_OLD[@]}")
        [ $rel = pbs0 ] && env=(SPARQ_CUDA_PBS=0)
        : > "$OUT/timeline_$rel.log"
        for b in ${TIMELINE_BATCHES:-1 8}; do
            for sq in ${TIMELINE_SEQS:-4096 32768 65536}; do
                env "${env[@]}" SPARQ_CUDA_TIMELINE=1 python3 bench/cuda_op.py --one $sq $b --runs 20 --heads "${HEADS:-llama2-7b}" \
                    >> "$OUT/timeline_$rel.log" 2>&1
            done
        done
        echo "release $rel:"; python3 bench/timeline_summary.py "$OUT/timeline_$rel.log" --json "$OUT/timeline_$rel.json"
    done
}

stage_timing8() {
    # Session 15: the tail phase timings (SPARQ_CUDA_TIMING; kernel B's chunk 0 too at 4c58db3) at B = 1 and 8
    for b in 1 8; do
        for sq in 32768 65536; do
            echo "B = $b, S = $sq:"; SPARQ_CUDA_TIMING=1 python3 bench/cuda_profile.py --seq $sq --batch $b --runs 3 2>/dev/null \
                | sort | uniq -c | sort -rn | head -12
        done
    done
}

# Session 15's parts switched off together (the chain as at the session's start): kernel A's early release, kernel Q's
# fast path. (Kernel P's sample from the logits and kernel B's 16 cells per thread were measured at 9b334e9 with the
# variants sample14 and b8 and, no faster, taken out again.)
S15_OLD=(SPARQ_CUDA_A_RELEASE_EXIT=1 SPARQ_CUDA_Q_V14=1)

stage_testold() {
    # Session 15: every CUDA op test with the session's parts off (kernel Q's old path, kernel A's release at exit)
    echo "tests, session 15 off: $(env "${S15_OLD[@]}" python3 -m pytest -q -p no:cacheprovider tests/test_op_sparq_attn_cuda.py 2>&1 | tee "$OUT/test_s15_old.log" | tail -1)"
}

stage_s15ab() {
    # Session 15: benchmark (a) with every part on (default), all off (S15_OLD), and each part off alone
    for v in new old aexit q14; do
        local env=(X=0)
        case $v in old) env=("${S15_OLD[@]}");; aexit) env=(SPARQ_CUDA_A_RELEASE_EXIT=1);; q14) env=(SPARQ_CUDA_Q_V14=1);; esac
        echo "variant $v"
        env "${env[@]}" python3 bench/cuda_op.py --runs 30 --seqs 4096,32768,65536,131072 --batches 1,8 \
            --out "$OUT/op_s15_$v.json" 2>&1 | grep -v "^wrote"
    done
}

stage_s15e2e() {
    # Session 15: end to end, session 15 on vs off in one run: llama-bench tg32 at 32k / 64k (Llama-2 shape) and
    # llama-batched-bench at B = 8 (Llama-2 shape, 8k prompts)
    local m; m=$(shape_model) || return 1
    local lb=("${LB_SPARQ[@]}" -m "$m" -p 0 -n 32 -r 3 -o json)
    for d in 32768 65536; do
        "${lb[@]}" -d $d -sparq 0 > "$OUT/s15tg_${d}_dense.json" 2>/dev/null
        "${lb[@]}" -d $d -sparq 1 > "$OUT/s15tg_${d}_new.json" 2>/dev/null
        env "${S15_OLD[@]}" "${lb[@]}" -d $d -sparq 1 > "$OUT/s15tg_${d}_old.json" 2>/dev/null
        python3 - "$OUT" $d <<'PYEOF'
import json, sys
out, d = sys.argv[1:]
ms = {v: 1000 / json.load(open(f"{out}/s15tg_{d}_{v}.json"))[0]["avg_ts"] for v in ("dense", "new", "old")}
print(f"tg d {d}: dense {ms['dense']:.2f} ms, sparq {ms['new']:.2f} ms ({ms['dense']/ms['new']:.2f}x), "
      f"sparq as at the session's start {ms['old']:.2f} ms ({ms['dense']/ms['old']:.2f}x)")
PYEOF
    done
    local base=("$BUILD/bin/llama-batched-bench" -m "$m" -c 65792 -b 2048 -ub 512 -ngl 99 -fa on -npp 8192 -ntg 32 -npl 8)
    for mode in dense new old; do
        local extra=() env=(X=0)
        [ $mode != dense ] && extra=(--sparq --k1 32 --k2 128 --sparq-min-kv 0)
        [ $mode = old ] && env=("${S15_OLD[@]}")
        env "${env[@]}" "${base[@]}" "${extra[@]}" > "$OUT/s15batch_$mode.log" 2>&1 || echo "batched $mode failed"
        echo "batched B = 8, $mode: $(grep -E '^\|? *8192 *\|' "$OUT/s15batch_$mode.log" | tail -1)"
    done
}

stage_s16test() {
    # Session 16: every CUDA op test with kernel PBS (the default on Hopper) and with kernels P, B and S
    # (SPARQ_CUDA_PBS=0); a hung cluster barrier ends at the timeout instead of the call's limit
    echo "tests, PBS: $(timeout 240 python3 -m pytest -q -p no:cacheprovider -x tests/test_op_sparq_attn_cuda.py 2>&1 | tee "$OUT/test_pbs.log" | tail -1)"
    grep -E "^(FAILED|E  )" "$OUT/test_pbs.log" | head -20
    echo "tests, P B S: $(SPARQ_CUDA_PBS=0 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_op_sparq_attn_cuda.py 2>&1 | tee "$OUT/test_pbs0.log" | tail -1)"
}

stage_s16ab() {
    # Session 16: benchmark (a) with kernel PBS and with kernels P, B and S, ROUNDS interleaved rounds
    for round in $(seq 1 "${ROUNDS:-1}"); do
        for v in pbs pbs0; do
            local env=(X=0); [ $v = pbs0 ] && env=(SPARQ_CUDA_PBS=0)
            echo "variant $v, round $round"
            env "${env[@]}" timeout 200 python3 bench/cuda_op.py --runs 30 --seqs 4096,32768,65536,131072 --batches 1,8 \
                --out "$OUT/op_s16_${v}_$round.json" 2>&1 | grep -v "^wrote"
        done
    done
}

stage_s16timing() {
    # Session 16: kernel PBS's phases (SPARQ_CUDA_TIMING, cycles at the SM clock; row 0, block 0), B = 1 and 8
    for b in 1 8; do
        for s in 4096 32768 65536; do
            echo "Llama-2 heads, S = $s, B = $b:"
            SPARQ_CUDA_TIMING=1 timeout 60 python3 bench/cuda_profile.py --seq $s --batch $b --runs 2 2>/dev/null | grep PBS | sort | uniq -c
        done
    done
}

stage_s16e2e() {
    # Session 16: end to end with kernel PBS (the default where it runs: B = 1 up to 32k) and without it
    # (SPARQ_CUDA_PBS=0) in one run: llama-bench tg32 -r 3, shape E2E_SHAPE (default llama2-7b, or llama3-8b), depths
    # E2E_DEPTHS (16k and 32k; session 17 ran it with E2E_DEPTHS=65536 as stage s17e2e64, a copy of this one since
    # folded back in)
    echo "shape ${E2E_SHAPE:-llama2-7b}"
    local m; m=$(shape_model "${E2E_SHAPE:-llama2-7b}") || return 1
    local lb=("${LB_SPARQ[@]}" -m "$m" -p 0 -n 32 -r 3 -o json)
    for d in ${E2E_DEPTHS:-16384 32768}; do
        timeout 100 "${lb[@]}" -d $d -sparq 0 > "$OUT/s16tg_${d}_dense.json" 2>/dev/null
        timeout 100 "${lb[@]}" -d $d -sparq 1 > "$OUT/s16tg_${d}_pbs.json" 2>/dev/null
        SPARQ_CUDA_PBS=0 timeout 100 "${lb[@]}" -d $d -sparq 1 > "$OUT/s16tg_${d}_pbs0.json" 2>/dev/null
        python3 - "$OUT" $d <<'PYEOF'
import json, sys
out, d = sys.argv[1:]
ms = {v: 1000 / json.load(open(f"{out}/s16tg_{d}_{v}.json"))[0]["avg_ts"] for v in ("dense", "pbs", "pbs0")}
print(f"tg d {d}: dense {ms['dense']:.2f} ms, sparq with PBS {ms['pbs']:.2f} ms ({ms['dense']/ms['pbs']:.2f}x), "
      f"sparq with P, B, S {ms['pbs0']:.2f} ms ({ms['dense']/ms['pbs0']:.2f}x)")
PYEOF
    done
}

stage_s16sanitize() {
    # Session 16: compute-sanitizer over tests that run kernel PBS (rows up to 32k, few rows), each tool time-boxed
    local t="tests/test_op_sparq_attn_cuda.py"
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x "$t" \
        -k "(random_case and (33 or 77 or 250 or 401)) or (window_and_sinks and 1) or empty_rows or k2_covering or (long_sequences and (shape2 or shape3 or shape4 or shape5))" \
        > "$OUT/memcheck_pbs.log" 2>&1; echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_pbs.log" | tail -3
    timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x "$t" \
        -k "(random_case and (33 or 77)) or (window_and_sinks and 2) or (long_sequences and on and (shape2 or shape3))" \
        > "$OUT/racecheck_pbs.log" 2>&1; echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" "$OUT/racecheck_pbs.log" | tail -3
}

stage_s17steps() {
    # Session 17: a decode step's GPU kernels by name at 32k, dense vs SparQ (kernel PBS on), Llama-2 shape
    # (bench/cuda_step_kernels.py: PyTorch's profiler, as this machine has no nsys)
    local m; m=$(shape_model) || return 1
    timeout 300 python3 bench/cuda_step_kernels.py --model "$m" --depth 32768 --steps 16 --out "$OUT/s17steps_32k.json" 2>&1 | tail -70
}

stage_s17test() {
    # Session 17: kernel PBS with cells per thread in steps of 4 up to 20 (rows up to 40960 cells): the CUDA op tests
    # (PBS where it runs: now also the 33000- and 40000-cell rows), then the op with PBS vs P, B, S at the cache sizes
    # of decodes at depths 4k, 16k and 32k (n_kv padded to 256: 4352, 16640, 33024), at 32768 and 40960 (or SEQS), ROUNDS
    # rounds. Session 17's 36-cell version ran as stage s17test64, this with SEQS=33024,49408,65792 ROUNDS=1 (folded in)
    echo "tests, PBS: $(timeout 240 python3 -m pytest -q -p no:cacheprovider -x tests/test_op_sparq_attn_cuda.py 2>&1 | tee "$OUT/test_pbs.log" | tail -1)"
    grep -E "^(FAILED|E  )" "$OUT/test_pbs.log" | head -20
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for v in pbs pbs0; do
            local env=(X=0); [ $v = pbs0 ] && env=(SPARQ_CUDA_PBS=0)
            echo "variant $v, round $round"
            env "${env[@]}" timeout 120 python3 bench/cuda_op.py --runs 30 --seqs "${SEQS:-4352,16640,32768,33024,40960}" --batches 1 \
                --out "$OUT/op_s17_${v}_$round.json" 2>&1 | grep -v "^wrote"
        done
    done
}

stage_s17memcheck() {
    # Session 17: compute-sanitizer memcheck over tests whose rows take kernel PBS at 4 to 36 cells per thread (spans
    # off kernel A's chunk edges: 5000, 20000, 33000, 40000 and 70000 cells), time-boxed
    local t="tests/test_op_sparq_attn_cuda.py"
    timeout 250 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x "$t" \
        -k "(random_case and (33 or 77 or 250 or 401)) or (window_and_sinks and 5) or (long_sequences and on and (shape0 or shape1 or shape2 or shape5 or shape6))" \
        > "$OUT/memcheck_s17.log" 2>&1; echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_s17.log" | tail -3
}

stage_s17racecheck() {
    # Session 17: compute-sanitizer racecheck over PBS rows at 4, 20 and 36 cells per thread, time-boxed
    local t="tests/test_op_sparq_attn_cuda.py"
    timeout 250 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -x "$t" \
        -k "(random_case and 33) or (window_and_sinks and 2) or (long_sequences and on and (shape0 or shape5 or shape6))" \
        > "$OUT/racecheck_s17.log" 2>&1; echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" "$OUT/racecheck_s17.log" | tail -3
}

stage_s18test() {
    # Session 18: kernel PBS with clusters of 16 blocks for few long rows (GQA). The CUDA op tests with the default
    # choice (pbs_cluster_for) and with 16 preferred wherever it fits (SPARQ_CUDA_PBS_CLUSTER=16)
    for v in default 16; do
        echo "tests, PBS clusters $v: $(SPARQ_CUDA_PBS_CLUSTER=${v/default/0} timeout 280 python3 -m pytest -q -p no:cacheprovider -x \
            tests/test_op_sparq_attn_cuda.py 2>&1 | tee "$OUT/test_pbs_$v.log" | tail -1)"
        grep -E "^(FAILED|E  )" "$OUT/test_pbs_$v.log" | head -20 || true
    done
}

stage_s18op() {
    # Session 18: the op with PBS at clusters of 8 (as session 17), of 16 where they fit, and P, B, S (SPARQ_CUDA_PBS=0),
    # interleaved, at the cache sizes of decodes at depths 16k-128k (or SEQS), for HEADS (llama3-8b: 8 rows at B = 1)
    for round in $(seq 1 "${ROUNDS:-1}"); do
        for v in pbs8 pbs16 pbs0; do
            local env=(SPARQ_CUDA_PBS_CLUSTER=${v#pbs}); [ $v = pbs0 ] && env=(SPARQ_CUDA_PBS=0)
            echo "${HEADS:-llama3-8b} variant $v, round $round"
            env "${env[@]}" timeout 150 python3 bench/cuda_op.py --heads "${HEADS:-llama3-8b}" --runs 30 --batches 1 \
                --seqs "${SEQS:-16640,33024,49408,65792,131328}" --out "$OUT/op_s18_${HEADS:-llama3-8b}_${v}_$round.json" 2>&1 | grep -v "^wrote"
        done
    done
}

stage_s18ncua() {
    # Session 18: ncu sections of kernel A (sparq_scores) with Llama-3 heads (8 KV heads, G = 4), B = 1, at NCU_SEQS
    # cells: what binds it at 0.7-1.2 TB/s (8 K^T rows in flight made it slower); full reports in $OUT
    for sq in ${NCU_SEQS:-33024 65792}; do
        ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
            --section LaunchStats --section SchedulerStats -k regex:sparq_scores --launch-skip 2 --launch-count 1 \
            python3 bench/cuda_profile.py --seq "$sq" --batch 1 --runs 3 --heads 32 8 > "$OUT/ncu_a_l3_$sq.txt" 2>&1
        echo "S = $sq:"
        grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Grid Size|Issue Slots|Eligible" \
            "$OUT/ncu_a_l3_$sq.txt" | head -24
    done
}

stage_s19anatomy() {
    # Session 19: kernel A in the harness. The tree's kernel against a (the pre-port copy: bit for bit, port_matrix's
    # instantiations) and timed at Llama-2's 32k / 64k; then with Llama-3's decode rows (8 KV heads, G = 4): an empty
    # kernel, 2 / 4 / 8 iterations of K^T rows (k1 8 / 16 / 32), adjacent or random K^T rows, L2 flushed or warm, and
    # per-block phases (%globaltimer marks in a copy). A_U8=1: the phases again with 8 K^T rows in flight for 3-4 heads
    # per pass (a copy with a_unroll edited). (Session 19's head split, stage s19split at fda687b, was slower and is
    # gone; its output: results/session19/split_fda687b.txt)
    (cd bench/harness_a && python3 extract_port.py > /dev/null && nvcc -std=c++17 -arch=sm_90 -O3 -use_fast_math -DKA_PORT \
        -Xptxas -v -o /tmp/ka ka.cu > "$OUT/ptxas_anatomy.txt" 2>&1) || { tail -20 "$OUT/ptxas_anatomy.txt"; return 1; }
    timeout 150 /tmp/ka --only a,port --reps 50 --nkvs 32768,65536 > "$OUT/port_check.txt" 2>&1; echo "port check rc $?"
    grep -E "correctness|port matrix|DIFF|^  (a|port) " "$OUT/port_check.txt" | head -30
    timeout 200 /tmp/ka --anatomy --reps 100 2>&1 | tee "$OUT/anatomy.txt" | grep -v "^device"
    if [ "${A_U8:-0}" = 1 ]; then
        (cd bench/harness_a && sed -i 's/return (NG <= 2 ? 16 : 4)/return (NG <= 2 ? 16 : 8)/' port_gen.cuh port_marks.cuh &&
            grep -q "NG <= 2 ? 16 : 8" port_marks.cuh && nvcc -std=c++17 -arch=sm_90 -O3 -use_fast_math -DKA_PORT -Xptxas -v \
            -o /tmp/ka8 ka.cu > "$OUT/ptxas_anatomy_u8.txt" 2>&1) || { echo "u8 copy failed"; return 1; }
        echo "8 K^T rows in flight for 3-4 heads per pass:"
        timeout 200 /tmp/ka8 --anatomy --reps 100 2>&1 | tee "$OUT/anatomy_u8.txt" | grep -v "^device"
    fi
}

stage_centroidtest() {
    python3 -m pytest -q -p no:cacheprovider tests/test_op_centroid_attn_cuda.py 2>&1 \
        | tee "$OUT/test_centroid_cuda.log" | tail -3
}

stage_s20kpp() {
    # session 20: k-means++ seeding (init kpp) on the GPU: the k-means tests (CUDA against the CPU and the reference),
    # then the clustering of a 32k 7B-shape prefix with its keys on the GPU, even seeds and k-means++ seeds
    python3 -m pytest -q -p no:cacheprovider tests/test_op_centroid_attn_cuda.py -k "kmeans or kpp" 2>&1 \
        | tee "$OUT/test_kmeans_cuda.log" | tail -3
    for init in even kpp even kpp; do
        python3 bench/squeeze_cluster.py --shape llama2-7b --prefix 32768 --backend cuda --resident --init $init \
            --out "$OUT/squeeze_cluster_resident_$init.json" 2>&1 | grep -v "^wrote" | tail -2
    done
}

setup_python
collect_model_parts
for stage in "$@"; do
    echo "=== $stage ($(date +%T))"
    "stage_$stage" || { status=1; echo "stage $stage failed"; [ "$stage" = build ] && exit 1; }
done
exit $status
