# `make demo` and `make test` create .venv when it is missing, install the package with its dev
# extras, then run. TORCH_SPEC pins torch by default to the tested CPU build; override it, e.g.
#   make test TORCH_SPEC="torch==2.6.0"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.speculant-installed

.PHONY: demo test test-all bench clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m speculant.demo

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

bench: $(STAMP)
	$(PY) benchmarks/engine_overhead.py

clean-venv:
	rm -rf $(VENV)
