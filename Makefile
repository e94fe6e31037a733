# Every target creates .venv on first use, so a fresh clone needs nothing installed by hand.
# torch is installed first and pinned, so nothing can pull a CUDA build.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: serve test lint format models compile install install-dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[compile]'
	touch $@

$(DEV_STAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(STAMP)
install-dev: $(DEV_STAMP)

# The cluster behind Ray Serve, exactly as deploy/serve-cpu.yaml describes it.
serve: $(STAMP)
	-$(BIN)/slos-serve compile
	@echo "slos-serve: 2 replicas of the demo pair; HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:50051."
	@echo "When curl http://127.0.0.1:8000/health answers (about 30 s), try from another shell:"
	@echo "  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"demo\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32, \"slo\": {\"ttft_ms\": 2000, \"tpot_ms\": 200}}'"
	@echo "  .venv/bin/python -c \"from router.client import Client; print(Client('127.0.0.1:50051').complete('def fib(n):', max_tokens=32).text)\""
	$(BIN)/slos-serve serve deploy/serve-cpu.yaml

# The planner and perf model compiled with mypyc into the user's cache (replica/compiled.py):
# about 35 s once, instant while the sources are unchanged. Serving, tests and simulations
# then run the compiled build. A failed build stops `make test` and leaves `make serve` on the
# Python source.
compile: $(STAMP)
	$(BIN)/slos-serve compile

# One torch thread per process: tests run beside Ray workers on 2 cores, where 2 threads each
# oversubscribe the machine and run 10-100x slower. Tests run what serving runs: the compiled
# planner.
test: $(DEV_STAMP) compile
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/pytest

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
