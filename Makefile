# The two commands of the README:  make demo  (the main job)  and  make test  (the test suite).
# Each creates .venv if needed, installs llama-cpp-python without its native build, builds and installs
# this package (incremental: build/ persists, ccache is used when present), then runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# ccache hits across clones of this repo (paths are rewritten relative to it)
export CCACHE_BASEDIR := $(CURDIR)

.PHONY: demo test install venv pack clean test-asan

demo: install
	$(BIN)/sparq-llama demo

test: install
	$(BIN)/python -m pytest -ra --durations=20 tests

install: venv
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(BIN)/pip install --quiet llama-cpp-python==0.3.36
	$(BIN)/pip install --no-build-isolation -v ".[test,hub]"

venv: $(BIN)/python
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "scikit-build-core>=0.10"

# Our op tests against the float64 reference under AddressSanitizer + UBSan: a separate plain-CMake build
# of the libraries (build/asan), loaded through SPARQ_LLAMA_LIB_DIR. Needs `make install` first (for .venv).
ASAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
test-asan: install
	cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE=$(CURDIR)/$(BIN)/python \
		-DCMAKE_C_FLAGS="$(ASAN_FLAGS)" -DCMAKE_CXX_FLAGS="$(ASAN_FLAGS)" -DGGML_OPENMP=OFF
	cmake --build build/asan --target llama
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 SPARQ_LLAMA_LIB_DIR=$(CURDIR)/build/asan/bin \
		$(BIN)/python -m pytest -ra tests/test_op_sparq_attn.py tests/test_reference.py

# Trimmed, patched llama.cpp for a machine without a package registry (see README).
pack:
	$(PYTHON) vendor/fetch.py --pack dist/llama.cpp-src.tgz

clean:
	rm -rf build $(VENV) vendor/llama.cpp
