# `make demo` and `make test` work from a fresh clone: they create .venv and install into it first.
# bash: test-latest compares version lists with process substitution.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
# Rewritten after each successful install; anything that changes what gets installed is a prerequisite.
STAMP := $(VENV)/.installed
INSTALL_INPUTS := pyproject.toml constraints.txt $(wildcard setup.py) $(shell find csrc -type f 2>/dev/null)
PIP := $(VENV_PYTHON) -m pip install -c constraints.txt

.PHONY: install test test-latest test-lightning demo clean

install: $(STAMP)

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

# torch goes in first and alone: the constraints pin then keeps every later resolve on that build
# (a CPU wheel where one is offered locally) instead of a newer torch with CUDA packages.
$(STAMP): $(INSTALL_INPUTS) | $(VENV_PYTHON)
	$(PIP) torch
	$(PIP) -e ".[test,examples]"
	touch $@

# The slowest tests in CI's log: the suite must stay well under 20 minutes on CI's 2 cores.
test: $(STAMP)
	$(VENV_PYTHON) -m pytest -q --durations=25

# The same suite on the newest release of every package (constraints.txt ignored), in a venv of its own, to see what
# a pin move would break without turning CI red. torch stays at the pinned CPU build unless LATEST_TORCH says otherwise
# (a newer torch from PyPI is a CUDA build of several GB): `make test-latest LATEST_TORCH=torch`.
LATEST_VENV := .venv-latest
LATEST_TORCH ?= $(shell grep '^torch==' constraints.txt)

test-latest:
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --upgrade "$(LATEST_TORCH)"
	$(LATEST_VENV)/bin/python -m pip freeze | grep -i '^torch==' > $(LATEST_VENV)/torch.txt
	$(LATEST_VENV)/bin/python -m pip install --upgrade --upgrade-strategy eager -c $(LATEST_VENV)/torch.txt -e ".[test,examples]"
	$(LATEST_VENV)/bin/python -m pip freeze --exclude-editable > $(LATEST_VENV)/versions.txt
	@echo "test-latest: versions in $(LATEST_VENV)/versions.txt; differences from constraints.txt:"
	@diff <(grep -v '^#' constraints.txt | sort -f) <(sed 's/+cpu//' $(LATEST_VENV)/versions.txt | sort -f) | grep '^[<>]' || true
	$(LATEST_VENV)/bin/python -m pytest -q

# Lightning's own tests with RatelStrategy where a test leaves the strategy to Lightning on one CPU device
# (tests/upstream/ratel_swap.py). Not part of `make test`: the tests of the Lightning release next to the pinned one
# (2.6.5's run against the pinned 2.6.6) are cloned once into $(LIGHTNING_DIR), git-ignored. LIGHTNING_DIR=<checkout>
# runs an existing checkout instead; LIGHTNING_TESTS (paths under tests/tests_pytorch) picks the files;
# RATEL_SWAP=--no-ratel-swap runs the same files without the swap (the baseline); RATEL_SWAP_CONFIG, a JSON object of
# RatelStrategy's arguments (e.g. RATEL_SWAP_CONFIG='{"optimizer_states": "device"}'), configures the swapped-in
# strategy. Each file runs in a pytest of its own, so one that hangs or crashes does not hide the others; the target
# fails when any file failed.
LIGHTNING_TAG ?= 2.6.5
LIGHTNING_DIR ?= .lightning/$(LIGHTNING_TAG)
RATEL_SWAP ?=
RATEL_SWAP_CONFIG ?= {}
LIGHTNING_TESTS ?= \
	trainer/optimization/test_backward_calls.py trainer/optimization/test_optimizers.py \
	trainer/optimization/test_manual_optimization.py trainer/optimization/test_multiple_optimizers.py \
	core/test_lightning_optimizer.py \
	callbacks/test_early_stopping.py callbacks/test_lr_monitor.py callbacks/test_gradient_accumulation_scheduler.py \
	loops/test_loops.py loops/test_training_loop.py loops/test_evaluation_loop.py loops/test_training_epoch_loop.py \
	loops/test_progress.py loops/test_prediction_loop.py loops/test_fetchers.py loops/test_evaluation_loop_flow.py \
	loops/test_training_loop_flow_dict.py loops/test_training_loop_flow_scalar.py loops/test_flow_warnings.py \
	loops/test_all.py loops/test_loop_state_dict.py loops/optimization \
	checkpointing/test_checkpoint_callback_frequency.py checkpointing/test_trainer_checkpoint.py \
	checkpointing/test_torch_saving.py checkpointing/test_model_checkpoint.py \
	trainer/connectors/test_checkpoint_connector.py models/test_hooks.py trainer/test_trainer.py

# cloudpickle, which some of those files import and the package does not need, goes into a folder of its own
# (.lightning/deps) rather than into .venv, so that .venv stays at constraints.txt.
LIGHTNING_DEPS := .lightning/deps

test-lightning: $(STAMP)
	test -d $(LIGHTNING_DIR) || git clone --depth 1 --branch $(LIGHTNING_TAG) \
		https://github.com/Lightning-AI/pytorch-lightning $(LIGHTNING_DIR)
	test -d $(LIGHTNING_DEPS) || $(VENV_PYTHON) -m pip install --target $(LIGHTNING_DEPS) "cloudpickle>=1.3,<3.2"
	cd $(LIGHTNING_DIR)/tests/tests_pytorch && status=0; for tests in $(LIGHTNING_TESTS); do \
		PYTHONPATH=$(CURDIR):$(abspath $(LIGHTNING_DEPS)) $(abspath $(VENV_PYTHON)) -m pytest -q -p no:cacheprovider \
			-p tests.upstream.ratel_swap $(RATEL_SWAP) \
			--ratel-swap-config '$(RATEL_SWAP_CONFIG)' --timeout 120 $$tests || status=1; \
	done; exit $$status

demo: $(STAMP)
	$(VENV_PYTHON) examples/demo.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) .lightning build dist outputs lightning_logs .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find lightning_ratel -name '*.so' -delete
