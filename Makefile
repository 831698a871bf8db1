# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
NPROC ?= 1

.PHONY: venv demo demo-tools demo-moe test test-fast verl-reference clean

$(STAMP): requirements.txt setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

venv: $(STAMP)

# the optional extras the tests run for real (W&B offline, peft for the LoRA export)
TEST_STAMP := $(VENV)/.test-extras-stamp
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-build-isolation -e ".[wandb,test]"
	@touch $(TEST_STAMP)

# a 50-step SFT warm-up (the answer format), then GRPO on the synthetic addition task
demo: venv
	$(PY) scripts/train_sft.py --config configs/tiny_cpu.yaml $(ARGS)
	$(PY) scripts/train_ppo.py --config configs/tiny_cpu.yaml model.path=outputs/tiny_cpu/sft_hf $(ARGS)

# SFT warm-up on generated tool-use demonstrations, then GRPO with multi-turn tool-calling rollouts
demo-tools: venv
	$(PY) scripts/train_sft.py --config configs/tiny_cpu_tools.yaml $(ARGS)
	$(PY) scripts/train_ppo.py --config configs/tiny_cpu_tools.yaml model.path=outputs/tiny_cpu_tools/sft_hf $(ARGS)

# a tiny Qwen3-MoE with its 8 experts split over two processes (expert parallel 2) and routing replay
demo-moe: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node=2 scripts/train_sft.py --config configs/tiny_cpu_moe.yaml $(ARGS)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node=2 scripts/train_ppo.py --config configs/tiny_cpu_moe.yaml model.path=outputs/tiny_cpu_moe/sft_hf $(ARGS)

# two pytest-xdist workers: each starts on its half of the tests in collection order and, once idle, takes
# tests from the end of the other's share (worksteal); TEST_WORKERS=0 runs in one process; the 25 slowest
# are listed at the end (the suite must stay under 20 minutes on 2 cores)
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow"

# the reference data of tests/test_verl_parity.py, from verl 0.9.1 itself in a side venv (never .venv)
VERL_VENV ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed-stamp
$(VERL_STAMP): requirements-verl.txt
	@test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q -r requirements-verl.txt
	$(VERL_VENV)/bin/python -m pip install -q --no-deps verl==0.9.1
	@touch $(VERL_STAMP)

verl-reference: $(VERL_STAMP)
	$(VERL_VENV)/bin/python tests/verl_reference/make_reference.py
	$(VERL_VENV)/bin/python tests/verl_reference/make_gae_holes.py
	$(VERL_VENV)/bin/python tests/verl_reference/make_rollout_correction.py
	$(VERL_VENV)/bin/python tests/verl_reference/make_math_dapo.py
	$(VERL_VENV)/bin/python tests/verl_reference/make_more_algos.py

# Benchmarks on CPU, one command: the side environments the TRL comparisons need (made once, reused when
# present: .venv-bench with TRL 1.16 for GRPO, .venv-bench-trl100 with TRL 1.0, the last with PPOTrainer),
# then every CPU benchmark in turn; each rewrites its section of benchmarks/RESULTS.md and its Summary rows.
# `make bench BENCHES="bench_reshard bench_memory"` runs some of them. 18 min on 2 cores from a fresh clone
# (2026-12-06, side environments included).
.PHONY: bench bench-envs
BENCHES ?= bench_rollout bench_decode_width bench_reshard bench_memory bench_grpo_vs_trl bench_ppo_vs_trl bench_split \
	bench_micro_batches profile_demo ablate_demo

# $(1): the environment's folder, $(2): the TRL version it must hold
define bench_env
	@$(1)/bin/python -c "import sys, trl; sys.exit(trl.__version__ != '$(2)')" 2>/dev/null || { \
	  echo "making $(1) (TRL $(2))"; \
	  { test -x $(1)/bin/python || $(PYTHON) -m venv $(1); } && \
	  $(1)/bin/pip install -q -r requirements.txt -r requirements-bench.txt && \
	  $(1)/bin/pip install -q trl==$(2) && \
	  $(1)/bin/pip install -q --no-deps --no-build-isolation -e .; }
endef

bench-envs: venv
	$(call bench_env,.venv-bench,1.16.0)
	$(call bench_env,.venv-bench-trl100,1.0.0)

bench: bench-envs
	@set -e; for b in $(BENCHES); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py; done

clean:
	rm -rf outputs .pytest_cache
