"""A real single-node Slurm cluster for tests, and ``sbatch`` helpers that read back what a job
did.

The cluster is started and stopped by ``tests/support/slurm_local_cluster.sh`` (also usable by
hand), in a temporary directory, with its own munged, ports and state: see that script's header. The
``slurm`` fixture (session scope, in ``test_slurm.py`` or any test module that imports it) installs
the Slurm packages when they are missing and it may (root + apt-get), and otherwise skips with
the reason; when the ``CI`` environment variable is set it fails instead of skipping.

Submitting: :meth:`SlurmCluster.submit` runs ``sbatch --parsable --wait`` (the exit code the
user would see), polls ``scontrol show job`` while it waits (job records are kept only a few
seconds after the end: ``MinJobAge=5`` keeps ``sbatch --wait`` polling every 2 s), and returns a
:class:`JobResult` with the job id, ``sbatch``'s exit code, the final ``scontrol`` fields
(``JobState``, ``ExitCode``, ``Restarts``, ...) and the job's output file (all attempts, as the
launch script appends). :meth:`SlurmCluster.start` does the same without blocking, for tests
that act on a running job (signals, ``scontrol``) and then call :meth:`PendingJob.result`.

:func:`start_training` submits the real ``launch/pretrain_gpt_ext.sbatch`` with
``megatron_ext/cpu/run.py`` as the training script and the tiny model, under torchrun with 2
processes on the one node (DP=2); :func:`training_env` is the environment it uses. The
``slurm`` fixture lives in ``test_slurm.py``; tests that need the cluster (e.g. the incident
drill) belong there, or the fixture moves to ``conftest.py`` when a second module needs it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.common.records.sample_log import SampleRecord, read_records
from megatron_ext.demo import CPU_FLAGS, TINY_MODEL
from megatron_ext.train import CPU_RUNNER
from tests.support.harness import TINY_TRAINING

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "tests" / "support" / "slurm_local_cluster.sh"
SBATCH_SCRIPT = REPO / "launch" / "pretrain_gpt_ext.sbatch"
RUNNER = CPU_RUNNER  # the package's CPU runner, as `megatron-ext train --cpu` runs it
SBIN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

# The #SBATCH defaults of launch/pretrain_gpt_ext.sbatch are for H100 nodes (--nodes=2,
# --gpus-per-node=8, --exclusive, --mem=0); these override them for the one CPU-only node.
# --gpus-per-node=0 is accepted without GRES; --exclusive (and --mem=0) are kept: a training
# job gets the whole node, as on a cluster.
LOCAL_NODE_OPTIONS = ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0"]

FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}

# Environment variables of a surrounding Slurm job (if pytest itself runs under Slurm) that
# would leak into the submitted jobs' view of themselves.
_LEAKY = re.compile(r"^(SLURM_|SBATCH_|SRUN_|SALLOC_)")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no")


def on_ci() -> bool:
    """True when the ``CI`` environment variable is set (non-empty, not 0/false/no)."""
    return _truthy(os.environ.get("CI"))


def base_env() -> dict[str, str]:
    """The caller's environment without Slurm job variables, with the sbin directories."""
    env = {k: v for k, v in os.environ.items() if not _LEAKY.match(k)}
    env["PATH"] = f"{env.get('PATH', '')}:{SBIN_PATH}".lstrip(":")
    return env


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output (``Key=Value`` words) as a dict. Values with spaces
    (rare: ``Reason``, ``Comment``) keep only their first word."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


@dataclass
class JobResult:
    """What one submitted job did, as the scheduler and the job's output file report it."""

    job_id: int
    returncode: int  # exit code of `sbatch --wait`
    fields: dict[str, str]  # last `scontrol show job` fields seen (JobState, ExitCode, ...)
    output_path: Path
    sbatch_stderr: str = ""
    history: list[str] = field(default_factory=list)  # JobState values seen while polling

    @property
    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "")

    @property
    def restarts(self) -> int:
        return int(self.fields.get("Restarts", "0"))

    @property
    def exit_code(self) -> tuple[int, int]:
        """(exit code, signal) of the batch script, from ``ExitCode=N:S``."""
        code, _, sig = self.fields.get("ExitCode", "0:0").partition(":")
        return int(code), int(sig or 0)

    def describe(self) -> str:
        """Everything useful for an assertion message."""
        keys = ("JobState", "Reason", "ExitCode", "Restarts", "RunTime", "NodeList")
        summary = " ".join(f"{k}={self.fields.get(k, '?')}" for k in keys)
        return (
            f"job {self.job_id}: sbatch --wait rc={self.returncode} {summary}\n"
            f"states seen: {self.history}\nsbatch stderr:\n{self.sbatch_stderr}\n"
            f"---- job output ({self.output_path}):\n{self.output[-6000:]}"
        )


class PendingJob:
    """A job submitted with ``sbatch --parsable --wait`` that has not been waited for yet."""

    def __init__(
        self, cluster: SlurmCluster, proc: subprocess.Popen, job_id: int, output_path: Path
    ) -> None:
        self.cluster = cluster
        self.proc = proc
        self.job_id = job_id
        self.output_path = output_path
        self.fields: dict[str, str] = {}
        self.history: list[str] = []

    @property
    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def poll_fields(self) -> dict[str, str]:
        """Query ``scontrol show job`` now (the last answer is kept if the record is gone)."""
        fields = self.cluster.show_job(self.job_id)
        if fields:
            self.fields = fields
            state = fields.get("JobState", "")
            if not self.history or self.history[-1] != state:
                self.history.append(state)
        return self.fields

    def wait_for(
        self, what: str, predicate: Callable[[], bool], timeout: float, interval: float = 0.2
    ) -> None:
        """Poll ``predicate`` until true; fail with the job's state and output otherwise."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"job ended while waiting for {what}:\n{self.result(1).describe()}"
                )
            if time.monotonic() > deadline:
                self.cluster.run("scancel", str(self.job_id), check=False)
                raise AssertionError(
                    f"timed out after {timeout} s waiting for {what}:\n{self.result(60).describe()}"
                )
            time.sleep(interval)

    def result(self, timeout: float = 600) -> JobResult:
        """Wait for ``sbatch --wait`` to return and collect the job's final fields."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.cluster.run("scancel", str(self.job_id), check=False)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                raise AssertionError(
                    f"job {self.job_id} did not finish within {timeout} s; state "
                    f"{self.fields.get('JobState')}; output:\n{self.output[-6000:]}"
                )
            self.poll_fields()
            time.sleep(0.5)
        _, stderr = self.proc.communicate()
        # The record may still say COMPLETING for a moment; a purged record (MinJobAge) keeps
        # the last fields polled, seen at most 0.5 s before the end.
        settle = time.monotonic() + 10
        while self.poll_fields().get("JobState") not in FINAL_STATES and self.fields:
            if time.monotonic() > settle:
                break
            time.sleep(0.2)
        return JobResult(
            self.job_id,
            self.proc.returncode,
            dict(self.fields),
            self.output_path,
            stderr,
            list(self.history),
        )


def wait_all(jobs: Sequence[PendingJob], timeout: float = 600) -> list[JobResult]:
    """Wait for several jobs at once, polling ``scontrol`` for all of them (a job that ends
    early would otherwise be purged, MinJobAge=5, before its turn to be waited for)."""
    deadline = time.monotonic() + timeout
    while any(job.proc.poll() is None for job in jobs) and time.monotonic() < deadline:
        for job in jobs:
            if job.proc.poll() is None or job.fields.get("JobState") not in FINAL_STATES:
                job.poll_fields()
        time.sleep(0.5)
    return [job.result(max(1.0, deadline - time.monotonic())) for job in jobs]


class SlurmCluster:
    """A started ``tests/support/slurm_local_cluster.sh`` cluster in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**base_env(), "SLURM_CONF": str(self.conf)}

    # -- life cycle (the script does the work) -------------------------------------------
    @staticmethod
    def script(
        *args: str,
        timeout: float = 300,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), *args],
            env=dict(env or base_env()),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    @classmethod
    def install(cls) -> subprocess.CompletedProcess:
        return cls.script("install")

    @classmethod
    def start_in(cls, root: Path, timeout: float = 120) -> SlurmCluster:
        result = cls.script("start", str(root), timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(
                f"starting the local Slurm cluster failed (rc "
                f"{result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return cls(root)

    def stop(self) -> None:
        result = self.script("stop", str(self.root), timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"stopping the local Slurm cluster failed:\n{result.stderr}")

    # -- clients ----------------------------------------------------------------------------
    def run(
        self,
        *cmd: str,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def show_job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` fields; empty once the record is purged."""
        result = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        return parse_scontrol(result.stdout) if result.returncode == 0 else {}

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-o", "%t").stdout.strip()

    def start(
        self,
        script: Path | str,
        env: Mapping[str, str],
        workdir: Path,
        sbatch_options: Sequence[str] = (),
        args: Sequence[str] = (),
        job_name: str = "mx-test",
    ) -> PendingJob:
        """Submit ``script`` (``sbatch --parsable --wait``) from ``workdir`` with the cluster's
        environment plus ``env``; the output file is ``workdir/<job_name>-<id>.out``."""
        workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            "sbatch",
            "--parsable",
            "--wait",
            *LOCAL_NODE_OPTIONS,
            f"--job-name={job_name}",
            f"--output={workdir}/%x-%j.out",
            *sbatch_options,
            str(script),
            *args,
        ]
        proc = subprocess.Popen(
            cmd,
            env={**self.env, **env},
            cwd=workdir,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line:
            proc.wait(30)
            stderr = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"sbatch printed no job id (rc {proc.returncode}): {stderr}")
        job_id = int(line.split(";")[0])
        return PendingJob(self, proc, job_id, workdir / f"{job_name}-{job_id}.out")

    def submit(
        self,
        script: Path | str,
        env: Mapping[str, str],
        workdir: Path,
        sbatch_options: Sequence[str] = (),
        args: Sequence[str] = (),
        job_name: str = "mx-test",
        timeout: float = 600,
    ) -> JobResult:
        """Submit and wait: ``sbatch --wait``'s exit code plus the job's final fields."""
        return self.start(script, env, workdir, sbatch_options, args, job_name).result(timeout)


# ---------------------------------------------------------------------------------------------
# The real launch script with the CPU harness
# ---------------------------------------------------------------------------------------------


def training_env(
    ckpt_dir: Path,
    model_args: Sequence[str],
    data_args: Sequence[str],
    extra_args: Sequence[str] = (),
    master_port: int | None = None,
    counts_dir: Path | None = None,
    **overrides: str,
) -> dict[str, str]:
    """Environment for ``launch/pretrain_gpt_ext.sbatch``: torchrun with 2 processes on one
    node running ``megatron_ext/cpu/run.py``. Arguments must not contain whitespace (the
    script splits MODEL_ARGS/DATA_ARGS/EXTRA_ARGS on it)."""
    for arg in (*model_args, *data_args, *extra_args):
        if not arg or any(c.isspace() for c in arg):
            raise ValueError(f"launch-script arguments cannot contain whitespace: {arg!r}")
    python = Path(sys.executable)
    torchrun = python.parent / "torchrun"
    # LOGLEVEL=INFO: torchrun logs its rendezvous (ranks and world sizes) into the job output.
    extra_env = ["PYTHONUNBUFFERED=1", "LOGLEVEL=INFO"]
    if counts_dir is not None:
        extra_env.append(f"MEGATRON_EXT_HARNESS_COUNTS={counts_dir}")
    env = {
        "MEGATRON_EXT_ROOT": str(REPO),
        "CKPT_DIR": str(ckpt_dir),
        "LAUNCHER": "torchrun",
        "PYTHON": str(python),
        "TORCHRUN": str(torchrun) if torchrun.exists() else f"{python} -m torch.distributed.run",
        "TRAIN_SCRIPT": str(RUNNER),
        "GPUS_PER_NODE": "2",
        "MASTER_PORT": str(master_port or free_port()),
        "OMP_NUM_THREADS": "1",
        "MODEL_ARGS": " ".join([*TINY_MODEL, *CPU_FLAGS, *model_args]),
        "DATA_ARGS": " ".join(data_args),
        "EXTRA_ARGS": " ".join(extra_args),
        "EXTRA_ENV": " ".join(extra_env),
        # torchrun's grace before SIGKILL after a stop signal: the tiny model saves in < 1 s.
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60",
    }
    env.update(overrides)
    return env


def tiny_training(train_iters: int) -> list[str]:
    """``harness.TINY_TRAINING`` (micro-batch 2, global batch 8, ...) with ``train_iters``."""
    args = list(TINY_TRAINING)
    args[args.index("--train-iters") + 1] = str(train_iters)
    return args


def start_training(
    cluster: SlurmCluster,
    work: Path,
    data_args: Sequence[str],
    extra_args: Sequence[str] = (),
    *,
    train_iters: int,
    save_interval: int,
    job_name: str,
    sbatch_options: Sequence[str] = (),
    **env: str,
) -> PendingJob:
    """Submit ``launch/pretrain_gpt_ext.sbatch`` training the tiny model (DP=2) with
    checkpoints in ``work/ckpt``, the sample log in ``work/samples`` and the harness's shim
    counters in ``work/counts``; ``env`` overrides launch-script knobs (``MAX_RESTARTS``,
    ``MEGATRON_EXT_ON_SPIKE``, ...). Read the samples back with :func:`sample_records`."""
    job_env = training_env(
        work / "ckpt",
        tiny_training(train_iters),
        data_args,
        [
            "--save-interval",
            str(save_interval),
            "--sample-log-dir",
            str(work / "samples"),
            *extra_args,
        ],
        counts_dir=work / "counts",
        **env,
    )
    return cluster.start(SBATCH_SCRIPT, job_env, work, sbatch_options, job_name=job_name)


def fake_training_env(
    fake_python: Path, state_dir: Path, codes: Sequence[int], ckpt_dir: Path, **overrides: str
) -> dict[str, str]:
    """Environment that runs the launch script with ``LAUNCHER=python`` and a fake training
    (see :func:`write_fake_python`) that exits with ``codes[n-1]`` on its n-th start."""
    state_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "MEGATRON_EXT_ROOT": str(REPO),
        "CKPT_DIR": str(ckpt_dir),
        "LAUNCHER": "python",
        "PYTHON": str(fake_python),
        "MEGATRON_EXT_PYTHON": sys.executable,  # the supervisor; PYTHON is the fake training
        "FAKE_DIR": str(state_dir),
        "FAKE_CODES": " ".join(map(str, codes)),
    }
    env.update(overrides)
    return env


FAKE_PYTHON = r"""#!/bin/bash
# Fake training for the launch script (LAUNCHER=python): the n-th start exits ${FAKE_CODES[n-1]};
# on 0 it records a complete attempt where the supervisor asks, as pretrain_gpt_ext.py does.
d=$FAKE_DIR
n=$(( $(cat "$d/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" >"$d/count"
read -r -a codes <<<"${FAKE_CODES:-0}"
code=${codes[$((n - 1))]:-0}
echo "fake training start $n: SLURM_JOB_ID=${SLURM_JOB_ID:-}" \
    "SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-unset} argv: $*"
echo "fake training start $n: exit $code"
if [[ $code == 0 && -n ${MEGATRON_EXT_ATTEMPT_END_FILE:-} ]]; then
    echo '{"complete": true, "reason": "pretrain returned"}' >"$MEGATRON_EXT_ATTEMPT_END_FILE"
fi
exit "$code"
"""


def write_fake_python(path: Path) -> Path:
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample_records(sample_dir: Path) -> dict[int, list[SampleRecord]]:
    """Sample records per DP rank, in the order they were trained (as ``harness.Run``)."""
    return {
        int(p.stem.removeprefix("samples-dp")): list(read_records(p))
        for p in sorted(sample_dir.glob("samples-dp*.jsonl"))
    }


def latest_checkpoint(ckpt_dir: Path) -> int:
    """Megatron's ``latest_checkpointed_iteration.txt`` (-1 when there is none yet)."""
    try:
        return int((ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip())
    except (FileNotFoundError, ValueError):
        return -1


def cannot_run(what: str, reason: str) -> None:
    """Skip a test that this machine cannot run, saying why; on CI (where it must run), fail."""
    import pytest

    if on_ci():
        pytest.fail(f"CI is set, so {what} must run, but: {reason}")
    pytest.skip(f"{reason} (set CI=1 to fail instead)")


def require_slurm(what: str, why_root: str) -> None:
    """Root and an installed Slurm (installing it if needed), or skip ``what`` (on CI: fail)
    saying which is missing."""
    if os.geteuid() != 0:
        cannot_run(what, why_root)
    result = SlurmCluster.install()
    if result.returncode != 0:
        cannot_run(
            what,
            f"Slurm is not installed and could not be installed "
            f"(tests/support/slurm_local_cluster.sh install, rc {result.returncode}): "
            f"{result.stderr.strip()[-800:]}",
        )


def ensure_cluster(root: Path) -> SlurmCluster:
    """Install Slurm if needed and start a cluster in ``root``; skip (or, on CI, fail) with
    the reason when that is impossible here. For a pytest fixture."""
    require_slurm(
        "the Slurm tests",
        "the local Slurm cluster runs its daemons as root (SlurmUser=root); not root",
    )
    return SlurmCluster.start_in(root)
