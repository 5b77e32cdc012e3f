"""Real incidents under the real single-node launcher (supervisor, torchrun, two CPU ranks):
a NaN loss, a crash in the forward, an early exit, a stop signal. Each fault is injected from
outside the project (tests/support/incidents.py) and every run ends by itself."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_ext.common.files import SKIPPED_ITERATIONS_FILE
from megatron_ext.demo import CPU_FLAGS, TINY_MODEL
from tests.support import incidents
from tests.support.faults import fault
from tests.support.harness import RUNNER, TINY_TRAINING, rank0_alone

pytestmark = pytest.mark.e2e

# Checkpoints every 2; the planner rolls back 3 and skips 4 batches (the tiny run's scale).
PLAN = {"SKIPLIST_ARGS": "--rollback-iters 3 --skip-batches 4"}
SAVE = ["--save-interval", "2"]


def _assert_nan_rolled_back_once(run: incidents.LauncherRun, last_logged: int) -> None:
    """One rollback for the NaN at 12; attempt 1 logged up to ``last_logged``."""
    assert run.returncode == 0, run.output[-4000:]
    rollbacks = [e for e in run.ledger if e.get("kind") == "rollback"]
    assert [(e["iteration"], e["onset"]) for e in rollbacks] == [(12, 12)]
    assert "non-finite loss or grad norm" in rollbacks[0]["classification"]
    lines = "\n".join(run.supervisor_lines())
    assert "rollback 1/" in lines and "rollback 2/" not in lines
    assert "training finished successfully (reached its last iteration)" in lines
    persisted = (run.work / "ckpt" / SKIPPED_ITERATIONS_FILE).read_text().splitlines()
    assert [line.split()[0] for line in persisted if not line.startswith("#")] == ["9-12"]
    trained = incidents.trained(run.work)
    assert max(trained[1]) == last_logged and 12 not in trained[2] and max(trained[2]) == 24
    report = (run.work / "ckpt" / "megatron_ext_incidents" / "incident-001.md").read_text()
    assert report.startswith("# Incident 001: rollback at iteration 12 (loss nan: non-finite")
    assert "likely cause: **non-finite loss or grad norm (NaN/Inf), no precursor**" in report
    assert incidents.wait_for_no_survivors(run.marker) == []


@fault(
    "the loss turns NaN at iteration 12 on every attempt that trains it (the model output "
    "times NaN from outside the project), default --rerun-mode validate_results: Megatron "
    "reran the step, found the NaN reproducible, saved and exited 16 to rerun on another "
    "GPU, and exited 16 again on every resume (Megatron-LM #5281's loop)",
    "the reproduced NaN becomes a rollback request (ledger: divergence and rollback at 12, "
    "'reproduced by Megatron's in-place rerun'); one rollback to 8 skipping 9-12; the "
    "relaunch trains to --train-iters and exits 0; no process left",
    area="incidents",
)
def test_a_nan_loss_rolls_back_once_in_the_default_rerun_mode(data_args, tmp_path) -> None:
    run = incidents.run(tmp_path, data_args, SAVE, 24, INJECT_NAN="12", **PLAN)
    _assert_nan_rolled_back_once(run, 11)  # the rerun machine stopped before logging 12
    rollback = next(e for e in run.ledger if e.get("kind") == "rollback")
    assert "reproduced by Megatron's in-place rerun" in rollback["classification"]
    assert "Got rescheduled on the same GPU" not in run.output


@fault(
    "the same NaN at iteration 12 with --rerun-mode disabled (Megatron raised on the rank "
    "that saw it; the probe run then never ended)",
    "the NaN is left to the spike detector (a line per rank says so): rollback at 12, one "
    "rollback skipping 9-12, exit 0 at --train-iters; no process left",
    area="incidents",
)
def test_a_nan_loss_rolls_back_once_with_the_rerun_machine_disabled(data_args, tmp_path) -> None:
    extra = [*SAVE, "--rerun-mode", "disabled"]
    run = incidents.run(tmp_path, data_args, extra, 24, INJECT_NAN="12", **PLAN)
    _assert_nan_rolled_back_once(run, 12)  # the NaN step was logged, then rolled back
    assert "--rerun-mode disabled: left to the spike detector" in run.output


@fault(
    "an exception raised in the forward at iteration 8 on rank 1, under the launcher (which "
    "always passes --exit-signal-handler): the rank printed its traceback and never exited "
    "(its data-loader workers inherit Megatron's SIGTERM handler and ignore multiprocessing's "
    "terminate at exit)",
    "both ranks end within seconds (the failed rank SIGKILLs its helper processes), the "
    "supervisor stops with 1 naming the ranks' codes; no process of the run is left",
    area="incidents",
)
def test_an_exception_in_training_ends_the_attempt_at_once(data_args, tmp_path) -> None:
    started = time.monotonic()
    run = incidents.run(
        tmp_path,
        data_args,
        SAVE,
        24,
        timeout=240,
        INJECT_RAISE_AT="8",
        INJECT_RAISE_RANK="1",
        MAX_RESTARTS="0",
    )
    assert run.returncode == 1, run.output[-4000:]
    assert "injected failure at iteration 8" in run.output
    assert "training failed with exit code 1; stopping" in run.output
    assert time.monotonic() - started < 120  # it hung until killed before
    assert incidents.wait_for_no_survivors(run.marker) == []


@fault(
    "--exit-duration-in-mins 60 reached at iteration 8 (Megatron saves and exits 0 before "
    "--train-iters: the supervisor said 'finished successfully' and never relaunched)",
    "the training records that it stopped early; the supervisor says so, relaunches without "
    "charging MAX_RESTARTS=0 (the checkpoint advanced) and finishes only when the training "
    "reaches --train-iters",
    area="incidents",
)
def test_an_exit_duration_stop_is_relaunched_to_the_end(data_args, tmp_path) -> None:
    extra = [*SAVE, "--exit-duration-in-mins", "60"]
    run = incidents.run(tmp_path, data_args, extra, 16, INJECT_TIME_PASSES_AT="8", MAX_RESTARTS="0")
    assert run.returncode == 0, run.output[-4000:]
    lines = "\n".join(run.supervisor_lines())
    assert "stopped early after --exit-duration-in-mins 60 before the last iteration" in lines
    assert "with checkpoint 8; resuming" in lines
    assert lines.count("finished successfully") == 1
    assert lines.index("resuming") < lines.index("finished successfully")
    trained = incidents.trained(run.work)
    assert max(trained[1]) == 8 and min(trained[2]) == 9 and max(trained[2]) == 16


@fault(
    "SIGTERM to the training processes at iteration ~6 (a scheduler or an operator "
    "signalling the job step), and to torchrun with them: with --exit-signal-handler they "
    "saved and exited 0, and the launcher said 'finished successfully' (or, with torchrun "
    "signalled too, reported the clean save as a failure, exit 1)",
    "told apart from the end of training: 'stopped early after a stop signal', relaunched "
    "from the saved checkpoint, finished at --train-iters with exit 0; no process left",
    area="incidents",
)
def test_sigterm_to_the_workers_is_a_stop_not_a_success(data_args, tmp_path) -> None:
    proc, marker = incidents.start(tmp_path, data_args, SAVE, 40)
    try:
        signals = tmp_path / "signals" / "signals.jsonl"
        deadline = time.monotonic() + 240
        while not (signals.exists() and signals.read_text().count("\n") >= 6):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.1)
        ranks = incidents.workers(marker)
        assert len(ranks) == 2
        torchrun = ranks[0].parent().parent()
        for target in (*ranks, torchrun):
            target.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        incidents.end_all(marker)
    output = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == 0, output[-4000:]
    assert "training stopped early after a stop signal" in output
    assert output.count("finished successfully") == 1
    assert "relaunching in place" in output
    assert incidents.wait_for_no_survivors(marker) == []


@fault(
    "a rank that dies by SIGTERM (plain torchrun stopped, no --exit-signal-handler): its "
    "checkpoint results-queue Manager (deaf to SIGTERM on purpose) was left running, ~370 MB "
    "each",
    "the Manager ends with its rank (PR_SET_PDEATHSIG), while it still ignores the stop "
    "signal the rank saves on",
    area="incidents",
)
def test_a_rank_killed_by_sigterm_leaves_no_results_queue_manager(data_args, tmp_path) -> None:
    args = [*TINY_MODEL, *CPU_FLAGS, *data_args, *TINY_TRAINING]
    args[args.index("--train-iters") + 1] = "100000"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", str(RUNNER), *args, "--save", str(tmp_path / "ckpt")]
    command += ["--save-interval", "1000"]
    with open(tmp_path / "log.txt", "w") as log:
        torchrun = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert torchrun.poll() is None and time.monotonic() < deadline
            if " iteration        3/" in (tmp_path / "log.txt").read_text():
                break
            time.sleep(0.1)
        family = psutil.Process(torchrun.pid).children(recursive=True)
        managers = [p for p in family if p.parent().pid in {c.pid for c in family}]
        assert managers, "no helper process of a rank found"
        torchrun.send_signal(signal.SIGTERM)
        torchrun.wait(timeout=120)
        _gone, alive = psutil.wait_procs(managers, timeout=20)
        assert alive == [], [p.cmdline()[:3] for p in alive]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun.pid, signal.SIGKILL)


@fault(
    "`--async-save --use-persistent-ckpt-worker` on the CPU runner: Megatron's persistent "
    "checkpoint worker starts in a "
    "forkserver without the runner's CUDA stand-ins and dies at the first save, and the "
    "training waited for it forever",
    "refused before distributed initialisation, saying why and what to do (drop it on CPU; "
    "the GPU ladder's rung 8 checks it on a GPU)",
    area="incidents",
)
def test_async_save_is_refused_on_the_cpu_runner(data_args, tmp_path) -> None:
    # Without the persistent worker Megatron turns --async-save off itself (with a warning).
    flags = ["--async-save", "--use-persistent-ckpt-worker", "--save", str(tmp_path / "ckpt")]
    flags += ["--save-interval", "5"]
    result = rank0_alone([*data_args, *flags])
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "--async-save is refused on the CPU runner" in output, output[-3000:]
    assert "initializing torch distributed" not in output, "refused after start-up"


@fault(
    "a NaN that comes back after the first rollback: the loss is NaN at iterations 12-13 (a bad "
    "stretch longer than the first skip window, as a damaged rollback target or a persistent "
    "fault would also bring it back), default rerun mode",
    "the second incident (onset 13, within the first window's reach) is a repeat: the planner "
    "rolls back past the first target (to 6, not 8) and skips past every window seen "
    "(7-17), saying what it tried; exit 0 at --train-iters after two rollbacks",
    area="incidents",
)
def test_a_nan_that_comes_back_rolls_back_further(data_args, tmp_path) -> None:
    run = incidents.run(tmp_path, data_args, SAVE, 24, INJECT_NAN="12-13", **PLAN)
    assert run.returncode == 0, run.output[-4000:]
    rollbacks = [(e["attempt"], e["onset"]) for e in run.ledger if e.get("kind") == "rollback"]
    assert rollbacks == [(1, 12), (2, 13)]
    applied = (run.work / "ckpt" / "megatron_ext_incidents" / "applied.jsonl").read_text()
    targets = [(r["rollback_to"], r["skip_window"]) for r in map(json.loads, applied.split())]
    assert targets == [(8, [9, 12]), (6, [7, 17])]
    assert "The same failure came back after incident 001 (onset 12)" in run.output
    trained = incidents.trained(run.work)
    assert 13 in trained[2] and not {12, 13} & trained[3] and max(trained[3]) == 24
    assert incidents.wait_for_no_survivors(run.marker) == []
