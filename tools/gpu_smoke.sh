#!/usr/bin/env bash
# The GPU check: a ladder of rungs for a bare one-GPU H100/H200 machine, ~10 minutes in all.
#
#   bash tools/gpu_smoke.sh [--wheels DIR]    # on the GPU machine; each rung prints a JSON line
#   bash tools/gpu_smoke.sh --cpu-rehearsal   # rungs 2, 4, 5, 7-10 through the CPU harness (CI)
#
# Rung 1 builds its own venv on top of the machine's Python (its torch), so run this with the
# machine's python3 (PYTHON=...); the CPU rehearsal runs in the current environment.
# tools/gpu_smoke.py documents every rung.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
if [[ " $* " == *" --cpu-rehearsal "* && -x .venv/bin/python && $PYTHON == python3 ]]; then
    PYTHON=.venv/bin/python
fi
exec timeout "${GPU_SMOKE_TIMEOUT:-900}" "$PYTHON" tools/gpu_smoke.py "$@"
