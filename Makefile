# oomguard: every target sets up what it needs in a project virtualenv (.venv).
#   make demo      set up, then run the demo (the main job)
#   make test      set up, then lint, check generated files, and run every test
#   make bench     set up, then run the benchmarks and record results under bench/results/
#   make generate  regenerate alert rules, dashboards and configs from the catalog

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP      := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
VLLM_STAMP := $(VENV)/.vllm-$(shell cat requirements/vllm-cpu.txt | cksum | cut -d' ' -f1)
# A CPU build of torch 2.13.0 lies in /opt/wheels on this project's machines; elsewhere pip takes
# torch 2.13.0 from PyPI (a CUDA build, larger, and it runs on the CPU as well).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: setup setup-vllm system-deps demo test lint generate bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip==25.3
	$(PIP) install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# vLLM 0.33.0 on the CPU (the tests and the demo run the real server with a model-free executor)
$(VLLM_STAMP): $(STAMP) requirements/vllm-cpu.txt
	$(PIP) install -q $(FIND_LINKS) torch==2.13.0
	$(PIP) install -q --no-deps vllm==0.33.0
	$(PIP) install -q -r requirements/vllm-cpu.txt
	rm -f $(VENV)/.vllm-* && touch $@

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

system-deps:
	./scripts/install-system-deps.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

generate: setup
	$(BIN)/oomguard generate

test: setup setup-vllm system-deps lint
	$(BIN)/oomguard generate --check
	$(BIN)/python -m pytest -ra

bench: setup setup-vllm system-deps
	$(BIN)/python bench/exporter.py
	$(BIN)/python bench/plugin.py
	$(BIN)/python bench/remediator.py
	$(BIN)/python bench/detection.py
	$(BIN)/python bench/outcome.py

demo: setup setup-vllm system-deps
	$(BIN)/oomguard demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis demo-report
