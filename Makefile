# kvpush: `make test` creates .venv, installs everything the suite needs, and runs it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo lint typecheck check bench explore long clean

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
	$(PY) -m ruff check kvpush kvpush_nixl kvpush_vllm tests benchmarks
	$(PY) -m mypy
	$(PY) -m pytest -q

# The main job: router + prefill + decode processes on loopback, bytes verified.
demo: $(STAMP)
	$(PY) -m kvpush demo

lint: $(STAMP)
	$(PY) -m ruff check kvpush kvpush_nixl kvpush_vllm tests benchmarks

typecheck: $(STAMP)
	$(PY) -m mypy

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

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
