#!/bin/bash
# Single-node megatron-ext pretraining (torchrun --standalone), no Slurm needed.
#
# Usage:
#   CKPT_DIR=/data/ckpt/run1 MODEL_ARGS="--num-layers 2 ..." DATA_ARGS="--mock-data" \
#     GPUS_PER_NODE=8 launch/run_single_node.sh [--dry-run] [EXTRA MEGATRON ARGS...]
#   --dry-run (or DRY_RUN=1) prints the exact command it would run, one per
#   line prefixed "+ ", and exits 0. Other arguments (and everything after
#   "--") are appended to the Megatron arguments. -h/--help prints this text.
#
# What it runs:
#   env CUDA_DEVICE_MAX_CONNECTIONS=1 ... torchrun --standalone --nnodes 1
#     --nproc-per-node $GPUS_PER_NODE ... pretrain_gpt_ext.py
#     $MODEL_ARGS $DATA_ARGS --save $CKPT_DIR --load $CKPT_DIR
#     --exit-signal-handler --result-rejected-tracker-filename $TRACKER_FILE
#     $EXTRA_ARGS [script arguments]
#   --save/--load are always CKPT_DIR, so rerunning the same command resumes
#   from latest_checkpointed_iteration.txt.
#
# Configuration: environment variables (defaults in the block below).
#   CKPT_DIR        checkpoint directory ($PWD/checkpoints)
#   MODEL_ARGS, DATA_ARGS, EXTRA_ARGS   Megatron arguments, whitespace-separated
#                   (no quoting; pass arguments containing spaces as script args)
#   PYTHON          Python interpreter (python)
#   LAUNCHER        torchrun (default) | python: run "$PYTHON pretrain_gpt_ext.py"
#                   as a single process (CPU tests/debug)
#   TORCHRUN        torchrun command (torchrun)
#   TRAIN_SCRIPT    training script ($MEGATRON_EXT_ROOT/pretrain_gpt_ext.py)
#   GPUS_PER_NODE   number of processes/GPUs (8)
#   MAX_RESTARTS    relaunches for exit 16 (10), plus SLURM_RESTART_COUNT if set
#   RESTART_MODE    inplace (default: relaunch here) | requeue (scontrol requeue;
#                   only inside a Slurm job)
#   MAX_ROLLBACKS   spike rollbacks (5)
#   MEGATRON_EXT_ON_SPIKE   hook command for exit 42 (run with bash -c, with
#                   MEGATRON_EXT_CKPT_DIR, MEGATRON_EXT_TRACKER_FILE,
#                   MEGATRON_EXT_ROLLBACK, MEGATRON_EXT_MAX_ROLLBACKS and
#                   MEGATRON_EXT_TRAIN_EXIT_CODE=42 set); exit 0 = relaunch
#   TRACKER_FILE    Megatron result-rejected tracker ($CKPT_DIR/result_rejected_tracker.txt)
#   LAUNCH_STATE_DIR  per-rank exit codes ($CKPT_DIR/launch_state)
#   CUDA_DEVICE_MAX_CONNECTIONS (1), NCCL_IB_TIMEOUT (22),
#   TORCH_NCCL_ASYNC_ERROR_HANDLING (1), OMP_NUM_THREADS (8),
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT (270 s: torchrun's grace before SIGKILL)
#   EXTRA_ENV       more NAME=VALUE pairs for the training processes
#   MEGATRON_EXT_ROOT  repository root (default: the parent of launch/)
#   DRY_RUN         1 = same as --dry-run
#
# Signals: SIGTERM, SIGINT, SIGHUP or SIGUSR1 to this script are forwarded as
# SIGTERM to torchrun (or python); Megatron's --exit-signal-handler saves a
# checkpoint and exits; the script then exits 128+N.
#
# Exit codes of the training (handled in launch/common.sh, mx_main):
#    0  finished                                  -> exit 0
#   16  EXIT_CODE_RESUME_TO_DISAMBIGUATE          -> relaunch from the checkpoint
#       (MAX_RESTARTS); budget spent -> exit 16
#   17  EXIT_CODE_FAILED_ON_RESULT_VALIDATION     -> stop, print the failure and
#       the tracker file; exit 17 (do not blindly retry on this machine)
#   42  megatron-ext spike, rollback requested    -> run MEGATRON_EXT_ON_SPIKE and
#       relaunch (MAX_ROLLBACKS); no hook, hook failure or budget spent -> exit 42
#   other                                         -> stop with that code
#   This script also exits 2 on a configuration error and 128+N after stopping
#   on signal N.

set -euo pipefail

# ----------------------------- user configuration ---------------------------
: "${CKPT_DIR:=$PWD/checkpoints}"
: "${MODEL_ARGS:=}"
: "${DATA_ARGS:=}"
: "${EXTRA_ARGS:=}"
: "${PYTHON:=python}"
: "${LAUNCHER:=torchrun}"
: "${TORCHRUN:=torchrun}"
: "${GPUS_PER_NODE:=8}"
: "${MAX_RESTARTS:=10}"
: "${RESTART_MODE:=inplace}"
: "${MAX_ROLLBACKS:=5}"
: "${MEGATRON_EXT_ON_SPIKE:=}"
: "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"
: "${NCCL_IB_TIMEOUT:=22}"
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"
: "${OMP_NUM_THREADS:=8}"
: "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:=270}"
: "${EXTRA_ENV:=}"
# ----------------------------------------------------------------------------

MX_REPO_ROOT=${MEGATRON_EXT_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/common.sh
source "$MX_REPO_ROOT/launch/common.sh"

MX_NAME=single-node
MX_SCRIPT_PATH=${BASH_SOURCE[0]}
MX_DEFAULT_RESTART_MODE=inplace

mx_build_launch_cmd() {
    local torchrun=()
    MX_CMD=("${MX_ENV_PREFIX[@]}")
    if [[ $LAUNCHER == torchrun ]]; then
        mx_words torchrun "$TORCHRUN"
        MX_CMD+=("${torchrun[@]}"
            --standalone
            --nnodes 1
            --nproc-per-node "$GPUS_PER_NODE"
            --max-restarts 0
            "${MX_WORKER_CMD[@]}")
    else
        MX_CMD+=("${MX_WORKER_CMD[@]}")
    fi
}

# `env` execs the launcher, so the child PID is torchrun (or python) itself;
# torchrun forwards SIGTERM to its workers and waits for them.
mx_signal_training() {
    kill -TERM "$MX_CHILD_PID"
}

mx_main "$@"
