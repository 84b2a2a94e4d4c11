# Set-up and entry points. Every target creates the virtual environment on first use and installs
# the CPU build of torch 2.13.0 before anything else, so nothing pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m mfsdp_core.train --steps 30

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
