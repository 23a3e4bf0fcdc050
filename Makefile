# Everything bootstraps itself: `make demo` and `make test` work on a fresh machine.
# Heavy downloads (pip wheels, Maven jars, harness CLIs) are cached under ~/.cache/polarstream.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CACHE ?= $(HOME)/.cache/polarstream
export PIP_CACHE_DIR := $(CACHE)/pip
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast bench infra-up infra-down harnesses clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,smollm2]'
	$(PY) -m pip check
	@touch $(STAMP)

harnesses: venv
	$(VENV)/bin/polarstream harness install

demo: venv
	$(VENV)/bin/polarstream demo

test: venv
	$(PY) -m pytest -q -ra

test-fast: venv
	$(PY) -m pytest -q -ra -m "not integration and not harness and not slow"

bench: venv
	$(PY) bench/run_all.py

infra-up: venv
	$(VENV)/bin/polarstream infra up

infra-down: venv
	$(VENV)/bin/polarstream infra down

clean:
	rm -rf $(VENV) .polar
