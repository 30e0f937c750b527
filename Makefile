# Quick start: `make example` (set up + build the example workspace), `make test` (set up + run the tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup example test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" -e ".[dev,neuron,hf]"
	touch $@

example: setup
	cd examples && ../$(BIN)/neuronbuild build //...

test: setup
	$(BIN)/pytest -q -x tests

lint: setup
	$(BIN)/ruff check neuronbuild tests benchmarks
	$(BIN)/mypy
