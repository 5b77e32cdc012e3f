"""The command one attempt runs: training arguments, the per-rank wrapper, torchrun / srun;
the facts the supervisor reads from the training arguments; Slurm host-list expansion."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.common import attempt_end, exit_codes
from megatron_ext.common.files import SPIKE_LEDGER_FILE
from megatron_ext.common.records.hangs import HANG_DIR_ENV
from megatron_ext.common.validation import check_exit_code
from megatron_ext.supervise.knobs import TRAINING_ENV, Config, KnobError

# Every torchrun worker runs in this wrapper. It records the worker's own exit code (torchrun
# says 1 for any failure) and node (from the kernel: Slurm passes the batch host's $HOSTNAME
# to every task) in $MEGATRON_EXT_EXIT_CODE_DIR/rank-$RANK.rc; its TERM trap outlives the
# worker's save. Then it SIGKILLs what the worker left in its process group (data-loader
# workers, the checkpoint writer's Manager), which would keep srun waiting on the node's
# output. $BASHPID, not "$$": torchrun's string.Template turns "$$" into "$".
RANK_WRAPPER = (
    'trap : TERM INT HUP; "$@"; rc=$?; d=${MEGATRON_EXT_EXIT_CODE_DIR:-}; '
    'if [ -n "$d" ]; then h=?; read -r h </proc/sys/kernel/hostname || :; '
    'printf "%s %s\\n" "$rc" "$h" >"$d/rank-${RANK:-0}.rc" || :; fi; me=$BASHPID; '
    'for p in $(pgrep -g "$me" 2>/dev/null); do [ "$p" = "$me" ] || kill -KILL "$p" 2>/dev/null; '
    'done; exit "$rc"'
)


@dataclass(frozen=True)
class TrainingFacts:
    """What the supervisor needs to know about the training arguments."""

    signals_dir: str | None
    ledger: Path | None
    spike_exit_code: int
    tracker_file: str | None  # a user's --result-rejected-tracker-filename


def training_facts(user_args: list[str]) -> TrainingFacts:
    """Parse the user's training flags the way Megatron's parser will."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--signals-dir", "--spike-ledger", "--save", "--load"):
        parser.add_argument(flag)
    parser.add_argument("--result-rejected-tracker-filename")
    parser.add_argument("--spike-exit-code", type=int, default=exit_codes.SPIKE_ROLLBACK)
    known, _ = parser.parse_known_args(user_args)
    if known.save is not None or known.load is not None:
        flag = "--save" if known.save is not None else "--load"
        raise KnobError(
            f"do not pass {flag} yourself: the launcher always passes --save $CKPT_DIR --load "
            "$CKPT_DIR (auto-resume); set CKPT_DIR instead (to start from another checkpoint "
            "use --pretrained-checkpoint)"
        )
    try:
        check_exit_code("--spike-exit-code", known.spike_exit_code)
    except ValueError as exc:
        raise KnobError(str(exc)) from None
    signals = known.signals_dir
    ledger = known.spike_ledger or (signals and Path(signals) / SPIKE_LEDGER_FILE)
    return TrainingFacts(
        signals,
        Path(ledger) if ledger else None,
        known.spike_exit_code,
        known.result_rejected_tracker_filename,
    )


def user_args(config: Config, cli_args: list[str]) -> list[str]:
    data = [*config.words("MODEL_ARGS"), *config.words("DATA_ARGS")]
    return [*data, *config.words("EXTRA_ARGS"), *cli_args]


def train_args(config: Config, cli_args: list[str]) -> list[str]:
    """Megatron arguments after the script: the user's, plus --save/--load $CKPT_DIR (auto
    resume), --exit-signal-handler and the tracker file (a user's own flag comes later and
    wins, as argparse takes the last)."""
    ckpt = str(config.ckpt_dir)
    return [
        *config.words("MODEL_ARGS"),
        *config.words("DATA_ARGS"),
        *("--save", ckpt, "--load", ckpt, "--exit-signal-handler"),
        *("--result-rejected-tracker-filename", config["TRACKER_FILE"]),
        *config.words("EXTRA_ARGS"),
        *cli_args,
    ]


def training_env(
    config: Config, rc_dir: Path | None, attempt_end_file: Path, hang_dir: Path
) -> list[str]:
    """``env NAME=VALUE ...``: visible in --dry-run, and what the workers get (rank 0 records
    there how the attempt ended: :mod:`megatron_ext.common.attempt_end`; the hang watchdogs
    meet in ``hang_dir``)."""
    env = ["env", *(f"{name}={config[name]}" for name in TRAINING_ENV), "PYTHONUNBUFFERED=1"]
    env += [f"{attempt_end.ENV}={attempt_end_file}", f"{HANG_DIR_ENV}={hang_dir}"]
    if rc_dir is not None:
        env += [
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={config['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']}",
            f"MEGATRON_EXT_EXIT_CODE_DIR={rc_dir}",
        ]
    return env + config.words("EXTRA_ENV")


def worker_command(config: Config, args: list[str]) -> list[str]:
    """What torchrun (or srun, with LAUNCHER=python) starts per worker."""
    script = [*config.python(), config["TRAIN_SCRIPT"], *args]
    if config["LAUNCHER"] == "torchrun":
        return ["--no-python", "bash", "-c", RANK_WRAPPER, "megatron-ext-rank", *script]
    return script


def local_command(config: Config, env: list[str], worker: list[str]) -> list[str]:
    if config["LAUNCHER"] != "torchrun":
        return [*env, *worker]
    return [
        *(*env, *config.words("TORCHRUN"), "--standalone", "--nnodes", "1"),
        *("--nproc-per-node", config["GPUS_PER_NODE"], "--max-restarts", "0", *worker),
    ]


def slurm_command(
    config: Config, env: list[str], worker: list[str], slurm: dict[str, str], attempt: int
) -> list[str]:
    nnodes = slurm.get("SLURM_NNODES") or slurm.get("SLURM_JOB_NUM_NODES") or ""
    if not nnodes.isdigit() or int(nnodes) == 0:
        raise KnobError(f"SLURM_NNODES must be a positive integer, got {nnodes!r}")
    command = [
        *("srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1"),
        *("--kill-on-bad-exit=1", *config.words("SRUN_ARGS"), *env),
    ]
    if config["LAUNCHER"] != "torchrun":
        return [*command, *worker]
    master = config["MASTER_ADDR"] or first_host(slurm["SLURM_JOB_NODELIST"])
    rdzv_id = f"{slurm.get('SLURM_JOB_ID', '0')}-{slurm.get('SLURM_RESTART_COUNT', '0')}-{attempt}"
    return [
        *(*command, *config.words("TORCHRUN"), "--nnodes", nnodes),
        *("--nproc-per-node", config["GPUS_PER_NODE"], "--rdzv-id", rdzv_id),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{config['MASTER_PORT']}"),
        *("--max-restarts", "0", *worker),
    ]


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(nodelist: str) -> list[str]:
    """Slurm host-list syntax, as ``scontrol show hostnames`` expands it:
    ``gpu[001-003,010],cpu1`` -> gpu001 gpu002 gpu003 gpu010 cpu1; ``r[1-2]-n[7-8]`` -> 4 hosts.
    """
    hosts: list[str] = []
    for entry in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):  # split at top-level commas
        expanded = [""]
        for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", entry):
            expanded = [h + literal for h in expanded]
            if bracket:
                expanded = [h + n for h in expanded for n in _bracket(bracket, nodelist)]
        hosts += [h for h in expanded if h]
    if not hosts:
        raise KnobError(f"empty host list from SLURM_JOB_NODELIST={nodelist!r}")
    return hosts


def _bracket(inner: str, nodelist: str) -> list[str]:
    names = []
    for item in inner.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise KnobError(f"cannot expand {item!r} in SLURM_JOB_NODELIST={nodelist!r}")
        start, end = match[1], match[2] or match[1]
        names += [str(n).zfill(len(start)) for n in range(int(start), int(end) + 1)]
    return names


def first_host(nodelist: str) -> str:
    """The rendezvous host: ``scontrol show hostnames`` when it works, else our expansion (e.g.
    --dry-run without a Slurm configuration; a missing SLURM_CONF would make scontrol retry
    for 60 s)."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        return expand_hostlist(nodelist)[0]
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return expand_hostlist(nodelist)[0]


quote = shlex.join  # one shell command line that bash and shlex.split parse back
