"""Launch ``pretrain_gpt_ext.py`` through the CPU harness and read back what the run did.

Test utility only: every launch is a real ``torchrun`` of the real entry point, so
``megatron.training.pretrain`` runs with gloo exactly as it would on GPUs minus the shims.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from megatron_ext.common.records.sample_log import SampleRecord, read_records
from megatron_ext.demo import CPU_FLAGS, TINY_MODEL
from megatron_ext.train import CPU_RUNNER

REPO = Path(__file__).resolve().parents[2]
RUNNER = CPU_RUNNER  # the package's CPU runner, as `megatron-ext train --cpu` runs it

TINY_TRAINING = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "20",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--seed",
    "1234",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
]
GLOBAL_BATCH = 8
MICRO_BATCH = 2
# Small DDP buckets so every model spans several; the update ratio so its field is exercised.
TELEMETRY = [
    "--log-bucket-grad-norms",
    "--log-layer-norms",
    "--signals-update-ratio",
    "--overlap-grad-reduce",
    "--ddp-bucket-size",
    "20000",
]
SKIPPED = (13, 14)  # the iterations the resume-with-skips drills skip

# Every CUDA touch point megatron-core 0.19.2 hits on these paths; anything else is a finding.
EXPECTED_SHIMS = {
    "Stream",
    "Stream.wait_stream",
    "Stream.synchronize",
    "Stream.wait_event",
    "Stream.record_event",
    "Event",
    "Tensor.cuda",
    "Tensor.type",
    "Tensor.to(cuda)",
    "current_device",
    "current_stream",
    "default_stream",
    "stream",
    "device=cuda",
    "device_count",
    "empty_cache",
    "get_device_properties",
    "get_device_capability",
    "get_device_name",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "reset_peak_memory_stats",
    "random.get_rng_state",
    "set_device",
    "synchronize",
    "Module.cuda",
    "initialize_megatron(allow_no_cuda)",
    "torch.compile(eager)",
    "_lazy_call(dropped)",
    "DeviceMesh(cuda)",  # torch FSDP2's mesh (--use-torch-fsdp2)
}

# Exactly the shims the world-size-1 run (test_pretrain.py) fires, per megatron-core minor:
# a version that needs a new CUDA touch point, or no longer needs one, fails that test.
_WS1_SHIMS_0_19 = {
    "Stream",
    "Stream.wait_stream",
    "Tensor.cuda",
    "Tensor.type",
    "current_device",
    "current_stream",
    "device=cuda",
    "device_count",
    "empty_cache",
    "get_rng_state",
    "initialize_megatron(allow_no_cuda)",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "random.get_rng_state",
    "set_device",
    "stream",
    "synchronize",
    "torch.compile(eager)",
    "_lazy_call(dropped)",
}
# 0.17/0.18's classic get_model moves the built model with Module.cuda(); 0.19's builder
# does not (the overlay's own model provider on 0.17/0.18 returns it to Megatron's get_model).
WS1_SHIMS = {
    "0.17": _WS1_SHIMS_0_19 | {"Module.cuda"},
    "0.18": _WS1_SHIMS_0_19 | {"Module.cuda"},
    "0.19": _WS1_SHIMS_0_19,
}


@dataclass
class Run:
    """What one launch left behind."""

    workdir: Path
    returncode: int
    log: str

    @property
    def samples(self) -> Path:
        return self.workdir / "samples"

    def shim_counts(self) -> dict[int, dict[str, int]]:
        """Per-rank shim counters dumped by the harness at exit."""
        return {
            int(p.stem.removeprefix("rank")): json.loads(p.read_text())
            for p in sorted((self.workdir / "counts").glob("rank*.json"))
        }

    def exits(self) -> dict[int, dict]:
        """Per global rank, what the harness recorded: ``exit_code`` (the code the rank chose;
        absent if a signal ended it first) and ``reads`` (micro-batches read per DP rank)."""
        return {
            int(p.stem.removeprefix("exit-rank")): json.loads(p.read_text())
            for p in sorted((self.workdir / "counts").glob("exit-rank*.json"))
        }

    def records(self) -> dict[int, list[SampleRecord]]:
        """Sample records per DP rank, in the order they were trained."""
        return {
            int(p.stem.removeprefix("samples-dp")): list(read_records(p))
            for p in sorted(self.samples.glob("samples-dp*.jsonl"))
        }


def launch(
    workdir: Path,
    args: list[str],
    nproc: int = 1,
    kill_at_checkpoint: int | None = None,
    timeout: float = 600,
    sample_log: bool = True,
    model: list[str] = TINY_MODEL,
    training: list[str] = TINY_TRAINING,
    script: Path | None = None,
    launcher: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Run:
    """Run the entry point under torchrun (``launcher``: another one's command and flags
    instead, e.g. nvidia-resiliency-ext's ``ft_launcher``; ``env``: more environment);
    optionally SIGKILL the whole job right after the checkpoint of iteration
    ``kill_at_checkpoint`` is committed (crash-after-save drill).
    ``sample_log=False`` leaves ``--sample-log-dir`` out (benchmarks' "off" arm); ``model``
    replaces the tiny model's flags (e.g. without ``--untie-embeddings-and-output-weights``),
    ``training`` the training flags (e.g. sample-based, without ``--train-iters``);
    ``script`` runs that pretrain script instead of the entry point (the CPU runner's
    ``--script``: a script of the user's own on ``megatron_ext.fork``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        MEGATRON_EXT_HARNESS_COUNTS=str(workdir / "counts"),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        **(env or {}),
    )
    cmd = [
        *(launcher or (sys.executable, "-m", "torch.distributed.run", "--standalone")),
        f"--nproc-per-node={nproc}",
        str(RUNNER),
        *(["--script", str(script)] if script is not None else []),
        *model,
        *training,
        *CPU_FLAGS,
        *(["--sample-log-dir", str(workdir / "samples")] if sample_log else []),
        *args,
    ]
    log_path = workdir / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                kill_tree(proc.pid)
                raise TimeoutError(f"launch timed out; log: {log_path}")
            if kill_at_checkpoint is not None and _checkpointed(args, kill_at_checkpoint):
                kill_tree(proc.pid)
                proc.wait()
                break
            time.sleep(0.05)
    return Run(workdir, proc.returncode, log_path.read_text())


def run_logged(cmd: list[str], work: Path, env: dict[str, str], timeout: float) -> Run:
    """Run ``cmd`` in ``work`` (its own session), output to ``work/log.txt``; the whole process
    tree is killed at ``timeout``."""
    log = work / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=work, env=env, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            raise
    return Run(work, proc.returncode, log.read_text())


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every descendant (torchrun puts workers in their own sessions)."""
    parent = psutil.Process(pid)
    for process in [*parent.children(recursive=True), parent]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)


def _checkpointed(args: list[str], iteration: int) -> bool:
    save = Path(args[args.index("--save") + 1])
    tracker = save / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip() or -1) >= iteration
    except (FileNotFoundError, ValueError):
        return False


def checkpoint_args(save_dir: Path, iteration: int):
    """The Megatron ``args`` namespace stored in a torch_dist checkpoint."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    return load_common_state_dict(str(save_dir / f"iter_{iteration:07d}"))["args"]


def run_skiplist(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``megatron-ext skiplist`` over a harness run directory (``work/ckpt``,
    ``work/signals``), as its own process, as the launchers' supervisor runs it."""
    command = [sys.executable, "-m", "megatron_ext.cli", "skiplist"]
    command += ["--ckpt-dir", str(work / "ckpt"), "--signals-dir", str(work / "signals")]
    return subprocess.run([*command, *extra], capture_output=True, text=True)


def rank0_alone(
    flags: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The entry point through the harness as rank 0 of 2, without torchrun: a refusal must
    come before distributed init (which would wait for a rank 1 that never starts). ``env``
    adds to the environment."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", OMP_NUM_THREADS="1") | (
        env or {}
    )
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")
    command = [sys.executable, str(RUNNER), *TINY_MODEL, *CPU_FLAGS, *TINY_TRAINING, *flags]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
