# Two commands on a fresh machine:  `make train` (the main job)  and  `make test` (the contributor's tests).
# CI (.ci/run) runs `make test-full`: every test but the slow soaks.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv train test test-full test-slow lint docs soak schedules gpu-check gpu-first gpu-bench gpu-planner gpu-sparse gpu-quality gpu-quality-corpus

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -c constraints.txt
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,wandb,hf,plot,docs]"
	touch $@

venv: $(BIN)/.installed

train: venv  ## the default recipe: a small GPT, 2BW over 2 CPU processes (or 2 GPUs)
	$(BIN)/pd2bw-train $(ARGS)

lint: venv  ## ruff: lint and formatting
	$(BIN)/ruff check lightning_pd2bw tests benchmarks examples
	$(BIN)/ruff format --check lightning_pd2bw tests benchmarks examples

# pytest-xdist workers, each taking whole test files (tests/conftest.py: scope_of)
WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(WORKERS)

test: lint docs  ## the contributor's tier: lint, the docs build, unit tests and distributed smoke cases
	PD2BW_DURATIONS=fast $(PYTEST) -m "not slow and not full"

test-full: lint docs  ## what CI runs: lint, the docs build and every test but the slow ones (durations: tests/durations.json)
	PD2BW_DURATIONS=full $(PYTEST)

test-slow: venv  ## the slow tests alone (longer runs kept out of both tiers)
	$(PYTEST) -m slow

docs: venv  ## the documentation site from docs/ into build/site (strict: a broken link or reference fails)
	$(BIN)/python docs/_ext/lint.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

soak: venv  ## a long 2BW run with validation and checkpoints: memory and engine counters stay bounded
	OMP_NUM_THREADS=1 PD2BW_SOAK_STEPS=$${PD2BW_SOAK_STEPS:-3000} $(BIN)/python -m pytest -q tests/distributed/test_soak.py

schedules: venv  ## regenerate the schedule pictures quoted in the docs (the text ones and the concept picture)
	$(BIN)/python -m lightning_pd2bw.observe.draw
	$(BIN)/python -m lightning_pd2bw.observe.concept docs/concept-2bw-vs-flush.png

GPU_PY ?= python3
gpu-check:  ## on a lent GPU machine, with a Python that already has CUDA torch (no install; GPU_PY=...): the GPU tests; fails without CUDA
	@$(GPU_PY) -c "import torch, sys; ok = torch.cuda.is_available(); print('[gpu-check] torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if ok else 'NO CUDA DEVICE'); sys.exit(0 if ok else 'gpu-check needs a CUDA device and a torch built with CUDA (GPU_PY=' + sys.executable + ')')"
	@$(GPU_PY) -c "import pytest, lightning, hydra" || (echo "gpu-check: $(GPU_PY) lacks pytest, lightning or hydra-core; use a Python that has them (GPU_PY=...)" && exit 1)
	PYTHONPATH=$(CURDIR) PD2BW_REQUIRE_GPU=1 $(GPU_PY) -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider

GPU_FIRST_PY ?= python3
gpu-first:  ## on a lent GPU, <= 9 min, unattended (the machine's own python3 with CUDA torch; OUT=folder, GPU_DRY=1: the CPU mode): environment, GEMMs and 2:4 against the planner, a 13B slice under Flush, ZB-H1 and 2BW, the GPU tests
	PYTHONPATH=$(CURDIR) $(GPU_FIRST_PY) benchmarks/gpu_first.py $(if $(GPU_DRY),--cpu)

BENCH_PY ?= $(BIN)/python
gpu-bench: export PYTHONPATH := $(CURDIR)
gpu-bench: $(if $(filter $(BIN)/python,$(BENCH_PY)),venv)  ## on a lent GPU machine (1 GPU, 16 cores), ~10 min: the engine's step vs Lightning on the GPU, then CPU pipelines at d = 2, 4, 8 (BENCH_PY=python3 where python3 already has torch with CUDA)
	$(BENCH_PY) benchmarks/gpu_stage.py --runs lightning,2bw,2bw-casts,flush,flush-casts
	$(BENCH_PY) benchmarks/gpu_stage.py --micro 4 --runs lightning+compile,2bw+compile,flush+compile
	$(BENCH_PY) benchmarks/pipelines.py --m 4 --procs 2 --kinds flush,2bw --docs /tmp/pd2bw-gpu-bench
	$(BENCH_PY) benchmarks/pipelines.py --m 4 --procs 4 --kinds flush,2bw --docs /tmp/pd2bw-gpu-bench
	$(BENCH_PY) benchmarks/pipelines.py --m 8 --procs 8 --kinds flush,2bw --docs /tmp/pd2bw-gpu-bench

gpu-planner: export PYTHONPATH := $(CURDIR)
gpu-planner: $(if $(filter $(BIN)/python,$(BENCH_PY)),venv)  ## on a lent GPU, ~5 min: the 13B stage slice at micro 1 and 2, each step beside the planner's roofline (issue 77)
	$(BENCH_PY) benchmarks/gpu_stage.py --model gpt13b --layers 5 --micro 1 --m 8 --lookahead 7 --runs flush,2bw
	$(BENCH_PY) benchmarks/gpu_stage.py --model gpt13b --layers 5 --micro 2 --m 4 --lookahead 3 --runs flush,2bw

# the planner's name of the lent GPU (h200_141g for an H200): the key its measured factors are recorded under
GPU_DEVICE ?= h100_80g
gpu-sparse: export PYTHONPATH := $(CURDIR)
gpu-sparse: $(if $(filter $(BIN)/python,$(BENCH_PY)),venv)  ## on a lent GPU, ~1 min: a 13B block's matrices, forward + backward, dense against the 2:4 kernels, recorded as the planner's factors (issue 80)
	$(BENCH_PY) benchmarks/gpu_semi_sparse.py --record $(GPU_DEVICE)
	$(BENCH_PY) benchmarks/gpu_semi_sparse.py --tokens 4096 --record $(GPU_DEVICE)

# The corpus comes from Debian's registry, which a lent GPU machine cannot reach: build it here first
# (`make gpu-quality-corpus`) and carry outputs/delayed_rule/fortunes.txt with the working tree.
gpu-quality-corpus: venv  ## the fortunes corpus, built where Debian's package registry is reachable
	$(BIN)/python -c "from pathlib import Path; from benchmarks.corpora import fortunes_corpus; print(fortunes_corpus(Path('outputs/delayed_rule')))"

gpu-quality: export PYTHONPATH := $(CURDIR)
gpu-quality:  ## on a lent GPU (BENCH_PY=python3 with CUDA torch), ~6 min on an H200: GPT-2 124M's time to Flush's loss (issue 76)
	@test -f outputs/delayed_rule/fortunes.txt || (echo "gpu-quality: outputs/delayed_rule/fortunes.txt missing: run make gpu-quality-corpus where Debian's registry is reachable, and carry it" && exit 1)
	$(BENCH_PY) benchmarks/delayed_rule.py --model gpt_small --preset gpt2 --seq-len 1024 --device cuda \
		--steps 1000 --val-every 250 --horizons 1,1.25,1.5 --out outputs/delayed_rule
