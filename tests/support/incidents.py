"""Real incidents under the real single-node launcher: faults injected from outside the project.

A ``sitecustomize`` on the workers' PYTHONPATH wraps ``GPTModel.forward`` the way bad data, a
divergence or a crash would show, keyed on the iteration Megatron is training, so the same
thing happens on every attempt that trains that iteration (as a reproducible failure does):

- ``INJECT_NAN=A-B``: the model output is multiplied by NaN at iterations A..B, on every rank;
- ``INJECT_RAISE_AT=K`` (``INJECT_RAISE_RANK=R``: only on that rank): an exception in the
  forward at iteration K;
- ``INJECT_HANG_AT=K`` (``INJECT_HANG_RANK=R``: only on that rank; ``INJECT_HANG_ONCE=1``: in
  the first attempt that reaches it only): the forward sleeps for an hour at iteration K, as
  a stuck filesystem read or a deadlock would;
- ``INJECT_SLOW_RANK=R`` (``INJECT_SLOW_S``, default 0.3): every training forward on rank R
  sleeps that long, as a slow GPU, host or data read would make it (a straggler);
- ``INJECT_TIME_PASSES_AT=K``: at iteration K of the first attempt only, Megatron's training
  start time moves two hours back, as if the run had trained that long, so
  ``--exit-duration-in-mins`` fires at its next check exactly as it would (the flag is whole
  minutes; this keeps the test seconds long).

Every process of the run carries ``MEGATRON_EXT_TEST_RUN`` in its environment, so a test can
find each one that outlived the run (:func:`survivors`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.support.launcher_fakes import SINGLE
from tests.support.slurm import tiny_training, training_env

SITECUSTOMIZE = r'''
import os

def _install():
    from megatron.core.models.gpt import gpt_model
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    nan = os.environ.get("INJECT_NAN", "")
    first, _, last = nan.partition("-")
    nan_range = range(int(first), int(last or first) + 1) if nan else range(0)
    raise_at = int(os.environ.get("INJECT_RAISE_AT", "0"))
    raise_rank = os.environ.get("INJECT_RAISE_RANK")
    time_at = int(os.environ.get("INJECT_TIME_PASSES_AT", "0"))
    hang_at = int(os.environ.get("INJECT_HANG_AT", "0"))
    hang_rank = os.environ.get("INJECT_HANG_RANK")
    once = os.environ.get("INJECT_ONCE_FILE", "")
    slow_rank = os.environ.get("INJECT_SLOW_RANK")
    slow_s = float(os.environ.get("INJECT_SLOW_S", "0.3"))
    forward = gpt_model.GPTModel.forward

    def injected(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        # During logged iteration k the rerun state machine's counter is k.
        k = get_rerun_state_machine().current_iteration
        if k == raise_at and raise_rank in (None, os.environ.get("RANK")):
            raise RuntimeError(f"injected failure at iteration {k}")
        if k == hang_at and hang_rank in (None, os.environ.get("RANK")):
            marker = f"{once}.hang"
            if not (os.environ.get("INJECT_HANG_ONCE") and os.path.exists(marker)):
                open(marker, "w").close()
                import time
                time.sleep(3600)  # injected hang
        if k == time_at and once and not os.path.exists(once):
            from megatron.training import training
            training._TRAIN_START_TIME -= 2 * 3600
            if os.environ.get("RANK") == "0":
                open(once, "w").close()
        if k in nan_range:
            out = out * float("nan")
        if slow_rank == os.environ.get("RANK") and self.training:
            import time
            time.sleep(slow_s)  # injected straggler
        return out

    gpt_model.GPTModel.forward = injected


class _Finder:
    """Install the wrapper right after megatron.core.models.gpt.gpt_model is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core.models.gpt.gpt_model":
            return None
        import sys
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):
            exec_module(module)
            _install()

        loader.exec_module = patched
        return spec


_KNOBS = (
    "INJECT_NAN", "INJECT_RAISE_AT", "INJECT_TIME_PASSES_AT", "INJECT_HANG_AT", "INJECT_SLOW_RANK"
)
if any(os.environ.get(v) for v in _KNOBS):
    import sys
    sys.meta_path.insert(0, _Finder())
'''


@dataclass
class LauncherRun:
    """One run of ``launch/run_single_node.sh`` (supervisor, torchrun, 2 CPU ranks)."""

    work: Path
    returncode: int | None
    output: str
    marker: str

    @property
    def ledger(self) -> list[dict]:
        path = self.work / "signals" / "spikes.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def supervisor_lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("[megatron-ext ")]


def launcher_env(
    work: Path, data_args: list[str], extra_args: list[str], train_iters: int, **knobs: str
) -> tuple[dict[str, str], str]:
    """The launcher's environment for a tiny 2-rank CPU run in ``work`` with the spike
    pipeline on, and the run's marker; ``knobs`` are launcher knobs or ``INJECT_*`` values."""
    inject = work / "inject"
    inject.mkdir(parents=True, exist_ok=True)
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marker = uuid.uuid4().hex
    injections = {k: v for k, v in knobs.items() if k.startswith("INJECT_")}
    args = [
        *tiny_training(train_iters),
        "--signals-dir",
        str(work / "signals"),
        "--spike-detect",
        *extra_args,
    ]
    env = training_env(work / "ckpt", [], data_args, args)
    repo = env["MEGATRON_EXT_ROOT"]
    env["EXTRA_ENV"] += " " + " ".join(
        [
            f"PYTHONPATH={inject}:{repo}",
            f"MEGATRON_EXT_TEST_RUN={marker}",
            f"INJECT_ONCE_FILE={work / 'inject' / 'fired'}",
            *(f"{k}={v}" for k, v in injections.items()),
        ]
    )
    env.update({k: v for k, v in knobs.items() if not k.startswith("INJECT_")})
    return {**os.environ, **env, "MEGATRON_EXT_TEST_RUN": marker}, marker


def start(
    work: Path, data_args: list[str], extra_args: list[str], train_iters: int, **knobs: str
) -> tuple[subprocess.Popen, str]:
    """Start the launcher in the background (its output in ``work/launcher.log``)."""
    env, marker = launcher_env(work, data_args, extra_args, train_iters, **knobs)
    with open(work / "launcher.log", "w") as log:  # the child keeps its own copy
        proc = subprocess.Popen(
            ["bash", str(SINGLE)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work
        )
    return proc, marker


def run(
    work: Path,
    data_args: list[str],
    extra_args: list[str],
    train_iters: int,
    timeout: float = 400,
    **knobs: str,
) -> LauncherRun:
    """Run the launcher to its end (killed, with everything it started, after ``timeout``)."""
    proc, marker = start(work, data_args, extra_args, train_iters, **knobs)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_all(marker)
        proc.wait()
        returncode = None
    else:
        returncode = proc.returncode
    return LauncherRun(work, returncode, (work / "launcher.log").read_text(), marker)


def trained(work: Path) -> dict[int, set[int]]:
    """Iterations each attempt logged, from ``work/signals/signals.jsonl``."""
    seen: dict[int, set[int]] = {}
    for line in (work / "signals" / "signals.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "iteration" in record and "attempt" in record:
            seen.setdefault(record["attempt"], set()).add(record["iteration"])
    return seen


def injected(work: Path, **values: str) -> dict[str, str]:
    """The environment of a launch of our own (not the launcher's) with :data:`SITECUSTOMIZE`
    on the path and ``INJECT_*`` ``values``."""
    inject = work / "inject"
    inject.mkdir(parents=True, exist_ok=True)
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = [str(inject), str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    return {
        "PYTHONPATH": os.pathsep.join(path),
        "INJECT_ONCE_FILE": str(inject / "fired"),
        **values,
    }


def survivors(marker: str) -> list[psutil.Process]:
    """Every process still carrying the run's marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get("MEGATRON_EXT_TEST_RUN") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for_no_survivors(marker: str, timeout: float = 20) -> list[psutil.Process]:
    """The processes of the run still alive ``timeout`` seconds from now (none, at best)."""
    deadline = time.monotonic() + timeout
    while (left := survivors(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def end_all(marker: str) -> None:
    for proc in survivors(marker):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)


def workers(marker: str) -> list[psutil.Process]:
    """The training ranks of the run: the CPU runner's processes started by a rank wrapper
    (bash), not their forked helpers (data-loader workers, the results-queue Manager)."""
    ranks = []
    for proc in survivors(marker):
        try:
            if any(a.endswith("cpu/run.py") for a in proc.cmdline()) and (
                proc.parent() is not None and proc.parent().name() == "bash"
            ):
                ranks.append(proc)
        except psutil.NoSuchProcess:
            continue
    return ranks
