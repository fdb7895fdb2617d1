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

.PHONY: install test test-latest demo clean

install: $(STAMP)

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

# torch goes in first and alone: the constraints pin then keeps every later resolve on that build
# (a CPU wheel where one is offered locally) instead of a newer torch with CUDA packages.
$(STAMP): $(INSTALL_INPUTS) | $(VENV_PYTHON)
	$(PIP) torch
	$(PIP) -e ".[test,examples]"
	touch $@

test: $(STAMP)
	$(VENV_PYTHON) -m pytest -q

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

demo: $(STAMP)
	$(VENV_PYTHON) examples/demo.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) build dist outputs lightning_logs .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find lightning_ratel -name '*.so' -delete
