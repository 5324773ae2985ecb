# polyroute — two commands on a fresh machine:  `make serve`  and  `make test`.
# Each creates .venv if it is missing and installs the pinned dependencies (requirements.lock).

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.polyroute-installed

# No model hub at run time; litellm uses its bundled price map. llama-cpp-python compiles from
# source (about 5 minutes the first time; pip caches the wheel) without host-specific CPU flags.
export HF_HUB_OFFLINE := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test test-fast bench lint redis-server clean help

help:
	@echo "make serve      run the gateway on 127.0.0.1:8400 (embedded defaults)"
	@echo "make test       set up, start nothing by hand, run the whole test suite"
	@echo "make test-fast  the suite without the slow (model-loading) tests"
	@echo "make bench      run the benchmarks under bench/ (tables + bench/results/*.json)"
	@echo "make lint       ruff"

$(STAMP): pyproject.toml requirements.lock
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo ">> installing pinned dependencies into $(VENV) (first run compiles llama-cpp-python: ~5 min)"
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install --progress-bar on -c requirements.lock -e '.[dev]'
	@touch $@

serve: $(STAMP)
	$(VENV)/bin/polyroute serve

redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo ">> installing redis-server (Debian package)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server is missing: sudo apt-get install redis-server"; exit 1; \
	  fi; }
	@redis-server --version

test: $(STAMP) redis-server
	$(VENV)/bin/pytest

test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not slow"

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/overhead_vs_litellm.py
	$(PY) bench/policy.py
	$(PY) bench/noisy_neighbour.py
	$(PY) bench/router.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
