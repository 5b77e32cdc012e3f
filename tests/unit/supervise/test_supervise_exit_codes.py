"""The launchers' exit-code policy and signal handling, end to end through the real scripts
and ``megatron-ext supervise`` with a fake training command (LAUNCHER=python) and stub Slurm
commands (tests/support/launcher_fakes.py)."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import pytest

from tests.support.launcher_fakes import REPO, SBATCH, SINGLE, Harness, follows, wait_ready


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def test_single_exit_0(h: Harness):
    h.fake_launcher("0")
    r = h.run(SINGLE, "--foo", "bar", EXTRA_ARGS="--train-iters 3")
    assert r.returncode == 0, r.stderr
    assert h.launches == 1
    argv = h.argv(1)
    assert argv[0] == str(REPO / "pretrain_gpt_ext.py")
    assert follows(argv, "--save", str(h.ckpt), "--load", str(h.ckpt))
    assert follows(argv, "--train-iters", "3", "--foo", "bar")
    env = (h.fake / "env.1").read_text().splitlines()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in env
    assert "finished successfully" in r.stderr
    assert h.ckpt.is_dir()


def test_single_exit_16_relaunches_then_finishes(h: Harness):
    h.fake_launcher("16 0")
    r = h.run(SINGLE)
    assert r.returncode == 0, r.stderr
    assert h.launches == 2
    assert "EXIT_CODE_RESUME_TO_DISAMBIGUATE" in r.stderr
    assert "restart 1/10" in r.stderr


def test_single_early_exits_resume_until_the_training_is_complete(h: Harness):
    """Exit 0 before the last iteration (exit duration, exit interval, a TERM to the workers)
    is not success: relaunched, without charging the restart budget while it saved progress."""
    h.fake_launcher("0 0 0")
    r = h.run(SINGLE, MAX_RESTARTS="0", FAKE_EARLY_EXIT="1 2")
    assert r.returncode == 0, r.stderr
    assert h.launches == 3
    assert r.stderr.count("stopped early after --exit-duration-in-mins 1") == 2
    assert "with checkpoint 20; resuming" in r.stderr
    assert "finished successfully (reached its last iteration)" in r.stderr
    assert "finished successfully" not in r.stderr.split("attempt 3:")[0]


def test_single_early_exits_without_progress_stop_within_the_budget(h: Harness):
    h.fake_launcher("0 0 0")
    r = h.run(SINGLE, MAX_RESTARTS="1", FAKE_EARLY_EXIT="1 2 3", FAKE_NO_PROGRESS="1")
    assert r.returncode == 75, r.stderr
    assert h.launches == 2
    assert "no progress since the last attempt; restart 1/1" in r.stderr
    assert "the training is NOT complete" in r.stderr


def test_sbatch_early_exit_with_progress_requeues_uncharged(h: Harness):
    h.slurm(SLURM_RESTART_COUNT="3").fake_launcher("0")
    r = h.run(SBATCH, MAX_RESTARTS="3", FAKE_EARLY_EXIT="1")
    assert r.returncode == 0, r.stderr
    assert "scontrol requeue 77" in h.stub_calls
    assert (h.ckpt / "launch_state" / "uncharged_requeues").read_text() == "1\n"


def test_single_exit_16_bounded_by_max_restarts(h: Harness):
    h.fake_launcher("16 16 16 16")
    r = h.run(SINGLE, MAX_RESTARTS="2")
    assert r.returncode == 16, r.stderr
    assert h.launches == 3
    assert "MAX_RESTARTS=2" in r.stderr and "giving up" in r.stderr


def test_single_exit_16_counts_slurm_restart_count(h: Harness):
    h.fake_launcher("16 0")
    r = h.run(SINGLE, MAX_RESTARTS="2", SLURM_RESTART_COUNT="2")
    assert r.returncode == 16, r.stderr
    assert h.launches == 1


@pytest.mark.parametrize("script", [SINGLE, SBATCH])
def test_exit_17_stops_and_reports_tracker(h: Harness, script: Path):
    h.slurm().fake_launcher("17 0")
    h.ckpt.mkdir()
    tracker = h.ckpt / "result_rejected_tracker.txt"
    tracker.write_text(
        "ts=2025-01-01 00:00:00 node=gpu-a019 device=3 jobID=77 rank=11 iteration=1200 "
        "status=RerunValidationStatus.RERUN_REPRODUCIBLE result=nan message='loss is NaN'\n"
    )
    r = h.run(script)
    assert r.returncode == 17, r.stderr
    assert h.launches == 1
    assert "EXIT_CODE_FAILED_ON_RESULT_VALIDATION" in r.stderr
    assert str(tracker) in r.stderr
    assert "gpu-a019" in r.stderr  # suspect node from the tracker file
    assert "loss is NaN" in r.stderr
    assert not any("requeue" in c for c in h.stub_calls)


def test_exit_17_custom_tracker_from_user_args(h: Harness):
    h.fake_launcher("17")
    custom = h.tmp / "mytracker.txt"
    r = h.run(SINGLE, "--result-rejected-tracker-filename", str(custom))
    assert r.returncode == 17
    assert str(custom) in r.stderr


@pytest.mark.parametrize("script", [SINGLE, SBATCH])
def test_exit_42_without_hook_stops(h: Harness, script: Path):
    h.slurm().fake_launcher("42 0")
    r = h.run(script)
    assert r.returncode == 42, r.stderr
    assert h.launches == 1
    assert "MEGATRON_EXT_ON_SPIKE is not set" in r.stderr


@pytest.mark.parametrize("script", [SINGLE, SBATCH])
def test_exit_42_runs_hook_and_relaunches(h: Harness, script: Path):
    h.slurm().fake_launcher("42 0")
    marker = h.tmp / "hook.log"
    hook = (
        f'echo "$MEGATRON_EXT_ROLLBACK/$MEGATRON_EXT_MAX_ROLLBACKS $MEGATRON_EXT_CKPT_DIR '
        f'$MEGATRON_EXT_TRAIN_EXIT_CODE" >> {shlex.quote(str(marker))}'
    )
    r = h.run(script, MEGATRON_EXT_ON_SPIKE=hook)
    assert r.returncode == 0, r.stderr
    assert h.launches == 2
    assert marker.read_text().splitlines() == [f"1/5 {h.ckpt} 42"]


def test_exit_42_bounded_by_max_rollbacks(h: Harness):
    h.fake_launcher("42 42 42")
    marker = h.tmp / "hook.log"
    r = h.run(SINGLE, MAX_ROLLBACKS="1", MEGATRON_EXT_ON_SPIKE=f"echo x >> {marker}")
    assert r.returncode == 42
    assert h.launches == 2
    assert marker.read_text() == "x\n"
    assert "MAX_ROLLBACKS=1" in r.stderr


def test_exit_42_hook_failure_stops(h: Harness):
    h.fake_launcher("42 0")
    r = h.run(SINGLE, MEGATRON_EXT_ON_SPIKE="exit 3")
    assert r.returncode == 42
    assert h.launches == 1
    assert "spike hook failed with exit 3" in r.stderr


@pytest.mark.parametrize("code", ["1", "2", "137"])
@pytest.mark.parametrize("script", [SINGLE, SBATCH])
def test_other_exit_codes_stop_with_that_code(h: Harness, script: Path, code: str):
    h.slurm().fake_launcher(f"{code} 0")
    r = h.run(script)
    assert r.returncode == int(code), r.stderr
    assert h.launches == 1
    assert f"training failed with exit code {code}" in r.stderr


def test_sbatch_exit_0_runs_through_srun(h: Harness):
    h.slurm(SLURM_NNODES="1").fake_launcher("0")
    r = h.run(SBATCH, "--foo")
    assert r.returncode == 0, r.stderr
    assert h.launches == 1
    sruns = [c for c in h.stub_calls if c.startswith("srun ")]
    assert len(sruns) == 1 and "--ntasks-per-node=1" in sruns[0]
    assert "--foo" in h.argv(1)


def test_sbatch_exit_16_requeues(h: Harness):
    h.slurm(SLURM_RESTART_COUNT="1").fake_launcher("16 0")
    r = h.run(SBATCH)
    assert r.returncode == 0, r.stderr
    assert h.launches == 1
    assert "scontrol requeue 77" in h.stub_calls
    assert "restart 2/100" in r.stderr


def test_sbatch_exit_16_budget_spent(h: Harness):
    h.slurm(SLURM_RESTART_COUNT="3").fake_launcher("16")
    r = h.run(SBATCH, MAX_RESTARTS="3")
    assert r.returncode == 16, r.stderr
    assert "scontrol requeue 77" not in h.stub_calls
    assert "giving up" in r.stderr


def test_sbatch_exit_16_requeue_failure(h: Harness):
    h.slurm().fake_launcher("16")
    r = h.run(SBATCH, FAKE_REQUEUE_RC="1")
    assert r.returncode == 16, r.stderr
    assert "scontrol requeue 77" in h.stub_calls


def test_sbatch_exit_16_inplace_mode(h: Harness):
    h.slurm().fake_launcher("16 0")
    r = h.run(SBATCH, RESTART_MODE="inplace")
    assert r.returncode == 0, r.stderr
    assert h.launches == 2
    assert "scontrol requeue 77" not in h.stub_calls
    assert len([c for c in h.stub_calls if c.startswith("srun ")]) == 2


def test_sbatch_usr1_saves_and_requeues(h: Harness):
    h.slurm(SLURM_NNODES="1").fake_launcher("0")
    proc = h.popen(SBATCH, FAKE_WAIT_FOR_TERM="1")
    wait_ready(h, proc)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (h.fake / "signals").read_text() == "TERM\n"  # Megatron's exit signal
    assert "scancel --signal=TERM 77" in h.stub_calls  # not SIGTERM to srun
    assert "scontrol requeue 77" in h.stub_calls
    assert h.launches == 1


def test_sbatch_usr1_with_spent_budget_stops_without_requeue(h: Harness):
    h.slurm(SLURM_NNODES="1", SLURM_RESTART_COUNT="5").fake_launcher("0")
    proc = h.popen(SBATCH, FAKE_WAIT_FOR_TERM="1", MAX_RESTARTS="5")
    wait_ready(h, proc)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGUSR1.value, err
    assert "scancel --signal=TERM 77" in h.stub_calls
    assert "scontrol requeue 77" not in h.stub_calls
    assert "not requeueing" in err


def test_sbatch_sigterm_saves_and_stops_without_requeue(h: Harness):
    h.slurm(SLURM_NNODES="1").fake_launcher("0")
    proc = h.popen(SBATCH, FAKE_WAIT_FOR_TERM="1")
    wait_ready(h, proc)
    proc.send_signal(signal.SIGTERM)  # e.g. scancel: save, but do not requeue
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM.value, err
    assert (h.fake / "signals").read_text() == "TERM\n"
    assert "scontrol requeue 77" not in h.stub_calls


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_single_signal_forwarded_as_sigterm(h: Harness, sig: signal.Signals):
    h.fake_launcher("0")
    proc = h.popen(SINGLE, FAKE_WAIT_FOR_TERM="1")
    wait_ready(h, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig.value, err
    assert (h.fake / "signals").read_text() == "TERM\n"
    assert "rerun the same command to resume" in err
    assert h.launches == 1
