"""torchrun under the launchers: the workers' own exit codes survive (torchrun itself exits 1),
the rendezvous, and SIGTERM reaching every worker so it can save."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from tests.support.launcher_fakes import (
    REPO,
    SBATCH,
    SINGLE,
    TORCHRUN,
    Harness,
    free_port,
    wait_ready,
)


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun at {TORCHRUN}")


@needs_torchrun
def test_single_torchrun_propagates_worker_exit_16(h: Harness):
    h.env.update(PYTHON=str(h.python), TORCHRUN=str(TORCHRUN), GPUS_PER_NODE="2")
    r = h.run(SINGLE, MAX_RESTARTS="0", FAKE_CODE_RANK_0="16", FAKE_CODE_RANK_1="16", timeout=120)
    assert r.returncode == 16, r.stdout + r.stderr
    assert "launcher exited 1; training workers reported exit code 16" in r.stderr
    assert "MAX_RESTARTS=0" in r.stderr
    assert not list((h.ckpt / "launch_state" / "exit_codes").iterdir())  # cleaned up


@needs_torchrun
def test_single_torchrun_worker_killed_by_sigkill_restarts_within_budget(h: Harness):
    """Rank 1 SIGKILLed (its wrapper survives and records 137), rank 0 fails with 1 as a
    peer that lost its partner would: the kill is the cause, relaunch, then the budget."""
    h.env.update(PYTHON=str(h.python), TORCHRUN=str(TORCHRUN), GPUS_PER_NODE="2")
    r = h.run(SINGLE, MAX_RESTARTS="1", FAKE_CODE_RANK_0="1", FAKE_KILL_RANK_1="1", timeout=120)
    assert r.returncode == 137, r.stdout + r.stderr
    node = socket.gethostname()
    for attempt in (1, 2):
        assert f"attempt {attempt}: rank 0 on {node} exited 1, rank 1 on {node} exited 137" in (
            r.stderr
        )
    assert f"rank 1 on {node} killed by SIGKILL" in r.stderr
    assert "relaunching in place from the last checkpoint" in r.stderr
    assert "restart 1/1" in r.stderr and "MAX_RESTARTS=1" in r.stderr
    assert "attempt 3:" not in r.stderr


@needs_torchrun
def test_sbatch_torchrun_rendezvous_and_exit_17(h: Harness):
    h.slurm(SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", FAKE_HOSTNAMES="localhost")
    h.env.update(
        PYTHON=str(h.python),
        TORCHRUN=str(TORCHRUN),
        GPUS_PER_NODE="2",
        MASTER_PORT=str(free_port()),
    )
    # Megatron exits 17 on every rank (torchrun may SIGTERM the slower ones).
    r = h.run(SBATCH, "--seed", "1", FAKE_CODES="17", timeout=120)
    assert r.returncode == 17, r.stdout + r.stderr
    assert "EXIT_CODE_FAILED_ON_RESULT_VALIDATION" in r.stderr
    argv = h.argv(1)
    assert argv[0] == str(REPO / "pretrain_gpt_ext.py") and "--seed" in argv
    env = (h.fake / "env.1").read_text().splitlines()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in env
    assert "WORLD_SIZE=2" in env


@needs_torchrun
def test_single_torchrun_sigterm_lets_workers_save(h: Harness):
    h.env.update(PYTHON=str(h.python), TORCHRUN=str(TORCHRUN), GPUS_PER_NODE="2")
    proc = h.popen(SINGLE, FAKE_WAIT_FOR_TERM="1", FAKE_SAVE_SECONDS="1")
    wait_ready(h, proc, ("ready.0", "ready.1"))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM.value, err
    # torchrun passed SIGTERM on to both workers and waited for their "save".
    assert (h.fake / "saved.0").exists() and (h.fake / "saved.1").exists(), err
    assert sorted((h.fake / "signals").read_text().split()) == ["TERM", "TERM"]
