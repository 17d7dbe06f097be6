# Two commands set everything up on a fresh machine:
#   make demo   - creates .venv, installs, runs the main job on the embedded default target
#   make test   - creates .venv, installs with test extras, runs the suite
PYTHON ?= python3
# Test files run in this many processes, each file whole in one (its module fixtures built once): the suite's
# tiny models use one thread each, so a second process keeps a 2-core machine's other core busy
TEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: here it is a local CPU wheel; a bare `torch` would pull a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/eaglewire demo

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) build src/*.egg-info
