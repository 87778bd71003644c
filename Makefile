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

.PHONY: install test demo bench-loss lint clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

demo: $(STAMP)
	$(PY) examples/demo.py $(ARGS)

bench-loss:
	$(MAKE) EXTRAS=bench install
	$(PY) benchmarks/bench_loss.py $(ARGS)

lint:
	$(MAKE) EXTRAS=dev install
	$(VENV)/bin/ruff check fastdistill kernels tests benchmarks examples

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
