# kuangchao: `make run` for the demo, `make test` for the test suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KC := $(VENV)/bin/kc
CLUSTER ?= examples/cluster-2x4.yaml
JOB ?= examples/tiny-gpt.yaml

LOCK := constraints.txt

.PHONY: install tools run test bench bench-quick unit process layouts deploy integration security fuzz lint lock up down clean

install: $(VENV)/.installed

# Debian packages the tests need: Prometheus (with promtool) for the observability
# tests, Chromium and its driver for the console's browser test. apt waits up to
# 5 min for another apt (an unattended upgrade) to let go of the dpkg lock.
APT_TOOLS := prometheus chromium chromium-driver
tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && \
	  command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "the tests need: sudo apt-get install $(APT_TOOLS)" >&2; exit 2; fi; \
	  export DEBIAN_FRONTEND=noninteractive; APT="apt-get -o DPkg::Lock::Timeout=300"; \
	  $$APT install -y -q --no-install-recommends $(APT_TOOLS) >/dev/null 2>&1 || { \
	    $$APT update -q >/dev/null && \
	    $$APT install -y -q --no-install-recommends $(APT_TOOLS) >/dev/null; }; }

# torch is installed first and pinned: the CPU build serves here, and an
# unpinned `torch` could pull a multi-GB CUDA build. Everything else comes at the
# versions of $(LOCK), so that CI and a newcomer get what the tests passed with.
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -c $(LOCK) -e ".[dev,hf]"
	touch $@

# Resolve pyproject.toml's ranges again, in a fresh venv, and pin the result in
# $(LOCK). Run it to take newer releases; commit the file once the tests pass.
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q "torch==2.13.0"
	$(LOCK_VENV)/bin/pip install -q -e ".[dev,hf]"
	{ sed -n '1,2p' $(LOCK); \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

run: install
	@set -e; trap '$(KC) down' EXIT; \
	$(KC) up --cluster $(CLUSTER); \
	$(KC) submit $(JOB) --wait | tee /tmp/kc-demo.out; \
	echo; echo "== loss summary =="; \
	grep -E '^(state|step|loss|checkpoint) ' /tmp/kc-demo.out

# Two pytest processes at once: the tiers with a Ray stack, and beside them at a lower
# CPU priority the tier without one (tests/suite.py says why).
test: install tools
	$(PY) tests/suite.py

# Every benchmark at its defaults (about an hour and a half on 2 cores; not part of `make test`,
# which runs each one's --quick mode): bench/results/latest.jsonl and latest.md.
bench: install tools
	$(PY) bench/run_all.py

# Every benchmark's quick mode, checked line by line (tests/bench): `make test` runs the light
# ones (no Ray cluster of their own, little CPU: tests/bench/quick.py); this runs all of them (those
# that start one take up to a few minutes each on 2 cores).
bench-quick: install tools
	KC_BENCH_QUICK=all $(PY) -m pytest -q tests/bench

# The tiers, each on its own; `make test` runs them all and is CI's gate.
# One pytest worker per core (pytest-xdist): the pure tests share nothing but the CPU.
unit: install
	$(PY) -m pytest -q -n auto tests/unit

process: install
	$(PY) -m pytest -q tests/process

layouts: install
	$(PY) -m pytest -q tests/layouts

deploy: install tools
	$(PY) -m pytest -q tests/deploy

integration: install tools
	$(PY) -m pytest -q tests/integration

security: install tools
	$(PY) -m pytest -q tests/security

# The API fuzz test of `make test`, longer and with a new seed each run (it prints it;
# KC_FUZZ_SEED=N replays one).
FUZZ_EXAMPLES ?= 300
fuzz: install
	KC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) KC_FUZZ_SEED=$${KC_FUZZ_SEED:-random} \
		$(PY) -m pytest -q tests/integration/test_api_fuzz.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy platform/spec/jobspec.py platform/jobs/state.py platform/placement/solver.py \
		platform/scheduling/policies.py platform/cluster/topology.py platform/errors.py platform/spec/queues.py \
		platform/placement/score.py platform/scheduling/scheduler.py platform/security/admission.py \
		platform/security/tokens.py

up: install
	$(KC) up --cluster $(CLUSTER)

down: install
	$(KC) down

clean:
	rm -rf $(VENV) $(LOCK_VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
