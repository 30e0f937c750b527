# Quick start: `make example` (set up + build the example workspace), `make test` (set up + run the tests).
# The editable install is path-based (editable_mode=compat: a .pth line naming this directory), not setuptools'
# import-hook finder, which imports pathlib and re into every interpreter start (a bare `python -c pass` took 0.05 s
# with it, 0.01 s without: most of a no-op client through the build server). Its modules are byte-compiled once, as
# pip does for a wheel: where PYTHONDONTWRITEBYTECODE is set (CI machines, sandboxes) every process would otherwise
# compile what it imports (~35 ms per client start, ~0.2 s per batch command).
# `make install` puts a `neuronbuild` command on your PATH (a link to the venv's, in $(PREFIX)/bin).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PREFIX ?= $(HOME)/.local

.PHONY: setup example test lint install uninstall
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	PYTHONWARNINGS="ignore:Compat editable installs" $(BIN)/pip install -q "torch==2.13.0" -e ".[build,dev,neuron,hf]" --config-settings editable_mode=compat
	$(BIN)/python -m compileall -q neuronbuild > /dev/null
	touch $@
	@echo "neuronbuild is installed in $(VENV): run 'source $(VENV)/bin/activate' (or 'make install') to put it on PATH"

example: setup
	cd examples && ../$(BIN)/neuronbuild build //...

# The suite runs in batch mode (no build server; tests/helpers.py also defaults to it). Then the build server's tests
# (tests/test_server.py), which opt in to servers explicitly, each under its own output user root in a temporary
# directory, and shut them down; afterwards no server they started may still be running. CI (.ci/run) runs this;
# --durations lists the 30 slowest steps, to keep the suite under its 20-minute budget.
# The batch suite runs on two pytest-xdist workers (about 22 min on this 2-core machine, one process over 30 min;
# `make test TEST_WORKERS=0` runs it in one process). With --dist loadfile each test file runs whole on one worker,
# and tests/conftest.py keeps every file that uses the session's example build on one worker too, so the example is
# built once.
TEST_WORKERS ?= 2
test: setup
	NEURONBUILD_NO_SERVER=1 $(BIN)/pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=30 tests \
		--ignore=tests/test_server.py
	tmp=$$(mktemp -d) && $(BIN)/pytest -q -x tests/test_server.py --basetemp "$$tmp/server-tests" \
		&& $(BIN)/python tests/no_servers_left.py "$$tmp" && rm -rf "$$tmp"

lint: setup
	$(BIN)/ruff check neuronbuild tests benchmarks
	$(BIN)/mypy

install: setup
	mkdir -p $(PREFIX)/bin
	ln -sfn $(abspath $(BIN))/neuronbuild $(PREFIX)/bin/neuronbuild
	@case ":$$PATH:" in *":$(PREFIX)/bin:"*) echo "neuronbuild -> $(PREFIX)/bin/neuronbuild";; \
	  *) echo "neuronbuild -> $(PREFIX)/bin/neuronbuild; add $(PREFIX)/bin to PATH to call it";; esac

uninstall:
	rm -f $(PREFIX)/bin/neuronbuild
