# mtpserve — developer entry points. `make serve` and `make test` install what they need.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 0.0.0.0
PORT ?= 8000
METRICS_PORT ?= 9464

.PHONY: setup serve test lint clean system-deps

$(STAMP): pyproject.toml deploy/constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on local disk; pin it so pip never fetches CUDA wheels.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -c deploy/constraints.txt -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Debian tools the deployment checks use: promtool and a real Prometheus.
system-deps:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

serve: setup
	$(VENV)/bin/mtpserve serve --model models/demo --host $(HOST) --port $(PORT) --metrics-port $(METRICS_PORT)

test: setup system-deps
	$(VPY) -m pytest -q -ra

lint: setup
	$(VENV)/bin/ruff check app engine tests train bench
	$(VENV)/bin/mypy app engine

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
