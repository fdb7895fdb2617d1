# `make demo` and `make test` work from a fresh clone: they create .venv and install into it first.
PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
# Rewritten after each successful install; anything that changes what gets installed is a prerequisite.
STAMP := $(VENV)/.installed
INSTALL_INPUTS := pyproject.toml constraints.txt $(wildcard setup.py) $(shell find csrc -type f 2>/dev/null)
PIP := $(VENV_PYTHON) -m pip install -c constraints.txt

.PHONY: install test demo clean

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

demo: $(STAMP)
	$(VENV_PYTHON) examples/demo.py

clean:
	rm -rf $(VENV) build dist outputs lightning_logs .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find lightning_ratel -name '*.so' -delete
