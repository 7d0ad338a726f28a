#!/bin/bash
# Kernel-A harness on the device: compile, check every variant against a, time them, profile a few under ncu.
#   bash bench/harness_a/run.sh            (writes into $OUT, else /tmp/ka_out)
# SKIP_NCU=1 skips ncu; NCU_VARIANTS picks what it profiles.
set -o pipefail
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/ka_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
t0=$(date +%s)
nvcc -std=c++17 -arch=sm_90 -O3 -use_fast_math -Xptxas -v -o /tmp/ka ka.cu > "$OUT/ptxas.txt" 2>&1 || { cat "$OUT/ptxas.txt"; exit 1; }
echo "compiled in $(( $(date +%s) - t0 )) s"
# clean flush (read): checks, all variants at 4k/32k/64k/128k (+ 32k with a power-of-two row stride)
/tmp/ka --reps ${REPS:-200} > "$OUT/timing.txt" 2>&1; echo "rc $?"
grep -E "check n_kv|host reference|DIFF|correctness|empty kernel" "$OUT/timing.txt"
echo "timing done at $(( $(date +%s) - t0 )) s"
# dirty flush (write), a subset, for comparison with run 1
/tmp/ka --dirty --nocheck --reps 100 --nkvs 32768,65536 \
    --only a,flat,roof,reg_u16_b2,reg_u16_b2_h,pipe_u16_b1_h,pipe_u8_b2_h > "$OUT/timing_dirty.txt" 2>&1; echo "rc $?"
echo "dirty timing done at $(( $(date +%s) - t0 )) s"
if [ -z "$SKIP_NCU" ]; then
    V=${NCU_VARIANTS:-a,roof,flat,reg_u16_b2_h,pipe_u16_b1_h,pipe_u8_b2_h,bulk_s3_r8_b2}
    for n in 32768 65536; do
        ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct \
            -k "regex:sparq_scores|ka_" /tmp/ka --ncu --nkv $n --only "$V" > "$OUT/ncu_$n.txt" 2>&1
    done
    echo "ncu done at $(( $(date +%s) - t0 )) s"
    for n in 32768 65536; do echo "ncu n_kv $n:"; grep -E "^  [a-zA-Z]|duration|bytes_|throughput|warps_active|hit_rate" "$OUT/ncu_$n.txt" | sed -e 's/(var::var_args.*//' -e 's/(sparq_args.*//' ; done
fi
sed -n '/^TABLE/,$p' "$OUT/timing.txt"
echo "dirty:"; sed -n '/^TABLE/,$p' "$OUT/timing_dirty.txt"
grep -A3 "timeline" "$OUT/timing.txt" | grep -v "active blocks\|ending" | head -40
