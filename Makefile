PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: run test bench clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/ctxgate serve $(ARGS)

# Test files run on TEST_WORKERS processes, each file whole on one of them (its module
# fixtures, servers included, are built once): `make test TEST_WORKERS=0` runs them in this one.
TEST_WORKERS ?= 2

# The dashboard's browser tests drive Debian's headless Chromium: installed here when run as
# root and missing; if apt fails the browser tests skip, they do not fail.
test: $(VENV)/.installed-dev
	@if [ "$$(id -u)" = 0 ] && ! { command -v chromium && command -v chromedriver; } >/dev/null; then \
		(apt-get update -q && apt-get install -y -q chromium chromium-driver) >/dev/null 2>&1 \
		|| echo "could not install chromium; the browser tests will skip"; fi
	$(BIN)/ruff check .
	@mkdir -p $(VENV)/mypy-path && ln -sfn $(CURDIR) $(VENV)/mypy-path/ctxgate
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

$(VENV)/.installed-bench: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $@ $(VENV)/.installed-dev $(VENV)/.installed

# The LiteLLM proxy the overhead and throughput benches compare against lives in a venv of its
# own: litellm 1.110's `proxy` extra needs a `litellm-proxy` package the registry mirror lacks,
# so the proxy is pinned to 1.108.7, an older litellm than ctxgate's; and its many dependencies
# (fastapi, uvicorn, ...) stay out of the environment ctxgate is tested in.
BENCH_PROXY_VENV := .bench-litellm-proxy

$(BENCH_PROXY_VENV)/bin/litellm:
	$(PYTHON) -m venv $(BENCH_PROXY_VENV)
	$(BENCH_PROXY_VENV)/bin/pip install -q 'litellm[proxy]==1.108.7'

bench: $(VENV)/.installed-bench $(BENCH_PROXY_VENV)/bin/litellm
	@export CTXGATE_BENCH_LITELLM_PROXY=$(CURDIR)/$(BENCH_PROXY_VENV)/bin/litellm; failed=; \
	for b in overhead dialects large_prompt prefix_stability wal cluster large_bodies memory_turn throughput rss; do \
		echo "=== bench/$$b.py"; $(BIN)/python bench/$$b.py || failed="$$failed $$b"; done; \
	test -z "$$failed" || { echo "failed:$$failed (each bench writes its own section of bench/RESULTS.md)"; exit 1; }

clean:
	rm -rf $(VENV) .ctxgate .pytest_cache .hypothesis
