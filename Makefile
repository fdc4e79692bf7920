# Two commands do all the set-up on a fresh machine with only python3:
#   make demo   - create .venv, install posttrain, run the embedded default
#   make test   - create .venv, install posttrain with its test extras, run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS := dev,datasets,tensorboard,report,embeddings,bench

.PHONY: demo test lint bench clean

$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python -m posttrain demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

lint: $(BIN)/.installed
	$(BIN)/ruff check posttrain tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
