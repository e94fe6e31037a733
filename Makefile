# Every target creates .venv on first use, so a fresh clone needs nothing installed by hand.
# torch is installed first and pinned, so nothing can pull a CUDA build.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: serve test lint format models install install-dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	touch $@

$(DEV_STAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(STAMP)
install-dev: $(DEV_STAMP)

serve: $(STAMP)
	$(BIN)/slos-serve demo

test: $(DEV_STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/pytest

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(DEV_STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

models: $(STAMP)
	$(BIN)/python deploy/models/train_demo.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
