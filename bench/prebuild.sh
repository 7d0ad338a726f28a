#!/usr/bin/env bash
# Builds the CUDA library (libllama with ggml-cuda, sm_90) on a machine without a GPU, for bench/device.sh to run on a
# lent one without compiling there (PREBUILT=...; see its header). Run from the repository root:
#
#   bash bench/prebuild.sh [build-dir]        # -> .prebuilt/pb.tgz (.prebuilt is to be hidden by .git/info/exclude)
#
# Needs the source pack .device/llama.cpp-src.tgz (bench/device.sh says how to make it), nvcc 13 (CUDA_ARCH, default
# 90) and cuBLAS. Where the toolkit is nvcc alone, cuBLAS's headers and libraries come from its PyPI wheel
# (nvidia-cublas, the toolkit's major version), copied into the toolkit, and an empty libcuda.so stub in its
# lib64/stubs satisfies CMake's driver target: ggml-cuda loads its driver entry points at run time, so the library
# never names libcuda itself and the lent machine preloads its own. The first build takes ~45 minutes on 2 cores;
# after a change to the SparQ kernels, ~1-2 minutes. CMAKE_EXTRA adds CMake arguments, e.g.
# CMAKE_EXTRA=-DSPARQ_CUDA_INSTRUMENT=ON (its cache keeps them). The tarball (~50 MiB, libggml-cuda stripped) holds
# the libraries, llama-bench and llama-batched-bench with the libraries they load, and the two tokenizer files the
# random-weight models of bench/cuda_e2e.py and cuda_batched.py copy (in vocab/).
set -euo pipefail
BUILD=${1:-/tmp/prebuild-cuda}
REPO=$PWD
NVCC=$(command -v nvcc) || { echo "prebuild: no nvcc"; exit 1; }
CUDA=${CUDA_HOME:-$(dirname "$(readlink -f "$NVCC")")/..}  # nvcc may be a wrapper script outside the toolkit
[ -f "$CUDA/include/cuda_runtime.h" ] || CUDA=/usr/local/cuda
[ -f "$CUDA/include/cuda_runtime.h" ] || { echo "prebuild: no CUDA toolkit found (set CUDA_HOME)"; exit 1; }
INC=$(readlink -f "$CUDA/include"); LIB=$(readlink -f "$CUDA/lib64")
MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')

if [ ! -f "$INC/cublas_v2.h" ] || [ ! -e "$LIB/libcublas.so" ]; then
    wheel_dir=$(mktemp -d)
    python3 -m pip download --no-deps "nvidia-cublas>=$MAJOR,<$((MAJOR + 1))" -d "$wheel_dir" > /dev/null
    python3 -m zipfile -e "$wheel_dir"/nvidia_cublas-*.whl "$wheel_dir/x"
    cu=$(dirname "$(find "$wheel_dir/x" -name cublas_v2.h | head -1)")/..
    cp "$cu"/include/*.h "$INC/"
    cp "$cu"/lib/libcublas.so.* "$cu"/lib/libcublasLt.so.* "$LIB/"
    ln -sf "libcublas.so.$MAJOR" "$LIB/libcublas.so"; ln -sf "libcublasLt.so.$MAJOR" "$LIB/libcublasLt.so"
    rm -rf "$wheel_dir"
    echo "prebuild: cuBLAS $MAJOR from PyPI into $CUDA"
fi
if [ ! -e "$LIB/stubs/libcuda.so" ] && ! ldconfig -p | grep -q "libcuda.so "; then
    mkdir -p "$LIB/stubs"
    echo "" | cc -shared -x c - -o "$LIB/stubs/libcuda.so" -Wl,-soname,libcuda.so.1
    echo "prebuild: a stub libcuda.so in $LIB/stubs"
fi

# shellcheck disable=SC2086
cmake -S "$REPO" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DSPARQ_LLAMA_SOURCE="$REPO/.device/llama.cpp-src.tgz" \
    -DPython3_EXECUTABLE="$(command -v python3)" -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined \
    ${CMAKE_EXTRA:-} > "$BUILD.configure.log" 2>&1 || { tail -30 "$BUILD.configure.log"; exit 1; }
# the tools link against libggml-cuda, whose driver symbols the stub does not define (the lent machine's driver
# resolves them when it loads): hence --allow-shlib-undefined for executables
cmake --build "$BUILD" --target llama llama-bench llama-batched-bench -j "$(nproc)"

pack=$(mktemp -d)
cp "$BUILD"/bin/*.so.*.* "$BUILD"/bin/lib*-impl.so "$BUILD"/bin/llama-bench "$BUILD"/bin/llama-batched-bench "$pack/"
strip --strip-unneeded "$pack"/libggml-cuda.so.*
mkdir "$pack/vocab"  # the random-weight models' tokenizers (bench/cuda_e2e.py, cuda_batched.py)
cp "$REPO"/vendor/llama.cpp/models/ggml-vocab-llama-{spm,bpe}.gguf "$pack/vocab/"
mkdir -p .prebuilt
tar -czf .prebuilt/pb.tgz -C "$pack" .
rm -rf "$pack"
echo "prebuild: .prebuilt/pb.tgz ($(du -h .prebuilt/pb.tgz | cut -f1)) from $(git rev-parse --short HEAD 2>/dev/null)"
