# Sluice: `make run` serves the demo model on vLLM (CPU) at http://127.0.0.1:8000;
# `make test` runs the test suite. Both set up .venv on first use.

PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
LINTED := server engine_adapters tests bench

.PHONY: setup run run-sim fleet test test-quick lint bench-throughput bench-flood clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup-venv.sh
	PYTHON="$(PYTHON)" VENV="$(VENV)" scripts/setup-venv.sh
	touch $@

run: setup
	$(BIN)/sluice serve --host $(HOST) --port $(PORT) --demo-lora

run-sim: setup
	$(BIN)/sluice serve --engine sim --host $(HOST) --port $(PORT)

# Redis, two replicas of the demo model and vLLM's router at $(PORT) (redis-server from Debian).
FLEET_ARGS ?=
fleet: setup
	$(BIN)/sluice fleet --host $(HOST) --port $(PORT) $(FLEET_ARGS)

# pytest-xdist, two workers more than cores: the service and system tests spend much of their
# time waiting on the wall clock and on other processes (generations paced by an engine, servers
# starting and stopping, deadlines, grace periods), and a core whose worker waits would
# otherwise sit idle. The tests of each session server on the real engine share one worker
# (`--dist loadgroup`). (2 cores: the quick tier idle, 2026-12-07: 3 workers 28.1-28.2 s, 4
# workers 24.5-25.0 s, 5 workers 25.4 s, 6 workers 31.2 s; the whole suite with both cores busy,
# 2026-12-08: 2 workers 6:17, 4 workers 4:46 and 5:02, then 4:33 with the spare replica
# starting beside the session's server.)
PARALLEL ?= -n $$(( $$(nproc) + 2 )) --dist loadgroup
# The tests cache compiled bytecode (in the git-ignored __pycache__ folders) even where the
# environment says not to write it: each worker compiles and assertion-rewrites every test
# module and the server it imports, ~1.7 s a worker on 2 cores when nothing is cached.
TEST_ENV := PYTHONDONTWRITEBYTECODE=

test: setup
	scripts/install-test-deps.sh
	$(TEST_ENV) $(BIN)/pytest $(PARALLEL) $(PYTEST_ARGS)

test-quick: setup  # the unit and service tiers (no vLLM, processes, browser, Prometheus), unfuzzed
	$(TEST_ENV) $(BIN)/pytest $(PARALLEL) -m "not system and not slow" $(PYTEST_ARGS)

lint: setup  # what CI runs before the tests: lint, format, types, import rules
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy server engine_adapters
	$(BIN)/lint-imports

bench-throughput: setup
	$(BIN)/python bench/throughput.py

bench-flood: setup
	$(BIN)/python bench/flood.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
