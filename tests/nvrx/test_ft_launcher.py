"""nvidia-resiliency-ext's real ``ft_launcher`` (0.6.0) with in-job restarts, as nvrx users run
it (no megatron-ext supervisor): it restarts the training in place, with the same arguments,
after any non-zero exit.

- The spike drill (DP rank 1's batches corrupted at 32-36): the detector exits 42; the
  restarted rank 0 applies the pending rollback request before it loads
  (``megatron_ext.incidents.pending``), so the job ends at ``--train-iters`` after exactly one
  rollback (before: three replays of the spike from checkpoint 35, then exit 1).
- A hung rank (rank 1's forward sleeps at iteration 12, first cycle only): megatron-ext's
  watchdog (``--hang-detect``) dumps every rank's stacks and writes the report, exits 43;
  ft_launcher restarts from checkpoint 10 and the job ends at ``--train-iters``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from megatron_ext.common.files import SKIPPED_ITERATIONS_FILE
from tests.support.drill import BAD, TRAIN_ITERS, drill_args
from tests.support.faults import fault
from tests.support.harness import launch
from tests.support.incidents import injected, trained

FT_LAUNCHER = (
    sys.executable,
    "-c",
    "import sys; from nvidia_resiliency_ext.fault_tolerance.launcher import main; sys.exit(main())",
    "--standalone",
    "--max-restarts",
    "2",
    "--monitor-interval",
    "0.3",
)


def _hang_args(work: Path, data_args: list[str]) -> list[str]:
    """Checkpoints every 5 and the watchdog on (its floor at 3 s: the tiny model steps fast)."""
    ckpt = str(work / "ckpt")
    return [
        *data_args,
        *("--save", ckpt, "--load", ckpt, "--save-interval", "5"),
        *("--signals-dir", str(work / "signals"), "--hang-detect", "--hang-min-timeout", "3"),
    ]


def _restarts(count: int) -> tuple[str, ...]:
    launcher = [*FT_LAUNCHER]
    launcher[launcher.index("--max-restarts") + 1] = str(count)
    return tuple(launcher)


@fault(
    "the spike drill (DP rank 1's batches corrupted at 32-36) under nvidia-resiliency-ext's "
    "`ft_launcher --max-restarts 2`, no megatron-ext supervisor (before: ft_launcher restarted "
    "the worker in place three times from checkpoint 35, replaying the spike, then exit 1)",
    "the restarted rank 0 applies the pending rollback request before it loads (once); the "
    "relaunch resumes from 25 with 26-37 skipped and ends at --train-iters, exit 0",
    area="nvidia-resiliency-ext",
)
def test_the_spike_drill_rolls_back_once_under_ft_launcher(tmp_path, data_args) -> None:
    args = drill_args(data_args, tmp_path, f"{BAD[0]}-{BAD[1]}:1", patience=3)
    plan = {"SKIPLIST_ARGS": "--rollback-iters 5 --skip-batches 12"}
    run = launch(tmp_path, args, nproc=2, launcher=FT_LAUNCHER, env=plan)
    assert run.returncode == 0, run.log[-4000:]
    assert run.log.count("applying the pending rollback request") == 1
    lines = (tmp_path / "signals" / "spikes.jsonl").read_text().splitlines()
    ledger = [json.loads(line) for line in lines]
    assert [e["onset"] for e in ledger if e.get("kind") == "rollback"] == [BAD[0]]
    applied = (tmp_path / "ckpt" / "megatron_ext_incidents" / "applied.jsonl").read_text()
    assert [json.loads(line)["skip_window"] for line in applied.splitlines()] == [[26, 37]]
    persisted = (tmp_path / "ckpt" / SKIPPED_ITERATIONS_FILE).read_text().splitlines()
    assert [line.split()[0] for line in persisted if not line.startswith("#")] == ["26-37"]
    by_attempt = trained(tmp_path)
    assert sorted(by_attempt) == [1, 2] and max(by_attempt[2]) == TRAIN_ITERS
    assert min(by_attempt[2]) == 38  # resumed from 25, 26-37 skipped (not logged)


@fault(
    "rank 1 of 2 hangs at iteration 12 (once) under `ft_launcher --max-restarts 2` with "
    "`--hang-detect` (nvrx's own rank timeouts are off by default, and kill without stacks)",
    "the watchdogs dump both ranks' stacks and the report (SIGNALS_DIR/hangs/*/report.md, "
    "rank 1 first) and exit 43; ft_launcher restarts from checkpoint 10; the job ends at "
    "--train-iters",
    area="nvidia-resiliency-ext",
)
def test_a_hung_rank_is_restarted_with_its_stacks_under_ft_launcher(tmp_path, data_args) -> None:
    env = injected(tmp_path, INJECT_HANG_AT="12", INJECT_HANG_RANK="1", INJECT_HANG_ONCE="1")
    run = launch(tmp_path, _hang_args(tmp_path, data_args), nproc=2, launcher=FT_LAUNCHER, env=env)
    assert run.returncode == 0, run.log[-4000:]
    (report,) = (tmp_path / "signals" / "hangs").glob("*/report.json")
    found = json.loads(report.read_text())
    assert found["iteration"] == 12 and found["hung_ranks"] == [1], found
    stack = "".join(found["ranks"][0]["stacks"]["MainThread"])
    assert "time.sleep(3600)  # injected hang" in stack
    assert any("torch/distributed" in f for f in found["ranks"][1]["stacks"]["MainThread"])
    by_attempt = trained(tmp_path)
    assert max(by_attempt[1]) == 11 and min(by_attempt[2]) == 11 and max(by_attempt[2]) == 20


@fault(
    "rank 1 raises in its forward at iteration 12 under `ft_launcher` (no restarts left)",
    "the job ends in seconds, not at the collective timeout; the first traceback in the log "
    "is rank 1's exception, its peer's gloo error after it",
    area="nvidia-resiliency-ext",
)
def test_a_rank_local_exception_fails_fast_and_is_said_first(tmp_path, data_args) -> None:
    """Rank 1 raises in its forward at iteration 12 (no restarts left): the job ends in
    seconds, not at the 10-minute collective timeout, and the first traceback in the log is
    rank 1's own exception, not its peer's collective error."""
    env = injected(tmp_path, INJECT_RAISE_AT="12", INJECT_RAISE_RANK="1")
    started = time.monotonic()
    run = launch(tmp_path, [*data_args], nproc=2, launcher=_restarts(0), env=env)
    assert run.returncode != 0 and time.monotonic() - started < 120, run.log[-3000:]
    first = run.log.index("Traceback")
    assert "injected failure at iteration 12" in run.log[first:].split("Traceback")[1]


@fault(
    "the only rank hangs at iteration 12 on every attempt under `ft_launcher --max-restarts 1` "
    "with `--hang-detect` (no collective waits on it: before, nothing would ever end it)",
    "each attempt's watchdog dumps the stack and exits 43; the second report says it repeats "
    "the first (same iteration and place: a restart will hang again); ft_launcher stops with "
    "its restart budget spent",
    area="nvidia-resiliency-ext",
)
def test_a_single_rank_hang_that_repeats_stops_within_the_budget(tmp_path, data_args) -> None:
    env = injected(tmp_path, INJECT_HANG_AT="12")
    run = launch(tmp_path, _hang_args(tmp_path, data_args), nproc=1, launcher=_restarts(1), env=env)
    assert run.returncode != 0, run.log[-4000:]
    reports = sorted(
        (tmp_path / "signals" / "hangs").glob("*/report.md"), key=lambda p: p.stat().st_mtime
    )
    assert len(reports) == 2
    assert "repeat of the previous attempt's hang: no" in reports[0].read_text()
    assert "repeat of the previous attempt's hang: yes" in reports[1].read_text()
    assert "time.sleep(3600)  # injected hang" in reports[1].read_text()
    assert run.log.count("the same hang as the previous attempt") == 1
