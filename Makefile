# oomguard: every target sets up what it needs in a project virtualenv (.venv).
#   make demo      set up, then run the demo (the main job)
#   make test      set up, then lint, check generated files, and run every test
#   make bench     set up, then run the benchmarks and record results under bench/results/
#   make generate  regenerate alert rules, dashboards and configs from the catalog

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup system-deps demo test lint generate bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==25.3
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

system-deps:
	./scripts/install-system-deps.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

generate: setup
	$(BIN)/oomguard generate

test: setup system-deps lint
	$(BIN)/oomguard generate --check
	$(BIN)/python -m pytest -ra

bench: setup system-deps
	$(BIN)/python bench/exporter.py

demo: setup system-deps
	$(BIN)/oomguard demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis demo-report
