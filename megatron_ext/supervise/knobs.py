"""The launchers' knobs: every environment variable, its default and meaning, declared once.

Both launchers hand their environment to ``megatron-ext supervise``; :data:`KNOBS` is what it
reads, what ``--help`` prints, and the only place a default lives.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.common import cuda_connections
from megatron_ext.common.errors import UsageError
from megatron_ext.common.files import LAUNCH_STATE_DIR, RESULT_REJECTED_TRACKER_FILE


class KnobError(UsageError, ValueError):
    """A knob has a value the launcher cannot use; exit 2 with this message."""


AUTO = "auto"  # a default the training flags decide (resolve_connections)


@dataclass(frozen=True)
class Knob:
    name: str
    help: str
    local: str = ""
    slurm: str | None = None  # None: same as local
    kind: str = "text"  # text | uint | choice | words | path | bool

    def default(self, scheduler: str) -> str:
        return self.slurm if scheduler == "slurm" and self.slurm is not None else self.local


# One knob an entry: "NAME KIND = LOCAL DEFAULT | SLURM DEFAULT", then its help, indented.
_TABLE = f"""
CKPT_DIR path = $PWD/checkpoints
    checkpoint directory, --save and --load (shared filesystem under Slurm)
MODEL_ARGS words
    Megatron model flags (shell words; quote paths with spaces)
DATA_ARGS words
    Megatron data flags (shell words)
EXTRA_ARGS words
    more training flags (shell words); script arguments come last
PYTHON text = python
    Python interpreter of the training workers (a path, may contain spaces)
LAUNCHER choice = torchrun
    torchrun | python (one process per node, for CPU tests and debugging)
TORCHRUN words = torchrun
    torchrun command (shell words)
TRAIN_SCRIPT path = $MEGATRON_EXT_ROOT/pretrain_gpt_ext.py
    training script
GPUS_PER_NODE uint = 8 | $SLURM_GPUS_ON_NODE or 8
    processes (GPUs) per node
MASTER_ADDR text = | first host
    rendezvous host (Slurm: first host of SLURM_JOB_NODELIST)
MASTER_PORT uint = 29500
    rendezvous port (Slurm)
SRUN_ARGS words = | --cpu-bind=none
    extra srun options (shell words)
MAX_RESTARTS uint = 10 | 100
    restart budget for exit 16, a SIGKILLed worker, preemption and early exits that saved no
    progress, counting SLURM_RESTART_COUNT (less the requeues after an early exit that did)
    and relaunches in this allocation
RESTART_MODE choice = inplace | requeue
    inplace (relaunch here) | requeue (scontrol requeue) for exit 16 and early exits
MAX_ROLLBACKS uint = 5
    spike rollbacks per allocation
MEGATRON_EXT_ON_SPIKE text
    command run (bash -c) on a rollback request instead of `megatron-ext skiplist --apply`;
    exit 0 = relaunch. It sees MEGATRON_EXT_CKPT_DIR, MEGATRON_EXT_SIGNALS_DIR,
    MEGATRON_EXT_TRACKER_FILE, MEGATRON_EXT_ROLLBACK, MEGATRON_EXT_MAX_ROLLBACKS,
    MEGATRON_EXT_TRAIN_EXIT_CODE
SKIPLIST_ARGS words
    extra `megatron-ext skiplist` flags for the default spike hook (shell words)
TRACKER_FILE path = $CKPT_DIR/{RESULT_REJECTED_TRACKER_FILE}
    Megatron's result-rejected tracker file
LAUNCH_STATE_DIR path = $CKPT_DIR/{LAUNCH_STATE_DIR}
    per-rank exit codes of each attempt (shared filesystem)
{cuda_connections.ENV} text = {AUTO}
    CUDA hardware queues: auto = 1 (TP/CP/SP kernels in issue order),
    {cuda_connections.FSDP_DEFAULT} with {" or ".join(cuda_connections.FSDP_FLAGS)}
    (Megatron refuses 1 there)
NCCL_IB_TIMEOUT text = 22
    InfiniBand verbs timeout (4.096 us * 2^N)
TORCH_NCCL_ASYNC_ERROR_HANDLING text = 1
    abort on NCCL errors and timeouts
OMP_NUM_THREADS text = 8
    CPU threads per worker
TORCH_ELASTIC_SHUTDOWN_TIMEOUT uint = 270
    seconds torchrun gives workers to save after SIGTERM before SIGKILL
EXTRA_ENV words
    more NAME=VALUE pairs for the training processes (shell words)
FORCE_RUN_LOCK bool = 0
    1 = take over CKPT_DIR's run lock although its holder looks alive (only for a holder
    known to be dead: its node is gone)
DRY_RUN bool = 0
    1 = --dry-run: print the command of the first attempt and exit
"""


def _knob(entry: str) -> Knob:
    head, *text = entry.splitlines()
    spec, _, defaults = head.partition("=")
    name, kind = spec.split()
    local, _, slurm = (part.strip() for part in defaults.partition("|"))
    return Knob(name, " ".join(line.strip() for line in text), local, slurm or None, kind)


KNOBS: tuple[Knob, ...] = tuple(_knob(e) for e in re.split(r"\n(?=\S)", _TABLE.strip()))
# Exported to the training processes, in this order (visible in --dry-run).
TRAINING_ENV = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_IB_TIMEOUT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)
CHOICES = {"LAUNCHER": ("torchrun", "python"), "RESTART_MODE": ("requeue", "inplace")}
BOOLEANS = ("", "0", "1", "true", "false", "yes", "no")


@dataclass(frozen=True)
class Config:
    """The launcher's configuration, validated."""

    scheduler: str  # local | slurm
    root: Path  # repository root (pretrain_gpt_ext.py)
    values: dict[str, str]

    def __getitem__(self, name: str) -> str:
        return self.values[name]

    def number(self, name: str) -> int:
        return int(self.values[name])

    def words(self, name: str) -> list[str]:
        return shlex.split(self.values[name])

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.values["CKPT_DIR"])

    def python(self) -> list[str]:
        """The worker interpreter: one path when it names a program, else shell words."""
        value = self.values["PYTHON"]
        if Path(value).exists() or shutil.which(value):
            return [value]
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise KnobError(f"PYTHON: {exc} in {value!r}") from None


def _absolute(value: str, cwd: Path) -> str:
    return value if os.path.isabs(value) else str(cwd / value)


def load(env: Mapping[str, str], scheduler: str, root: Path, cwd: Path) -> Config:
    """Read every knob from ``env`` (defaults above), validate, resolve relative paths."""
    # As bash's ${X:=default}: unset or empty takes the default.
    values = {knob.name: env.get(knob.name) or knob.default(scheduler) for knob in KNOBS}
    ckpt = values["CKPT_DIR"] = _absolute(values["CKPT_DIR"].replace("$PWD", str(cwd)), cwd)
    values["TRAIN_SCRIPT"] = values["TRAIN_SCRIPT"].replace("$MEGATRON_EXT_ROOT", str(root))
    for name in ("TRACKER_FILE", "LAUNCH_STATE_DIR"):
        values[name] = _absolute(values[name].replace("$CKPT_DIR", ckpt), cwd)
    if scheduler == "slurm":
        if values["GPUS_PER_NODE"] == "$SLURM_GPUS_ON_NODE or 8":
            values["GPUS_PER_NODE"] = env.get("SLURM_GPUS_ON_NODE") or "8"
        if values["MASTER_ADDR"] == "first host":
            values["MASTER_ADDR"] = ""
    _validate(values)
    return Config(scheduler, root, values)


def _problem(knob: Knob, value: str) -> str | None:
    """What is wrong with one knob's value, by its kind (None: nothing)."""
    if knob.kind == "choice" and value not in CHOICES[knob.name]:
        allowed = " or ".join(repr(a) for a in CHOICES[knob.name])
        return f"{knob.name} must be {allowed}, got {value!r}"
    if knob.kind == "uint" and not value.isdigit():
        return f"{knob.name} must be a non-negative integer, got {value!r}"
    if knob.kind == "bool" and value.lower() not in BOOLEANS:
        return f"{knob.name} must be 0 or 1, got {value!r}"
    if knob.kind == "words":
        try:
            shlex.split(value)
        except ValueError as exc:
            return f"{knob.name}: {exc} in {value!r}"
    return None


def _validate(values: dict[str, str]) -> None:
    for knob in KNOBS:
        if problem := _problem(knob, values[knob.name]):
            raise KnobError(problem)
    if int(values["GPUS_PER_NODE"]) < 1:
        raise KnobError("GPUS_PER_NODE must be at least 1")
    for pair in shlex.split(values["EXTRA_ENV"]):
        name, sep, _ = pair.partition("=")
        if not sep or not name.isidentifier():
            raise KnobError(f"EXTRA_ENV entries must be NAME=VALUE, got {pair!r}")


def resolve_connections(config: Config, user_args: list[str]) -> None:
    """Give ``CUDA_DEVICE_MAX_CONNECTIONS`` its value for these training flags: ``auto`` takes
    :func:`megatron_ext.common.cuda_connections.default_for`, and a value Megatron would refuse
    with them (``1`` with an FSDP flag) is refused now, before any attempt starts."""
    name = cuda_connections.ENV
    if config.values[name] == AUTO:
        config.values[name] = cuda_connections.default_for(user_args)
    problem = cuda_connections.problem(user_args, config.values[name])
    if problem:
        raise KnobError(problem)


def truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


def describe(scheduler: str) -> str:
    """The knob table for ``--help``."""
    lines = []
    for knob in KNOBS:
        default = knob.default(scheduler)
        lines.append(f"  {knob.name:<32} {knob.help}" + (f" [{default}]" if default else ""))
    return "\n".join(lines)
