#!/bin/bash
# Checks and times the tree's kernel A (port_gen.cuh, made here by extract_port.py) against a (the pre-port copy).
#   bash bench/harness_a/run_port.sh       (writes into $OUT, else /tmp/ka_out)
set -o pipefail
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/ka_out}
mkdir -p "$OUT"
t0=$(date +%s)
python3 extract_port.py || exit 1  # port_gen.cuh: kernel A of this tree's sparq-attn.cu (generated, not tracked)
nvcc -std=c++17 -arch=sm_90 -O3 -use_fast_math -DKA_PORT -Xptxas -v -o /tmp/ka ka.cu > "$OUT/ptxas_port.txt" 2>&1 || { cat "$OUT/ptxas_port.txt"; exit 1; }
echo "compiled in $(( $(date +%s) - t0 )) s"
/tmp/ka --reps 200 --only a,port,reg_u16_b2_h,pipe_u8_b2_h,roof,flat > "$OUT/timing_port.txt" 2>&1; echo "rc $?"
grep -E "check n_kv|host reference|DIFF|correctness|port|empty kernel" "$OUT/timing_port.txt" | grep -v "^[0-9]" | head -60
echo "timing done at $(( $(date +%s) - t0 )) s"
/tmp/ka --dirty --nocheck --reps 100 --nkvs 32768,65536 --only a,port > "$OUT/timing_port_dirty.txt" 2>&1; echo "rc $?"
# where the spills of the NG = 8 instantiations sit (SASS)
cuobjdump -sass /tmp/ka > /tmp/ka.sass 2>/dev/null
python3 - "$OUT/sass_spills.txt" <<'PY'
import re, sys
out = open(sys.argv[1], "w")
cur = None; buf = []
def flush():
    if cur and ('port' in cur) and 'sparq_scores' in cur:
        n_stl = sum('STL' in l for l in buf); n_ldl = sum('LDL' in l for l in buf)
        bra = [i for i, l in enumerate(buf) if re.search(r'\bBRA\b', l)]
        out.write(f"{cur}: {len(buf)} instructions, STL {n_stl}, LDL {n_ldl}\n")
        for i, l in enumerate(buf):
            if 'STL' in l or 'LDL' in l:
                out.write(f"   [{i}] {l.strip()[:110]}\n")
        for i in bra:
            out.write(f"   branch [{i}] {buf[i].strip()[:110]}\n")
for l in open('/tmp/ka.sass'):
    m = re.match(r'\s+Function : (\S+)', l)
    if m:
        flush(); cur = m.group(1); buf = []
    elif cur and re.search(r'/\*[0-9a-f]{4}\*/', l):
        buf.append(l)
flush()
PY
grep -E "instructions" "$OUT/sass_spills.txt"
for n in 32768 65536 131072; do
    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \
        -k "regex:sparq_scores|ka_roof" /tmp/ka --ncu --nocheck --nkv $n --only a,port,roof > "$OUT/ncu_port_$n.txt" 2>&1
    echo "ncu n_kv $n:"; grep -E "^  [a-zA-Z]|duration|throughput" "$OUT/ncu_port_$n.txt" | sed -e 's/(.*//'
done
echo "ncu done at $(( $(date +%s) - t0 )) s"
sed -n '/^TABLE/,$p' "$OUT/timing_port.txt"
echo "dirty:"; sed -n '/^TABLE/,$p' "$OUT/timing_port_dirty.txt"
