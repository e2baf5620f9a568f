# Two commands for a newcomer: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# CPU torch is pinned here (a plain `torch` would pull a multi-GB CUDA build);
# pyproject keeps the open range torch>=2.4.
$(STAMP): pyproject.toml setup.py protocol/_kernels.c | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,demo]'
	touch $(STAMP)

# Bytecode compiled once, up front: where PYTHONDONTWRITEBYTECODE is set (this project's machine
# image sets it), every process compiles the package from source again: 0.0-0.45 s more CPU to
# import the node here (1.59-1.86 s against 1.87-2.31 s, alternating), for each of the few
# hundred processes the tests start. An edited module still loads from its source.
PYC := $(BIN)/python -m compileall -q protocol node tracker bench >/dev/null

demo: $(STAMP)
	$(PYC)
	$(BIN)/patchswarm demo

# A worker per core: the real-process tests mostly wait, so two cores run two at once.
test: $(STAMP)
	$(PYC)
	$(BIN)/python -m pytest -n auto

bench: $(STAMP)
	$(BIN)/python bench/codec.py --size small --pairs 2

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
