#!/usr/bin/env bash
# The one command for the device machine (H200; torch, triton, transformers, accelerate
# preinstalled; no network). Installs nothing; leaves logs and JSON in $OUT. From the repo root:
#   bash benchmarks/run_gpu.sh [ARGS]               # the throughput run (gpu_throughput.py ARGS)
#   bash benchmarks/run_gpu.sh offload [MODEL ARGS] # issue 16: weights beyond device memory,
#                                                   # MODEL llama8b (default) or qwen3moe
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export OUT="${OUT:-$(mktemp -d)}"
export TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

if [ "${1:-}" = "offload" ]; then
    shift
    model="${1:-llama8b}"
    [ $# -gt 0 ] && shift
    work="${OFFLOAD_WORKDIR:-$(mktemp -d)}"
    # 1. the CUDA path on a tiny model: streamed == resident greedy tokens, both systems' rows
    timeout -k 10 120 "$PY" benchmarks/offload.py --model tiny --workdir "$work" 2>&1 \
        | tee "$OUT/offload_tiny.log"
    rc=${PIPESTATUS[0]}
    # 2. the model (random bf16, built on the GPU and saved under $work; a quarter of its
    # weights as the device budget), against HF accelerate at its best batch size. Bounded so
    # both steps fit the 8 minutes of one device call; the summary line lists each phase's s.
    if [ "$model" != "tiny" ]; then
        timeout -k 10 330 "$PY" benchmarks/offload.py --model "$model" --workdir "$work" \
            --no-check --hf-time-limit 45 "$@" 2>&1 | tee "$OUT/offload_$model.log"
        rc2=${PIPESTATUS[0]}
        [ "$rc" -eq 0 ] && rc=$rc2
    fi
    rm -rf "$work"  # a Qwen3-30B-A3B shape takes 61 of the machine's 64 GB of disk
    echo "exit code: $rc; results in $OUT/offload_*.json"
    exit "$rc"
fi

# The script budgets itself to about 7 minutes (dense 250 s, MoE 160 s, plus model set-up);
# the timeout is only a backstop, under the 8 minutes a device call may take.
timeout -k 10 450 "$PY" benchmarks/gpu_throughput.py "$@" 2>&1 | tee "$OUT/gpu_throughput.log"
rc=${PIPESTATUS[0]}
echo "exit code: $rc; results in $OUT/gpu_throughput.json"
exit "$rc"
