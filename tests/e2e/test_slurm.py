"""``launch/pretrain_gpt_ext.sbatch`` under a real Slurm 22.05 scheduler (single node).

The cluster is ``tests/support/slurm_local_cluster.sh`` in a temporary directory (see
``tests/support/slurm.py``); every job here goes through ``sbatch``, and what the tests assert
comes from ``sbatch --wait``'s exit code, ``scontrol show job`` (``JobState``, ``ExitCode``,
``Restarts``) and the job's output file.

* The real training jobs run the real launch script with torchrun, 2 processes on the node
  (DP=2), training ``megatron_ext/cpu/run.py`` (the real Megatron loop on CPU) on the tiny model.
* Preemption (requeue and exact resume) and the spike drill run under the same launch script
  on two nodes (``test_multinode.py``); the Bridge tier's drill is a single-node job of it
  (``tests/bridge/test_bridge_drill.py``).
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

TRAIN_ITERS = 20
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
    """One normal training job, start to finish."""
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
