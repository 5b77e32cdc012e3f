"""The run lock's rules, with real processes: a live holder refuses, a kill -9'd one is taken
over, a holder on another host is judged by its heartbeat, a supervisor's lease is inherited
by its training, whose child lease outlives a dead supervisor and still refuses a relaunch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.common import run_lock as runlock
from megatron_ext.common.files import RUN_LOCK_FILE
from megatron_ext.common.run_lock import RunLockHeld, acquire, read_holder

HOLD = (
    "import sys, time\n"
    "from megatron_ext.common.run_lock import acquire\n"
    "lease = acquire(sys.argv[1], sys.argv[2], 'test')\n"
    "print(lease.holder.token, flush=True)\n"
    "time.sleep(600)\n"
)


def _holder_process(directory: Path, role: str, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), role],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    proc.token = proc.stdout.readline().strip()  # type: ignore[attr-defined]
    return proc


def test_a_live_holder_refuses_and_a_killed_one_is_taken_over(tmp_path, capsys) -> None:
    holder = _holder_process(tmp_path, "training")
    try:
        with pytest.raises(RunLockHeld, match=f"held by training pid {holder.pid} on") as exc:
            acquire(tmp_path, "skiplist", "skiplist --apply")
        assert "skiplist --apply refused" in str(exc.value) and "--force" in str(exc.value)
    finally:
        holder.kill()
        holder.wait()
    lease = acquire(tmp_path, "skiplist", "skiplist --apply")  # kill -9: its pid is gone
    assert "taking over the run lock of training pid" in capsys.readouterr().out
    assert read_holder(tmp_path / RUN_LOCK_FILE) == lease.holder
    lease.release()
    assert not (tmp_path / RUN_LOCK_FILE).exists()


def _foreign_lock(directory: Path, age_s: float) -> None:
    path = directory / RUN_LOCK_FILE
    holder = dict(role="training", host="gpu-elsewhere", pid=1, pid_start="1", job_id="9")
    path.write_text(json.dumps({**holder, "start_time": time.time(), "token": "f00"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_another_hosts_holder_is_judged_by_its_heartbeat(tmp_path) -> None:
    _foreign_lock(tmp_path, age_s=5)
    with pytest.raises(RunLockHeld, match=r"gpu-elsewhere, job 9.*heartbeat is [0-9]+ s old"):
        acquire(tmp_path, "training", "training")
    forced = acquire(tmp_path, "training", "training", force=True)  # known dead: --force
    forced.release()
    _foreign_lock(tmp_path, age_s=runlock.STALE_AFTER_S + 30)
    stale = acquire(tmp_path, "training", "training")
    assert stale.holder.host != "gpu-elsewhere"
    stale.release()


def test_a_training_inherits_its_supervisors_lease_and_watches_it(tmp_path) -> None:
    supervisor = _holder_process(tmp_path, "supervisor")
    env = {runlock.TOKEN_ENV: supervisor.token}  # type: ignore[attr-defined]
    training = _holder_process(tmp_path, "training", env)  # rank 0 under the supervisor
    try:
        child = read_holder(tmp_path / (RUN_LOCK_FILE + ".child"))
        assert child is not None and child.pid == training.pid
        with pytest.raises(RunLockHeld, match=f"held by supervisor pid {supervisor.pid}"):
            acquire(tmp_path, "training", "training")  # a second training, no token
        os.environ[runlock.TOKEN_ENV] = supervisor.token  # type: ignore[attr-defined]
        try:
            with pytest.raises(RunLockHeld, match="a training still running"):
                acquire(tmp_path, "skiplist", "skiplist --apply")  # hook while training runs
        finally:
            del os.environ[runlock.TOKEN_ENV]
        supervisor.kill()
        supervisor.wait()
        # The dead supervisor's lease is stale, but its training still runs: refused.
        with pytest.raises(RunLockHeld, match=f"training pid {training.pid}.*still running"):
            acquire(tmp_path, "supervisor", "supervise")
    finally:
        for proc in (supervisor, training):
            proc.kill()
            proc.wait()
    relaunch = acquire(tmp_path, "supervisor", "supervise")
    relaunch.release()


def test_the_heartbeat_notices_a_dead_supervisor_and_a_takeover(tmp_path) -> None:
    supervisor = _holder_process(tmp_path, "supervisor")
    os.environ[runlock.TOKEN_ENV] = supervisor.token  # type: ignore[attr-defined]
    try:
        lease = acquire(tmp_path, "training", "training")
    finally:
        del os.environ[runlock.TOKEN_ENV]
    assert lease.beat() is None
    supervisor.kill()
    supervisor.wait()
    lost = []
    lease.watch(lost.append, interval=0.05)
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "is dead: pid" in lost[0]
    lease.release()

    own = acquire(tmp_path, "training", "training", force=True)
    taker = acquire(tmp_path, "training", "training", force=True)
    assert own.beat() is not None and "was taken over by training pid" in own.beat()
    taker.release()
