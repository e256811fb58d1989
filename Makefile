# The two commands of the README: `make demo` and `make test`. Each sets itself up on a fresh
# machine: a .venv, the right torch (the CPU build where there is no NVIDIA driver), the build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU-only machine takes torch's CPU build (an unpinned torch pulls a multi-GB CUDA build).
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test install lint typecheck bench soak clean sanitize vllm-test vllm-matrix sglang-test

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH)" "triton>=3.2" numpy "pybind11>=2.13" "scikit-build-core>=0.10" \
		"pytest>=8" "pytest-asyncio>=0.24" "pytest-timeout>=2.3" "ruff>=0.6" "mypy>=1.11" "uvloop>=0.19" \
		"click>=8.1" "rich>=13" "hypothesis>=6.100" "anyio>=4.4" "trio>=0.26" "prometheus-client>=0.20" \
		"fastapi>=0.110" "uvicorn>=0.30" "httpx>=0.27" "openai>=1.40" "matplotlib>=3.8" \
		"mkdocs>=1.6" "mkdocs-material>=9.5" "mkdocstrings[python]>=0.26"
	touch $@

install: $(VENV)/.deps
	$(PIP) install -q --no-build-isolation --no-deps -e .

demo: install
	$(PY) -m kvasync demo

test: install sanitize
	$(PY) -m pytest
	$(VENV)/bin/ruff format --check src kernels tests bench examples
	$(VENV)/bin/ruff check src kernels tests bench examples
	$(VENV)/bin/mypy --strict
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

# The C++ harnesses under ThreadSanitizer, then AddressSanitizer + UBSan: any report or broken
# invariant fails. tests/cpp/pool_stress.cpp (the pool and the mapper driven from several threads
# with faults and a racing close) runs STRESS_SECONDS per sanitizer, tests/cpp/group_stress.cpp (a
# tensor-parallel group with 1-4 ranks, faults and racing closes) GROUP_STRESS_SECONDS; the seed
# is printed.
STRESS_SECONDS ?= 15
GROUP_STRESS_SECONDS ?= 4
STRESS_SEED ?= $(shell date +%s)
sanitize:
	cmake -S tests/cpp -B build/tsan -DKVASYNC_SANITIZE=thread >/dev/null
	cmake --build build/tsan -j2
	TSAN_OPTIONS=halt_on_error=1:exitcode=66 \
		build/tsan/pool_stress --seconds $(STRESS_SECONDS) --seed $(STRESS_SEED)
	TSAN_OPTIONS=halt_on_error=1:exitcode=66 \
		build/tsan/group_stress --seconds $(GROUP_STRESS_SECONDS) --seed $(STRESS_SEED)
	cmake -S tests/cpp -B build/asan -DKVASYNC_SANITIZE=address >/dev/null
	cmake --build build/asan -j2
	ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		build/asan/pool_stress --seconds $(STRESS_SECONDS) --seed $(STRESS_SEED)
	ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		build/asan/group_stress --seconds $(GROUP_STRESS_SECONDS) --seed $(STRESS_SEED)

# Not in CI: four loads of SOAK_SECONDS each (default 600), every one run and its table printed
# even when one before failed: random operations with faults (tests/soak.py), 16 processes on one
# share under kill -9 (tests/soak_share.py), streaming HTTP connections dropped mid-stream
# (tests/soak_streaming.py), the fair-share policy under churn and members that only claim
# (tests/soak_fair_share.py); then the model-based test with KVASYNC_MODEL_EXAMPLES examples
# (default 1000). Fails on any leak, double handout, budget overrun, missed deadline, member held
# below its guaranteed minimum while budget is free, claim counted past its bound, or growth of
# RSS or open fds.
SOAK_SECONDS ?= 600
KVASYNC_MODEL_EXAMPLES ?= 1000
soak: install
	status=0; for part in soak soak_share soak_streaming soak_fair_share; do \
		SOAK_SECONDS=$(SOAK_SECONDS) $(PY) tests/$$part.py || status=1; done; exit $$status
	KVASYNC_MODEL_EXAMPLES=$(KVASYNC_MODEL_EXAMPLES) $(PY) -m pytest tests/test_model_based.py -q \
		--timeout=3600 --hypothesis-show-statistics

bench: install
	$(PY) bench/bench_alloc.py

# Not in CI (each vLLM venv and source tree takes GBs; cached under VLLM_CACHE between runs).
# vllm-matrix: for each release in VLLM_VERSIONS a venv installed as the README says for a CPU
# machine, vLLM's sdist for its tests and this tree as one wheel; runs the plugin's tests
# (tests/test_vllm_*.py), then vLLM's KV-cache tests from tests/v1/core with kvasync's pool and
# on stock. Prints one table, writes docs/vllm/matrix-results.md (+ .json), and fails on a suite
# that did not run, was skipped wholesale, a plugin test failure, or a difference from stock not
# in docs/vllm/known-differences.toml. VLLM_MATRIX_ARGS: e.g. --mode ends (the two ends in full,
# the releases between on the plugin's tests, prefix caching and the single-type manager).
# vllm-test: the same for one release (VLLM_VERSION). tests/vllm_matrix.py --help for the rest.
VLLM_VERSIONS ?= 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0
VLLM_VERSION ?= 0.26.0
VLLM_CACHE ?= $(HOME)/.cache/kvasync/vllm-matrix
VLLM_MATRIX_ARGS ?=
# torch's CPU build whatever the machine: the tests run on the CPU, and an unpinned torch is a
# multi-GB CUDA download.
VLLM_TORCH ?= torch==2.13.0
VLLM_MATRIX := $(PY) tests/vllm_matrix.py --python $(PYTHON) --torch "$(VLLM_TORCH)" \
	--cache-dir "$(VLLM_CACHE)"
vllm-matrix: install
	$(VLLM_MATRIX) --versions "$(VLLM_VERSIONS)" $(VLLM_MATRIX_ARGS)

vllm-test: install
	$(VLLM_MATRIX) --versions "$(VLLM_VERSION)" $(VLLM_MATRIX_ARGS)

# Not in CI (the venv takes GBs; cached under SGLANG_CACHE). sglang-test: SGLang's own unit tests
# of its token-to-KV allocators (paged) and radix cache on the CPU, with kvasync's SGLang plugin
# in place and on stock, after the plugin's own tests (tests/test_sglang_plugin.py), in a venv
# made as tests/sglang_suite.py says. Prints both pytest summaries and one table, writes
# docs/sglang/suite-results.md (+ .json), and fails on a suite that did not run, was skipped
# wholesale, a plugin test failure, or a difference from stock not in
# docs/sglang/known-differences.toml. SGLang's tests are not in its wheel (and 0.5.17 has no
# sdist): SGLANG_TESTS is a folder of them laid out as SGLang's repository, checked against
# tests/sglang_suite_support/sglang-$(SGLANG_VERSION)-tests.toml.
SGLANG_VERSION ?= 0.5.17
SGLANG_CACHE ?= $(HOME)/.cache/kvasync/sglang
SGLANG_TESTS ?= $(SGLANG_CACHE)/$(SGLANG_VERSION)/tests
SGLANG_ARGS ?=
sglang-test: install
	$(PY) tests/sglang_suite.py --version "$(SGLANG_VERSION)" --python $(PYTHON) \
		--torch "$(VLLM_TORCH)" --cache-dir "$(SGLANG_CACHE)" --sglang-tests "$(SGLANG_TESTS)" \
		$(SGLANG_ARGS)

clean:
	rm -rf build $(VENV)
