#!/bin/bash
# Single-node megatron-ext pretraining (torchrun --standalone), no Slurm needed.
#
#   CKPT_DIR=/data/ckpt/run1 MODEL_ARGS="--num-layers 2 ..." DATA_ARGS="--data-path ..." \
#     GPUS_PER_NODE=8 launch/run_single_node.sh [--dry-run] [MORE TRAINING ARGS...]
#
# Everything else (the knobs and their defaults, the exit-code policy, restarts, spike
# rollbacks, signals) is `megatron-ext supervise --scheduler local`, which this script execs:
# launch/run_single_node.sh --help prints it all. Rerunning the same command resumes from
# CKPT_DIR. MEGATRON_EXT_PYTHON picks the supervisor's interpreter (default: the checkout's
# .venv, else $PYTHON, else python; launch/python.sh); MEGATRON_EXT_ROOT the repository
# (default: the parent of launch/).
set -euo pipefail

# >/dev/null: through an exported CDPATH, cd prints the directory it went to
root=${MEGATRON_EXT_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." >/dev/null && pwd)}
if [[ ! -f $root/megatron_ext/supervise/runner.py ]]; then
    echo "run_single_node.sh: MEGATRON_EXT_ROOT=$root is not a megatron-ext checkout" \
        "(no megatron_ext/supervise/runner.py); unset it or point it at the repository" >&2
    exit 2
fi
# shellcheck source=launch/python.sh
source "$root/launch/python.sh"
export MEGATRON_EXT_ROOT=$root PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
exec "$python" -m megatron_ext.supervise --scheduler local "$@"
