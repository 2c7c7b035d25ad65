# One virtual environment (.venv) holds the package, its test extras and the CPU build of torch (the parity
# reference). `make quickstart` and `make test` each create it on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORKDIR ?= runs/quickstart
PYTEST_ARGS ?=

.PHONY: setup quickstart test clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch==2.13.0 is the CPU wheel these machines carry; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

setup: $(BIN)/.installed

quickstart: setup
	$(BIN)/arpo-jax quickstart --workdir $(WORKDIR)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
