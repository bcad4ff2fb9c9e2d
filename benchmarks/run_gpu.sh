#!/usr/bin/env bash
# The one command for the device machine (H200; torch, triton, transformers preinstalled; no
# network): runs the GPU benchmark from the repository root and leaves its JSON in $OUT.
# Installs nothing. Usage (from the repo root): bash benchmarks/run_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export OUT="${OUT:-$(mktemp -d)}"
export TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
# The script budgets itself to about 7 minutes (dense 250 s, MoE 160 s, plus model set-up);
# the timeout is only a backstop, under the 8 minutes a device call may take.
timeout -k 10 450 "${PYTHON:-python3}" benchmarks/gpu_throughput.py "$@" 2>&1 | tee "$OUT/gpu_throughput.log"
rc=${PIPESTATUS[0]}
echo "exit code: $rc; results in $OUT/gpu_throughput.json"
exit "$rc"
