# shellcheck shell=bash
# launch/common.sh: shared code for the megatron-ext launchers.
#
# This file is sourced (not executed) by launch/pretrain_gpt_ext.sbatch and
# launch/run_single_node.sh, which set `set -euo pipefail` first and fill in
# their configuration block before they call `mx_main "$@"`. It holds:
#   * argument parsing (--dry-run / DRY_RUN=1, --help, pass-through args);
#   * construction of the training command (launcher + env + Megatron args);
#   * the launch loop: run, wait (with signal forwarding), decode the exit
#     code, then restart, requeue, run the spike hook or stop.
#
# What a launcher script must define before calling mx_main:
#   MX_NAME           short name for log lines ("sbatch", "single-node")
#   MX_SCRIPT_PATH    path of the launcher script (for --help)
#   MX_REPO_ROOT      repository root (where pretrain_gpt_ext.py lives)
#   mx_build_launch_cmd   function: turns MX_ENV_PREFIX and MX_WORKER_CMD into
#                     MX_CMD (the full command for one attempt), e.g. with
#                     srun + torchrun rendezvous, or torchrun --standalone
#   mx_signal_training    function: asks the running training to save a
#                     checkpoint and exit (the child's PID is MX_CHILD_PID)
#   MX_DEFAULT_RESTART_MODE   "requeue" (Slurm batch) or "inplace"
#
# Exit codes understood (the single source of truth; see mx_main's `case`):
#    0  training finished                       -> exit 0
#   16  EXIT_CODE_RESUME_TO_DISAMBIGUATE        -> resume from the last
#       checkpoint (RESTART_MODE=requeue: scontrol requeue; inplace: relaunch
#       in this allocation), at most MAX_RESTARTS restarts in all
#   17  EXIT_CODE_FAILED_ON_RESULT_VALIDATION   -> stop: print the failure, the
#       tracker file and suspect nodes; exit 17 (never retried blindly)
#   42  megatron-ext "spike detected, rollback requested" -> run
#       $MEGATRON_EXT_ON_SPIKE (default when the run has --signals-dir:
#       megatron-ext skiplist --apply ... $SKIPLIST_ARGS), then relaunch (at
#       most MAX_ROLLBACKS times); without a hook: stop with exit 42
#   other non-zero                              -> stop with that code
#
# torchrun reports exit code 1 whenever a worker fails, whatever the worker's
# own code, so each worker runs under a tiny bash wrapper (MX_RANK_WRAPPER)
# that writes its exit code to $MEGATRON_EXT_EXIT_CODE_DIR/rank-$RANK.rc;
# mx_effective_rc reads them back (the directory must be on a filesystem that
# all nodes share, as the checkpoint directory already is).

# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------

mx_log() {
    printf '[megatron-ext %s] %s\n' "${MX_NAME:-launch}" "$*" >&2
}

# mx_die CODE MESSAGE...: log an error and exit with CODE.
mx_die() {
    local code=$1
    shift
    mx_log "ERROR: $*"
    exit "$code"
}

# mx_quote WORD...: print the words as one shell-quoted command line that
# bash (or Python's shlex.split) parses back into the same words.
mx_quote() {
    local out="" word
    for word in "$@"; do
        if [[ -n $word && $word =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
            out+="${out:+ }$word"
        else
            out+="${out:+ }'${word//\'/\'\\\'\'}'"
        fi
    done
    printf '%s\n' "$out"
}

# mx_words ARRAY_NAME STRING: split STRING on whitespace into the named
# array. No globbing, no quote processing: an argument that contains spaces
# must be passed as a positional argument of the launcher instead.
mx_words() {
    # shellcheck disable=SC2162  # -r is given; SC2162 misfires on -ra
    read -r -a "$1" <<<"${2:-}"
}

mx_is_uint() {
    [[ ${1:-} =~ ^[0-9]+$ ]]
}

# mx_usage: print the launcher's header comment (everything from line 2 up to
# the first line that is not a comment).
mx_usage() {
    local line
    {
        read -r _ || true
        while IFS= read -r line; do
            [[ $line == \#* ]] || break
            if [[ $line == '#SBATCH'* ]]; then continue; fi
            line=${line#\#}
            printf '%s\n' "${line# }"
        done
    } <"$MX_SCRIPT_PATH"
}

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

# mx_parse_cli "$@": --dry-run and --help are ours; everything else (and
# anything after a `--`) is appended to the training arguments.
mx_parse_cli() {
    MX_DRY_RUN=0
    case "${DRY_RUN:-0}" in
        1 | true | yes) MX_DRY_RUN=1 ;;
        0 | false | no | "") ;;
        *) mx_die 2 "DRY_RUN must be 0 or 1, got '${DRY_RUN}'" ;;
    esac
    MX_CLI_ARGS=()
    while (($#)); do
        case "$1" in
            --dry-run) MX_DRY_RUN=1 ;;
            -h | --help)
                mx_usage
                exit 0
                ;;
            --)
                shift
                MX_CLI_ARGS+=("$@")
                break
                ;;
            *) MX_CLI_ARGS+=("$1") ;;
        esac
        shift
    done
}

# mx_setup: apply defaults for every knob that both launchers share and
# validate them. Launchers set their own defaults first (`: "${X:=...}"`).
mx_setup() {
    : "${CKPT_DIR:=$PWD/checkpoints}"
    [[ $CKPT_DIR == /* ]] || CKPT_DIR=$PWD/$CKPT_DIR
    : "${PYTHON:=python}"
    : "${LAUNCHER:=torchrun}"
    : "${TORCHRUN:=torchrun}"
    : "${TRAIN_SCRIPT:=$MX_REPO_ROOT/pretrain_gpt_ext.py}"
    : "${GPUS_PER_NODE:=8}"
    : "${MAX_RESTARTS:=10}"
    : "${MAX_ROLLBACKS:=5}"
    : "${RESTART_MODE:=$MX_DEFAULT_RESTART_MODE}"
    : "${TRACKER_FILE:=$CKPT_DIR/result_rejected_tracker.txt}"
    : "${LAUNCH_STATE_DIR:=$CKPT_DIR/launch_state}"
    : "${MODEL_ARGS:=}" "${DATA_ARGS:=}" "${EXTRA_ARGS:=}" "${EXTRA_ENV:=}"
    : "${MEGATRON_EXT_ON_SPIKE:=}"
    : "${SKIPLIST_ARGS:=}"  # extra `megatron-ext skiplist` flags for the default spike hook
    MX_SIGNALS_DIR=""       # the run's --signals-dir, found in its arguments
    # H100 / NCCL environment of the training processes (exported through an
    # explicit `env` prefix so that it is visible in --dry-run output).
    : "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"     # Megatron TP/SP comm ordering
    : "${NCCL_IB_TIMEOUT:=22}"                # IB verbs timeout 4.096us*2^22
    : "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}" # abort on NCCL errors/timeouts
    : "${OMP_NUM_THREADS:=8}"
    : "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:=270}" # grace for the save on SIGTERM

    [[ $LAUNCHER == torchrun || $LAUNCHER == python ]] ||
        mx_die 2 "LAUNCHER must be 'torchrun' or 'python', got '$LAUNCHER'"
    [[ $RESTART_MODE == requeue || $RESTART_MODE == inplace ]] ||
        mx_die 2 "RESTART_MODE must be 'requeue' or 'inplace', got '$RESTART_MODE'"
    local knob
    for knob in GPUS_PER_NODE MAX_RESTARTS MAX_ROLLBACKS TORCH_ELASTIC_SHUTDOWN_TIMEOUT; do
        mx_is_uint "${!knob}" || mx_die 2 "$knob must be a non-negative integer, got '${!knob}'"
    done
    ((GPUS_PER_NODE > 0)) || mx_die 2 "GPUS_PER_NODE must be at least 1"
    [[ $TRACKER_FILE == /* ]] || TRACKER_FILE=$PWD/$TRACKER_FILE
    [[ $LAUNCH_STATE_DIR == /* ]] || LAUNCH_STATE_DIR=$PWD/$LAUNCH_STATE_DIR
}

# mx_build_train_args: MX_TRAIN_ARGS = Megatron arguments after the script.
mx_build_train_args() {
    local model=() data=() extra=() a prev=""
    mx_words model "$MODEL_ARGS"
    mx_words data "$DATA_ARGS"
    mx_words extra "$EXTRA_ARGS"
    local user=("${model[@]}" "${data[@]}" "${extra[@]}" "${MX_CLI_ARGS[@]}")
    for a in "${user[@]}"; do
        case "$a" in
            --save | --save=* | --load | --load=*)
                mx_die 2 "do not pass ${a%%=*} yourself: the launcher always passes" \
                    "--save \$CKPT_DIR --load \$CKPT_DIR (auto-resume); set CKPT_DIR instead" \
                    "(to start from another checkpoint use --pretrained-checkpoint)" ;;
            --result-rejected-tracker-filename=*) TRACKER_FILE=${a#*=} ;;
            --signals-dir=*) MX_SIGNALS_DIR=${a#*=} ;;
        esac
        if [[ $prev == --result-rejected-tracker-filename ]]; then TRACKER_FILE=$a; fi
        if [[ $prev == --signals-dir ]]; then MX_SIGNALS_DIR=$a; fi
        prev=$a
    done
    MX_TRAIN_ARGS=(
        "${model[@]}" "${data[@]}"
        --save "$CKPT_DIR" --load "$CKPT_DIR"
        --exit-signal-handler
        --result-rejected-tracker-filename "$TRACKER_FILE"
        "${extra[@]}" "${MX_CLI_ARGS[@]}"
    )
}

# The per-rank wrapper used under torchrun (see the header). The trap keeps
# bash alive while torchrun/Slurm deliver SIGTERM to the process group, so the
# Python child can finish its checkpoint save and we still record its code.
# shellcheck disable=SC2016  # expanded by the worker's bash, not here
MX_RANK_WRAPPER='trap : TERM INT HUP; "$@"; rc=$?; d=${MEGATRON_EXT_EXIT_CODE_DIR:-}; if [ -n "$d" ]; then printf "%s\n" "$rc" >"$d/rank-${RANK:-0}.rc" || :; fi; exit "$rc"'

# mx_prepare_attempt N: set MX_RC_DIR, MX_ENV_PREFIX, MX_WORKER_CMD and then
# MX_CMD (through the launcher's mx_build_launch_cmd) for attempt N.
# shellcheck disable=SC2034  # MX_WORKER_CMD is read by mx_build_launch_cmd
mx_prepare_attempt() {
    local attempt=$1 python=() extra_env=() kv
    mx_words python "$PYTHON"
    mx_words extra_env "$EXTRA_ENV"
    for kv in "${extra_env[@]}"; do
        [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || mx_die 2 "EXTRA_ENV entries must be NAME=VALUE, got '$kv'"
    done
    MX_ENV_PREFIX=(env
        "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
        "NCCL_IB_TIMEOUT=$NCCL_IB_TIMEOUT"
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING"
        "OMP_NUM_THREADS=$OMP_NUM_THREADS"
        "PYTHONUNBUFFERED=1"
    )
    if [[ $LAUNCHER == torchrun ]]; then
        MX_RC_DIR=$LAUNCH_STATE_DIR/exit_codes/${SLURM_JOB_ID:-pid$$}.r${SLURM_RESTART_COUNT:-0}.a$attempt
        MX_ENV_PREFIX+=(
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
            "MEGATRON_EXT_EXIT_CODE_DIR=$MX_RC_DIR"
        )
        MX_WORKER_CMD=(--no-python bash -c "$MX_RANK_WRAPPER" megatron-ext-rank
            "${python[@]}" "$TRAIN_SCRIPT" "${MX_TRAIN_ARGS[@]}")
    else
        MX_RC_DIR=""
        MX_WORKER_CMD=("${python[@]}" "$TRAIN_SCRIPT" "${MX_TRAIN_ARGS[@]}")
    fi
    MX_ENV_PREFIX+=("${extra_env[@]}")
    mx_build_launch_cmd "$attempt"
}

# ---------------------------------------------------------------------------
# Running the training step
# ---------------------------------------------------------------------------

MX_CHILD_PID=""
MX_STOP_SIGNAL=""  # first of USR1/TERM/INT/HUP received
MX_SIGNALLED=0     # set by the trap; lets mx_run_child tell a trap from an exit
MX_FORWARDED=0

mx_on_signal() {
    local sig=$1
    MX_SIGNALLED=1
    if [[ -z $MX_STOP_SIGNAL ]]; then
        MX_STOP_SIGNAL=$sig
        mx_log "received SIG$sig: asking the training to save a checkpoint and exit"
    else
        mx_log "received SIG$sig (already stopping after SIG$MX_STOP_SIGNAL); still waiting"
    fi
    if [[ -n $MX_CHILD_PID && $MX_FORWARDED -eq 0 ]]; then
        MX_FORWARDED=1
        mx_signal_training || mx_log "WARNING: could not signal the training step"
    fi
}

mx_install_traps() {
    local sig
    for sig in USR1 TERM INT HUP; do
        # shellcheck disable=SC2064  # expand $sig now, on purpose
        trap "mx_on_signal $sig" "$sig"
    done
}

# mx_run_child CMD...: run CMD in the background (so that traps run while we
# wait), wait for it and put its exit status in MX_CHILD_RC.
mx_run_child() {
    MX_FORWARDED=0
    "$@" &
    MX_CHILD_PID=$!
    if [[ -n $MX_STOP_SIGNAL ]]; then # a signal raced with the start
        MX_FORWARDED=1
        mx_signal_training || mx_log "WARNING: could not signal the training step"
    fi
    local rc prev=""
    while :; do
        MX_SIGNALLED=0
        rc=0
        wait "$MX_CHILD_PID" || rc=$?
        if [[ -n $prev && $rc -eq 127 ]]; then
            rc=$prev # already reaped when the trap interrupted `wait`
            break
        fi
        if ((MX_SIGNALLED && rc > 128)); then
            prev=$rc # `wait` was interrupted by a trapped signal: wait again
            continue
        fi
        break
    done
    MX_CHILD_PID=""
    MX_CHILD_RC=$rc
}

# mx_effective_rc LAUNCHER_RC RC_DIR: the exit code that matters. Under
# torchrun, prefer what the workers reported: 17, then 42, then 16, then the
# first other non-zero, non-signal worker code; else the launcher's code.
mx_effective_rc() {
    local rc=$1 dir=$2 f c want codes=()
    if ((rc == 0)) || [[ -z $dir || ! -d $dir ]]; then
        echo "$rc"
        return
    fi
    for f in "$dir"/rank-*.rc; do
        [[ -f $f ]] || continue
        c=""
        read -r c <"$f" || true
        if mx_is_uint "$c"; then codes+=("$c"); fi
    done
    for want in 17 42 16; do
        for c in "${codes[@]}"; do
            if ((c == want)); then
                echo "$c"
                return
            fi
        done
    done
    for c in "${codes[@]}"; do
        if ((c != 0 && c < 128)); then
            echo "$c"
            return
        fi
    done
    echo "$rc"
}

# ---------------------------------------------------------------------------
# Exit-code actions
# ---------------------------------------------------------------------------

# Restarts so far: Slurm's requeue count of this job plus relaunches done by
# this script in the current allocation.
mx_restarts_so_far() {
    echo $((${SLURM_RESTART_COUNT:-0} + MX_INPLACE_RESTARTS))
}

# mx_requeue REASON: ask Slurm to requeue this job (it will resume from
# CKPT_DIR). Returns non-zero when that is impossible.
mx_requeue() {
    local reason=$1
    if [[ -z ${SLURM_JOB_ID:-} ]]; then
        mx_log "cannot requeue ($reason): not inside a Slurm job (SLURM_JOB_ID unset)"
        return 1
    fi
    mx_log "requeueing Slurm job $SLURM_JOB_ID ($reason); it will resume from $CKPT_DIR"
    mx_log "+ $(mx_quote scontrol requeue "$SLURM_JOB_ID")"
    if scontrol requeue "$SLURM_JOB_ID"; then
        return 0
    fi
    mx_log "scontrol requeue $SLURM_JOB_ID failed"
    return 1
}

# 16: resume from the last checkpoint so the rerun state machine can decide.
# Returns 0 to relaunch in place; otherwise exits.
mx_on_resume_to_disambiguate() {
    local done_restarts
    done_restarts=$(mx_restarts_so_far)
    mx_log "training exited 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE): Megatron's rerun" \
        "state machine needs a restart from the last checkpoint to disambiguate a result"
    if ((done_restarts >= MAX_RESTARTS)); then
        mx_log "ERROR: restart budget exhausted ($done_restarts restarts so far," \
            "MAX_RESTARTS=$MAX_RESTARTS); giving up: resubmit by hand to resume from $CKPT_DIR"
        exit 16
    fi
    if [[ $RESTART_MODE == requeue ]]; then
        if mx_requeue "exit 16, restart $((done_restarts + 1))/$MAX_RESTARTS"; then
            exit 0
        fi
        mx_log "ERROR: giving up with exit 16: resubmit the job to resume from $CKPT_DIR"
        exit 16
    fi
    MX_INPLACE_RESTARTS=$((MX_INPLACE_RESTARTS + 1))
    mx_log "relaunching in place from the last checkpoint" \
        "(restart $((done_restarts + 1))/$MAX_RESTARTS)"
    return 0
}

# 17: a result validation failed and was reproducible / hardware-suspect.
mx_on_validation_failure() {
    mx_log "ERROR: training exited 17 (EXIT_CODE_FAILED_ON_RESULT_VALIDATION): a result" \
        "validation failed in Megatron's rerun state machine and the failure was" \
        "reproducible or hardware-suspect. Not retrying on the same nodes."
    mx_log "result-rejected tracker file: $TRACKER_FILE"
    if [[ -s $TRACKER_FILE ]]; then
        mx_log "last tracker entries:"
        tail -n 10 "$TRACKER_FILE" >&2 || true
        local nodes
        nodes=$(grep -o 'node=[^ ]*' "$TRACKER_FILE" | sort -u | sed 's/^node=//' | paste -sd, - || true)
        if [[ -n $nodes ]]; then mx_log "nodes named in the tracker file: $nodes"; fi
    else
        mx_log "(the tracker file is missing or empty; see the training log above)"
    fi
    if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then mx_log "this job ran on: $SLURM_JOB_NODELIST"; fi
    mx_log "inspect the log and tracker file; to continue from $CKPT_DIR, resubmit" \
        "excluding the suspect node (sbatch --exclude=NODE ...)"
    exit 17
}

# 42: megatron-ext detected a loss spike and requests a rollback.
# Returns 0 to relaunch; otherwise exits.
mx_on_spike() {
    mx_log "training exited 42: megatron-ext detected a loss spike and requests a rollback"
    if [[ -z $MEGATRON_EXT_ON_SPIKE && -n $MX_SIGNALS_DIR ]]; then
        # Default hook: plan and apply the rollback + skip, then relaunch (same command).
        # shellcheck disable=SC2016  # expanded by the hook's bash, where these are set
        MEGATRON_EXT_ON_SPIKE='"$PYTHON" -m megatron_ext.cli skiplist --apply --ckpt-dir "$MEGATRON_EXT_CKPT_DIR" --signals-dir "$MEGATRON_EXT_SIGNALS_DIR" --tracker-file "$MEGATRON_EXT_TRACKER_FILE" $SKIPLIST_ARGS'
    fi
    if [[ -z $MEGATRON_EXT_ON_SPIKE ]]; then
        mx_log "ERROR: MEGATRON_EXT_ON_SPIKE is not set and the run has no --signals-dir," \
            "so there is no rollback hook to run; stopping with exit 42. Train with" \
            "--signals-dir DIR --spike-detect (default hook: megatron-ext skiplist --apply)" \
            "or set MEGATRON_EXT_ON_SPIKE to your own command."
        exit 42
    fi
    if ((MX_ROLLBACKS >= MAX_ROLLBACKS)); then
        mx_log "ERROR: rollback budget exhausted ($MX_ROLLBACKS rollbacks," \
            "MAX_ROLLBACKS=$MAX_ROLLBACKS); stopping with exit 42"
        exit 42
    fi
    MX_ROLLBACKS=$((MX_ROLLBACKS + 1))
    mx_log "running spike hook (rollback $MX_ROLLBACKS/$MAX_ROLLBACKS): $MEGATRON_EXT_ON_SPIKE"
    local hook_rc=0
    MEGATRON_EXT_CKPT_DIR=$CKPT_DIR \
        MEGATRON_EXT_SIGNALS_DIR=$MX_SIGNALS_DIR \
        MEGATRON_EXT_TRACKER_FILE=$TRACKER_FILE \
        PYTHON=$PYTHON SKIPLIST_ARGS=$SKIPLIST_ARGS \
        MEGATRON_EXT_ROLLBACK=$MX_ROLLBACKS \
        MEGATRON_EXT_MAX_ROLLBACKS=$MAX_ROLLBACKS \
        MEGATRON_EXT_TRAIN_EXIT_CODE=42 \
        bash -c "$MEGATRON_EXT_ON_SPIKE" </dev/null || hook_rc=$?
    if ((hook_rc != 0)); then
        mx_log "ERROR: spike hook failed with exit $hook_rc; stopping with exit 42"
        exit 42
    fi
    mx_log "spike hook done; relaunching from the last checkpoint"
    return 0
}

# After the training stopped because this script got a signal.
mx_after_stop_signal() {
    local rc=$1 sig=$MX_STOP_SIGNAL
    mx_log "training stopped after SIG$sig (effective exit code $rc)"
    if ((rc == 17)); then
        mx_on_validation_failure
    fi
    if [[ $sig == USR1 && $RESTART_MODE == requeue ]]; then
        local done_restarts
        done_restarts=$(mx_restarts_so_far)
        if ((done_restarts >= MAX_RESTARTS)); then
            mx_log "ERROR: not requeueing: $done_restarts restarts so far," \
                "MAX_RESTARTS=$MAX_RESTARTS; resubmit by hand to resume from $CKPT_DIR"
        elif mx_requeue "time limit / preemption warning SIGUSR1"; then
            exit 0
        else
            mx_log "ERROR: resubmit the job to resume from $CKPT_DIR"
        fi
        exit $((128 + $(kill -l USR1)))
    fi
    mx_log "stopped; rerun the same command to resume from $CKPT_DIR"
    exit $((128 + $(kill -l "$sig")))
}

# ---------------------------------------------------------------------------
# Main loop
# ---------------------------------------------------------------------------

mx_main() {
    mx_parse_cli "$@"
    mx_setup
    mx_build_train_args

    if ((MX_DRY_RUN)); then
        # Exactly the command(s) a real run would start first, one per line.
        mx_prepare_attempt 1
        printf '+ %s\n' "$(mx_quote "${MX_CMD[@]}")"
        exit 0
    fi

    mkdir -p "$CKPT_DIR" "$LAUNCH_STATE_DIR" "$(dirname "$TRACKER_FILE")"
    MX_INPLACE_RESTARTS=0
    MX_ROLLBACKS=0
    mx_install_traps

    local attempt=0 rc=0
    while :; do
        if [[ -n $MX_STOP_SIGNAL ]]; then # arrived between two attempts
            mx_after_stop_signal "$rc"
        fi
        attempt=$((attempt + 1))
        mx_prepare_attempt "$attempt"
        if [[ -n $MX_RC_DIR ]]; then
            rm -rf "$MX_RC_DIR"
            mkdir -p "$MX_RC_DIR"
        fi
        mx_log "attempt $attempt: launching training (checkpoints: $CKPT_DIR)"
        printf '+ %s\n' "$(mx_quote "${MX_CMD[@]}")" >&2
        mx_run_child "${MX_CMD[@]}"
        rc=$(mx_effective_rc "$MX_CHILD_RC" "$MX_RC_DIR")
        if ((rc != MX_CHILD_RC)); then
            mx_log "launcher exited $MX_CHILD_RC; training workers reported exit code $rc"
        fi
        if [[ -n $MX_RC_DIR ]]; then rm -rf "$MX_RC_DIR"; fi

        if [[ -n $MX_STOP_SIGNAL ]]; then
            mx_after_stop_signal "$rc"
        fi

        # Exit-code table (keep in sync with the headers of the launchers).
        case "$rc" in
            0) # Training finished (train iterations/samples reached).
                mx_log "training finished successfully"
                exit 0
                ;;
            16) # EXIT_CODE_RESUME_TO_DISAMBIGUATE: restart from the last
                # checkpoint (requeue or relaunch), bounded by MAX_RESTARTS.
                mx_on_resume_to_disambiguate
                ;;
            17) # EXIT_CODE_FAILED_ON_RESULT_VALIDATION: stop and report.
                mx_on_validation_failure
                ;;
            42) # megatron-ext spike: run MEGATRON_EXT_ON_SPIKE, relaunch,
                # bounded by MAX_ROLLBACKS; without a hook, stop.
                mx_on_spike
                ;;
            *) # Anything else: a crash or an unknown code. Stop with it.
                mx_log "ERROR: training failed with exit code $rc; stopping"
                exit "$rc"
                ;;
        esac
    done
}
