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

# the optional extras the tests run for real (W&B offline)
TEST_STAMP := $(VENV)/.test-extras-stamp
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-build-isolation -e ".[wandb]"
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

test: $(TEST_STAMP)
	$(PY) -m pytest -q

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow"

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

clean:
	rm -rf outputs .pytest_cache
