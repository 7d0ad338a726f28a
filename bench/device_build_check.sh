#!/usr/bin/env bash
# On a lent GPU machine without a package registry: build sparq-llama with CUDA from the carried source pack
# and wheels, then check it (build info, devices, op tests) and time the CPU op there. Carry `.device`
# (made by: python vendor/fetch.py --pack .device/llama.cpp-src.tgz; a pure-Python llama-cpp-python wheel and
# the test wheels in .device/wheels). Writes logs and results to $OUT.
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m venv --system-site-packages /tmp/sparq-venv
. /tmp/sparq-venv/bin/activate
pip install -q --no-index --find-links .device/wheels pytest tqdm jinja2 diskcache typing-extensions scikit-build-core numpy
pip install -q --no-index --no-deps .device/llama_cpp_python-0.3.36-*.whl
start=$(date +%s)
SPARQ_LLAMA_SOURCE=$PWD/.device/llama.cpp-src.tgz \
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" \
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    pip install --no-build-isolation --no-deps --no-index -v . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
sparq-llama info | tee "$OUT/info.txt"
python -m pytest -q -p no:cacheprovider tests/test_op_sparq_attn.py tests/test_reference.py 2>&1 | tail -3
python bench/op_cpu.py --runs 20 --threads 1,2,16 --out "$OUT/op_cpu_gpu_host.json" | tail -20
