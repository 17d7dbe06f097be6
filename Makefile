# Two commands set everything up on a fresh machine:
#   make demo   - creates .venv, installs, runs the main job on the embedded default target
#   make test   - creates .venv, installs with test extras, runs the suite
PYTHON ?= python3
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
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build src/*.egg-info
