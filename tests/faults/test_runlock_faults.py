"""One run, one writer: a second training, a `skiplist --apply`/`--undo` under a live run,
and a SIGKILLed supervisor, each for real (a real training, real torchrun)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.common.files import RUN_LOCK_FILE
from megatron_ext.common.run_lock import liveness, read_holder
from megatron_ext.demo import CPU_FLAGS, TINY_MODEL
from tests.support.faults import fault
from tests.support.harness import RUNNER, TINY_TRAINING, kill_tree, launch, run_skiplist
from tests.support.launcher_fakes import SINGLE, TORCHRUN, Harness, wait_ready


def _start(work: Path, args: list[str]) -> subprocess.Popen:
    """A real training (one rank) left running in the background."""
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=1", str(RUNNER), *TINY_MODEL, *TINY_TRAINING, *CPU_FLAGS]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(work / "log.txt", "w") as log:
        return subprocess.Popen(
            [*command, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
            start_new_session=True,
        )


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc.pid)
            pytest.fail(f"training ended or stalled; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@pytest.mark.e2e
@fault(
    "a second training started on the --save directory of a live one (another --seed); "
    "`skiplist --apply` and `skiplist --undo` by hand under the live run; then the first "
    "training killed (kill -9)",
    "the second training refuses before distributed initialisation and before writing "
    "anything, naming the holder (training pid, host, start time); apply and undo refuse "
    "(exit 2) naming it, nothing moved; after the kill -9 the dead holder's lock is taken "
    "over (its pid no longer runs) and `--undo` runs",
    area="run lock",
)
def test_one_run_directory_has_one_writer(data_args, tmp_path) -> None:
    work, ckpt = tmp_path / "A", tmp_path / "A" / "ckpt"
    run_flags = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "5"]
    a = _start(work, [*data_args, *run_flags, "--train-iters", "100000"])
    try:
        tracker = ckpt / "latest_checkpointed_iteration.txt"
        _wait_for(tracker.exists, a, work / "log.txt")
        holder = read_holder(ckpt / RUN_LOCK_FILE)
        assert holder is not None and holder.role == "training" and holder.pid != a.pid
        named = f"held by training pid {holder.pid} on {socket.gethostname()}"

        b = launch(tmp_path / "B", [*data_args, *run_flags, "--seed", "7"], timeout=300)
        assert b.returncode != 0
        assert f"training refused: {ckpt} is {named}" in b.log, b.log[-3000:]
        assert "initializing torch distributed" not in b.log  # refused before init
        assert not (tmp_path / "B" / "samples").exists()  # and before writing anything
        assert "runlock/" not in b.log  # a message, not a traceback of ours

        for action in ("--apply", "--undo"):
            before = sorted(p.name for p in ckpt.iterdir())
            result = run_skiplist(work, action)
            assert result.returncode == 2, result.stderr
            assert f"skiplist {action} refused: {ckpt} is {named}" in result.stderr
            assert not (ckpt / "megatron_ext_incidents").exists()
            assert set(before) <= {p.name for p in ckpt.iterdir()}  # nothing moved aside
    finally:
        kill_tree(a.pid)
        a.wait()
    assert (ckpt / RUN_LOCK_FILE).exists()  # kill -9: nobody released it
    deadline = time.monotonic() + 30  # SIGKILL is delivered asynchronously
    while liveness(holder, ckpt / RUN_LOCK_FILE)[0]:
        assert time.monotonic() < deadline, f"pid {holder.pid} survived SIGKILL"
        time.sleep(0.1)
    result = run_skiplist(work, "--undo")
    assert result.returncode == 0, result.stderr
    assert f"taking over the run lock of training pid {holder.pid}" in result.stdout
    assert "no longer runs on this host" in result.stdout
    assert not (ckpt / RUN_LOCK_FILE).exists()  # the tool released what it took


@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun at {TORCHRUN}")
@fault(
    "the supervisor killed with SIGKILL while its torchrun and two workers train; a second "
    "supervisor started on the same CKPT_DIR before that; then a relaunch",
    "the second supervisor refuses (exit 2) naming the live one; torchrun gets SIGTERM the "
    "moment its supervisor dies (PR_SET_PDEATHSIG), both workers save and exit instead of "
    "training on unnoticed; the relaunch takes the dead supervisor's lock over and finishes",
    area="run lock",
)
def test_a_sigkilled_supervisor_leaves_no_training_behind(tmp_path) -> None:
    h = Harness(tmp_path)
    h.env.update(PYTHON=str(h.python), TORCHRUN=str(TORCHRUN), GPUS_PER_NODE="2")
    first = h.popen(SINGLE, FAKE_WAIT_FOR_TERM="1", FAKE_SAVE_SECONDS="1")
    wait_ready(h, first, ("ready.0", "ready.1"))
    holder = read_holder(h.ckpt / RUN_LOCK_FILE)
    assert holder is not None and (holder.role, holder.pid) == ("supervisor", first.pid)

    second = h.run(SINGLE, FAKE_CODES="0", timeout=60)
    assert second.returncode == 2, second.stderr
    assert f"supervise refused: {h.ckpt} is held by supervisor pid {first.pid}" in second.stderr

    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while not all((h.fake / f"saved.{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "the workers kept training after the supervisor died"
        time.sleep(0.1)
    # Each worker is told to stop by TERM: through torchrun (the launcher's pdeathsig), and
    # under load also by its own heartbeat seeing the supervisor's lease die; both are TERM.
    received = (h.fake / "signals").read_text().split()
    assert len(received) >= 2 and set(received) == {"TERM"}, received

    relaunch = h.run(SINGLE, FAKE_CODES="0", timeout=60)
    assert relaunch.returncode == 0, relaunch.stderr
    out = relaunch.stdout + relaunch.stderr
    assert f"taking over the run lock of supervisor pid {first.pid}" in out
    assert not (h.ckpt / RUN_LOCK_FILE).exists()  # released at exit
