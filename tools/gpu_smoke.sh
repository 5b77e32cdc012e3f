#!/usr/bin/env bash
# GPU smoke test on one H100/H200 (< 8 min): TE layer spec in bf16, z-loss, bucket norms,
# signals, spike -> rollback -> skip drill, lookup, and the instrument overhead ratio.
#   bash tools/gpu_smoke.sh     # from the repository root, after pip install -e '.[gpu,test]'
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec timeout 480 "$PYTHON" tools/gpu_smoke.py "$@"
