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

.PHONY: setup example test test-deps lint install uninstall
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@echo "Setting up $(VENV): torch==2.13.0 (CPU), transformers, jax and neuronbuild; a few minutes (about 5 on 2 cores)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	PYTHONWARNINGS="ignore:Compat editable installs" $(BIN)/pip install -q "torch==2.13.0" -e ".[build,dev,neuron,hf]" --config-settings editable_mode=compat
	$(BIN)/python -m compileall -q neuronbuild > /dev/null
	touch $@
	@echo "neuronbuild is installed in $(VENV): run 'source $(VENV)/bin/activate' (or 'make install') to put it on PATH"

example: setup
	cd examples && ../$(BIN)/neuronbuild build //...
	@echo "The build server of examples/ stays up, warm, for the next command (it exits after 3 idle hours):" \
	  "'cd examples && ../$(BIN)/neuronbuild shutdown' stops it now."

# The suite runs in batch mode (no build server; tests/helpers.py also defaults to it). Then the build server's tests
# (tests/test_server.py), which opt in to servers explicitly, each under its own output user root in a temporary
# directory, and shut them down; afterwards no server they started may still be running. CI (.ci/run) runs this;
# --durations lists the 30 slowest steps, to keep the suite under its 20-minute budget.
# The batch suite runs on two pytest-xdist workers (about 22 min on a quiet 2-core machine, up to an hour on a shared
# one; one process takes longer;
# `make test TEST_WORKERS=0` runs it in one process). With --dist loadfile each test file runs whole on one worker,
# and tests/conftest.py keeps every file that uses the session's example build on one worker too, so the example is
# built once.
TEST_WORKERS ?= 2
test: setup test-deps
	NEURONBUILD_NO_SERVER=1 $(BIN)/pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=30 tests \
		--ignore=tests/test_server.py
	tmp=$$(mktemp -d) && $(BIN)/pytest -q -x tests/test_server.py --basetemp "$$tmp/server-tests" \
		&& $(BIN)/python tests/no_servers_left.py "$$tmp" && rm -rf "$$tmp"

# What the tests need beyond the venv: Debian's headless Chromium for the invocation page's browser tests
# (tests/test_report_browser.py; never a browser download). Installed when missing and this is root with apt-get (CI),
# else `make test` stops at once with the command that provides it.
test-deps:
	@test -x /usr/bin/chromium || if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	  echo "Installing Debian's chromium for tests/test_report_browser.py"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else echo "make test: the browser tests need Debian's chromium: sudo apt-get install -y chromium" >&2; exit 2; fi

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
