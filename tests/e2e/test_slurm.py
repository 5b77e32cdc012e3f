"""``launch/pretrain_gpt_ext.sbatch`` under a real Slurm 22.05 scheduler (single node).

The cluster is ``tests/support/slurm_local_cluster.sh`` in a temporary directory (see
``tests/support/slurm.py``); every job here goes through ``sbatch``, and what the tests assert
comes from ``sbatch --wait``'s exit code, ``scontrol show job`` (``JobState``, ``ExitCode``,
``Restarts``) and the job's output file.

* The real training jobs run the real launch script with torchrun, 2 processes on the node
  (DP=2), training ``megatron_ext/cpu/run.py`` (the real Megatron loop on CPU) on the tiny model.
* Preemption: ``scancel --signal=USR1 --batch`` (what ``--signal=B:USR1@300`` delivers before
  the time limit, sent once the first checkpoint exists so that it lands mid-run).
* Exit codes: a real 17 from Megatron's rerun state machine (``--error-injection-type
  transient_error``); 16 (requeue, resume, and the restart budget) and an unrelated crash (1)
  from a fake training under ``LAUNCHER=python``.

Skipped only when Slurm is missing and cannot be installed here (or not root), and never when
``CI`` is set: then it fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_ext.common.records.skip_ranges import read_ranges
from megatron_ext.demo import TINY_DETECTOR
from tests.support.slurm import (
    SBATCH_SCRIPT,
    JobResult,
    PendingJob,
    SlurmCluster,
    ensure_cluster,
    fake_training_env,
    latest_checkpoint,
    sample_records,
    start_training,
    wait_all,
    write_fake_python,
)

pytestmark = pytest.mark.timeout(900)

TRAIN_ITERS = 100  # long enough that a signal sent after the first checkpoint lands mid-run
SAVE_INTERVAL = 10


# Slurm delivers the stop signal to every process of the step (and torchrun forwards it with
# killpg). Without the registered fix `ckpt-results-queue-survives-sigterm` that also kills the
# Manager process behind dist-checkpointing's results queue, and the --exit-signal-handler save
# fails with BrokenPipeError (megatron-core 0.19.2); this test is what found it.


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    """A running single-node cluster for the session, stopped by PID afterwards."""
    cluster = ensure_cluster(tmp_path_factory.mktemp("slurm-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


def _train_job(
    slurm: SlurmCluster, work: Path, data_args: list[str], *extra: str, name: str, **env: str
) -> PendingJob:
    return start_training(
        slurm,
        work,
        data_args,
        extra,
        train_iters=TRAIN_ITERS,
        save_interval=SAVE_INTERVAL,
        job_name=name,
        **env,
    )


def _assert(job: JobResult, ok: bool, what: str) -> None:
    assert ok, f"{what}\n{job.describe()}"


@pytest.fixture(scope="module")
def uninterrupted(slurm: SlurmCluster, tmp_path_factory, data_args) -> tuple[JobResult, Path]:
    """One normal training job, start to finish (also the reference for the preemption test)."""
    work = tmp_path_factory.mktemp("slurm-normal")
    job = _train_job(slurm, work, data_args, name="mx-normal").result(timeout=600)
    return job, work


def test_normal_job_trains_to_completion_with_both_ranks(uninterrupted) -> None:
    job, work = uninterrupted
    _assert(job, job.returncode == 0, "sbatch --wait must return the job's exit code 0")
    _assert(
        job,
        (job.state, job.exit_code, job.restarts) == ("COMPLETED", (0, 0), 0),
        "scontrol must show a completed job with no restart",
    )
    log = job.output
    # The launch script's own command: srun + torchrun c10d rendezvous on the allocated node.
    _assert(
        job,
        re.search(
            r"\+ srun --nodes=1 --ntasks=1 .* --nproc-per-node 2 .*"
            r"--rdzv-backend c10d --rdzv-endpoint localhost:\d+",
            log,
        )
        is not None,
        "the log must show the srun + torchrun command",
    )
    # torchrun's rendezvous result: both workers joined (global ranks 0 and 1 of 2).
    _assert(
        job,
        re.search(
            r"Rendezvous complete for workers.*global_ranks=\[0, 1\]"
            r".*global_world_sizes=\[2, 2\]",
            log,
            re.S,
        )
        is not None,
        "the log must show the c10d rendezvous of both ranks",
    )
    _assert(
        job,
        "data-parallel size: 2" in log or "world size: 2" in log,
        "Megatron must report a world of 2 ranks",
    )
    _assert(job, "training finished successfully" in log, "the launch script must report success")
    assert latest_checkpoint(work / "ckpt") == TRAIN_ITERS
    records = sample_records(work / "samples")
    assert sorted(records) == [0, 1], "both data-parallel ranks must have trained"
    for recs in records.values():  # 2 micro-batches per rank and iteration
        assert [r.iteration for r in recs] == [k for k in range(1, TRAIN_ITERS + 1) for _ in "mb"]
    counts = sorted(p.name for p in (work / "counts").glob("rank*.json"))
    assert counts == ["rank0.json", "rank1.json"], "both ranks must have run the CPU harness"


def test_preemption_saves_requeues_and_resumes_exactly(
    slurm: SlurmCluster,
    uninterrupted,
    tmp_path_factory,
    data_args,
) -> None:
    reference, reference_work = uninterrupted
    assert reference.returncode == 0, reference.describe()
    work = tmp_path_factory.mktemp("slurm-preempt")
    pending = _train_job(slurm, work, data_args, name="mx-preempt")
    pending.wait_for(
        "the first checkpoint",
        lambda: latest_checkpoint(work / "ckpt") >= SAVE_INTERVAL,
        timeout=400,
    )
    # The warning signal Slurm sends the batch shell before a time limit / preemption.
    slurm.run("scancel", "--signal=USR1", "--batch", str(pending.job_id))
    pending.wait_for(
        "the training to stop after the signal",
        lambda: any(text in pending.output for text in ("requeueing Slurm job", "BrokenPipeError")),
        timeout=300,
    )
    if "requeueing Slurm job" not in pending.output:
        # The save failed: stop now rather than wait for torchrun's shutdown timeout.
        slurm.run("scancel", str(pending.job_id), check=False)
        failed = pending.result(timeout=120)
        pytest.fail(f"the save after the signal failed:\n{failed.describe()}")
    job = pending.result(timeout=600)
    log = job.output

    _assert(job, job.returncode == 0, "sbatch --wait must return 0 after the resumed run")
    _assert(
        job,
        job.state == "COMPLETED" and job.restarts >= 1 and job.exit_code == (0, 0),
        "the job must have been requeued (Restarts >= 1) and then completed",
    )
    _assert(
        job,
        "received SIGUSR1" in log and "requeueing Slurm job" in log,
        "the launch script must requeue on the warning signal",
    )
    _assert(
        job,
        "exiting program after receiving SIGTERM" in log,
        "Megatron's --exit-signal-handler must have stopped the training",
    )
    saved = [
        int(m)
        for m in re.findall(
            r"successfully saved checkpoint from iteration\s+(\d+)",
            log.split("requeueing Slurm job")[0],
        )
    ]
    _assert(
        job,
        bool(saved) and SAVE_INTERVAL <= saved[-1] < TRAIN_ITERS,
        f"the signal must land mid-run and be followed by a save (saves: {saved})",
    )
    stop_iteration = saved[-1]
    after = log.split("requeueing Slurm job", 1)[1]
    # The rerun: torchrun's rendezvous id is JOBID-SLURM_RESTART_COUNT-ATTEMPT.
    _assert(
        job,
        f"--rdzv-id {job.job_id}-1-1" in after,
        "the requeued run must see SLURM_RESTART_COUNT=1",
    )
    _assert(
        job,
        re.search(rf"loading checkpoint from \S+ at iteration {stop_iteration}\b", after)
        is not None
        or re.search(rf"successfully loaded checkpoint .* at iteration\s+{stop_iteration}\b", after)
        is not None,
        f"the rerun must resume from the latest checkpoint (iteration {stop_iteration})",
    )
    assert latest_checkpoint(work / "ckpt") == TRAIN_ITERS

    expected, got = sample_records(reference_work / "samples"), sample_records(work / "samples")
    assert sorted(got) == [0, 1]
    for dp_rank in (0, 1):
        iterations = [r.iteration for r in got[dp_rank]]
        assert iterations == sorted(iterations), "a resumed run replayed or skipped iterations"
        # Bit-exact: sample ids, token digests and token-summed losses, micro-batch by batch.
        assert got[dp_rank] == expected[dp_rank]


def test_exit_17_from_the_rerun_state_machine_stops_the_job(
    slurm: SlurmCluster,
    tmp_path_factory,
    data_args,
) -> None:
    """A real EXIT_CODE_FAILED_ON_RESULT_VALIDATION: Megatron injects a transient (not
    reproducible) NaN-check failure at iteration 2, reruns it in place and exits 17."""
    work = tmp_path_factory.mktemp("slurm-exit17")
    job = _train_job(
        slurm,
        work,
        data_args,
        "--error-injection-rate",
        "1",
        "--error-injection-type",
        "transient_error",
        name="mx-exit17",
    ).result(timeout=600)
    log = job.output
    _assert(job, job.returncode == 17, "sbatch --wait must return 17")
    _assert(
        job,
        (job.state, job.exit_code, job.restarts) == ("FAILED", (17, 0), 0),
        "scontrol must show a failed job, exit 17, never requeued",
    )
    _assert(
        job,
        "training exited 17 (EXIT_CODE_FAILED_ON_RESULT_VALIDATION)" in log,
        "the launch script must report the validation failure",
    )
    tracker = work / "ckpt" / "result_rejected_tracker.txt"
    assert tracker.is_file(), "Megatron must write the result-rejected tracker file"
    entries = tracker.read_text()
    assert f"jobID={job.job_id}" in entries and "node=" in entries
    _assert(
        job,
        "last tracker entries:" in log and "nodes named in the tracker file:" in log,
        "the launch script must print the tracker file and its nodes",
    )
    assert log.count("attempt 1: launching training") == 1
    assert "attempt 2:" not in log


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory) -> Path:
    return write_fake_python(tmp_path_factory.mktemp("slurm-fake") / "fake_python")


# name: (fake exit codes per start, extra env, sbatch rc, JobState, ExitCode, Restarts, starts)
FAKE_CASES = {
    # EXIT_CODE_RESUME_TO_DISAMBIGUATE: requeue, and the requeued run resumes and finishes.
    "exit16-requeue-resume": ("16 0", {}, 0, "COMPLETED", (0, 0), 1, 2),
    # ... within MAX_RESTARTS: a second 16 with the budget spent stops with 16.
    "exit16-budget-spent": ("16 16 0", {"MAX_RESTARTS": "1"}, 16, "FAILED", (16, 0), 1, 2),
    # An unrelated crash: stop with its code, no requeue.
    "exit1-crash-stops": ("1 0", {}, 1, "FAILED", (1, 0), 0, 1),
}
LOG_LINES = {
    "exit16-requeue-resume": [
        "training exited 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE)",
        "requeueing Slurm job",
        "training finished successfully",
    ],
    "exit16-budget-spent": ["requeueing Slurm job", "restart budget exhausted"],
    "exit1-crash-stops": ["training failed with exit code 1; stopping"],
}


def _fake_job_problems(name: str, job: JobResult, ckpt: Path) -> list[str]:
    _, _, rc, state, exit_code, restarts, starts = FAKE_CASES[name]
    log = job.output
    got = (job.returncode, job.state, job.exit_code, job.restarts)
    problems = []
    if got != (rc, state, exit_code, restarts):
        problems.append(
            f"(sbatch rc, JobState, ExitCode, Restarts): expected "
            f"{(rc, state, exit_code, restarts)}, got {got}"
        )
    for n in range(1, starts + 1):  # start n is Slurm's run n: SLURM_RESTART_COUNT = n - 1
        count = "unset" if n == 1 else str(n - 1)  # Slurm sets it only on a requeued run
        line = f"fake training start {n}: SLURM_JOB_ID={job.job_id} SLURM_RESTART_COUNT={count} "
        starts_seen = [text for text in log.splitlines() if text.startswith(line)]
        if not starts_seen:
            problems.append(f"missing {line!r}")
        elif f" --load {ckpt} " not in starts_seen[0]:  # every start resumes from CKPT_DIR
            problems.append(f"start {n} does not load {ckpt}: {starts_seen[0]!r}")
    if f"fake training start {starts + 1}:" in log:
        problems.append(f"more than {starts} starts")
    problems += [f"missing {text!r}" for text in LOG_LINES[name] if text not in log]
    return [f"{name}: {p}\n{job.describe()}" for p in problems]


def test_exit_codes_16_and_crash_are_handled_as_documented(
    slurm: SlurmCluster,
    fake_python: Path,
    tmp_path_factory,
) -> None:
    # The jobs run side by side (1 CPU each: --oversubscribe lifts the script's --exclusive),
    # which keeps the Slurm part of the suite short.
    pending = {}
    for name, (codes, extra, *_) in FAKE_CASES.items():
        work = tmp_path_factory.mktemp(f"slurm-{name}")
        env = fake_training_env(fake_python, work / "fake", codes.split(), work / "ckpt", **extra)
        job = slurm.start(SBATCH_SCRIPT, env, work, ["--oversubscribe"], job_name=name)
        pending[name] = (job, work / "ckpt")
    results = wait_all([job for job, _ in pending.values()], timeout=300)
    problems = [
        p
        for (name, (_, ckpt)), result in zip(pending.items(), results)
        for p in _fake_job_problems(name, result, ckpt)
    ]
    assert not problems, "\n\n".join(problems)


DRILL_ITERS = 50
DRILL_SKIPPED = range(26, 38)  # rollback to checkpoint 25, then 12 batches skipped


def test_spike_drill_exits_42_plans_rolls_back_and_passes(
    slurm: SlurmCluster,
    tmp_path_factory,
    data_args,
) -> None:
    """The incident drill through sbatch: garbage tokens on DP rank 1 at iterations 32-36 →
    the detector requests a rollback (exit 42) → the launch script runs its default hook,
    ``megatron-ext skiplist --apply`` → relaunch in the same allocation → the run passes."""
    work = tmp_path_factory.mktemp("slurm-drill")
    drill = [
        "--signals-dir",
        str(work / "signals"),
        *TINY_DETECTOR,
        "--drill-corrupt-batch",
        "32-36:1",
    ]
    job = start_training(
        slurm,
        work,
        data_args,
        drill,
        train_iters=DRILL_ITERS,
        save_interval=5,
        job_name="mx-drill",
        MAX_ROLLBACKS="2",
        SKIPLIST_ARGS="--rollback-iters 5 --skip-batches 12",
    ).result(timeout=900)
    log = job.output
    _assert(
        job,
        job.returncode == 0 and job.state == "COMPLETED",
        "the job must complete after one automatic rollback",
    )
    _assert(
        job,
        "training exited 42" in log
        and "running spike hook (rollback 1/2)" in log
        and "spike hook done; relaunching" in log,
        "the launch script must run the planner on exit 42 and relaunch",
    )
    _assert(
        job,
        "Roll back to checkpoint 25, skip iterations 26-37" in log,
        "the default hook must plan the rollback + skip",
    )
    _assert(job, "running spike hook (rollback 2/2)" not in log, "one rollback must suffice")
    report = (work / "ckpt" / "megatron_ext_incidents" / "incident-001.md").read_text()
    assert "culprit DP rank (max local loss): 1" in report
    skipped = work / "ckpt" / "megatron_ext_skipped_iterations.txt"
    assert read_ranges(skipped) == [(26, 37)]  # with its samples window
    assert latest_checkpoint(work / "ckpt") == DRILL_ITERS
    records = sample_records(work / "samples")
    for dp_rank in (0, 1):
        recs = records[dp_rank]
        restart = next(i for i, r in enumerate(recs) if r.iteration == DRILL_SKIPPED[-1] + 1)
        sequence = [r for r in recs[:restart] if r.iteration < DRILL_SKIPPED[0]] + recs[restart:]
        expected = [
            k for k in range(1, DRILL_ITERS + 1) if k not in DRILL_SKIPPED for _ in "mb"
        ]  # 2 micro-batches per rank and iteration
        assert [r.iteration for r in sequence] == expected
