"""A hung rank under the real single-node launcher (supervisor, torchrun, CPU ranks): the
forward sleeps for an hour at iteration 12, injected from outside the project
(tests/support/incidents.py). The watchdog's bound here is 5x the slowest recent step, at
least ``MIN_TIMEOUT`` seconds (the default floor is 120 s; the tiny model steps in ~0.1 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.common import exit_codes
from megatron_ext.common.files import INCIDENTS_DIR
from tests.support import incidents
from tests.support.faults import fault

pytestmark = pytest.mark.e2e

MIN_TIMEOUT = 3.0
HANG = ["--save-interval", "5", "--hang-min-timeout", str(MIN_TIMEOUT)]
HUNG_AT = 12


def _reports(work: Path) -> list[dict]:
    folder = work / "ckpt" / INCIDENTS_DIR
    return [json.loads(p.read_text()) for p in sorted(folder.glob("hang-*.json"))]


def _assert_reported(report: dict, hung_rank: int, world: int) -> None:
    """The hung rank first, named, stuck in the injected sleep; every rank's stacks."""
    assert report["iteration"] == HUNG_AT and report["hung_ranks"] == [hung_rank], report
    assert "sitecustomize.py" in report["where"] and "in injected" in report["where"]
    ranks = report["ranks"]
    assert ranks[0]["rank"] == hung_rank and len(ranks) == world
    assert "time.sleep(3600)  # injected hang" in "".join(ranks[0]["stacks"]["MainThread"])
    # Detected within its bound: past it, and at most a poll or two later (the rank that
    # fired first; the others dumped when it asked).
    detector = next(r for r in ranks if r["rank"] == r["detected_by"])
    assert MIN_TIMEOUT <= detector["bound_s"] <= detector["stalled_s"] <= detector["bound_s"] + 2
    for peer in ranks[1:]:  # the peers wait in a collective for the hung rank
        assert any("torch/distributed" in f for f in peer["stacks"]["MainThread"]), peer


def _hang_once(work: Path, data_args: list[str], rank: int, world: int) -> incidents.LauncherRun:
    """``rank`` of ``world`` hangs at HUNG_AT once: one report, then the job completes."""
    knobs = {"GPUS_PER_NODE": str(world)} | ({"INJECT_HANG_RANK": "1"} if world > 1 else {})
    run = incidents.run(
        work, data_args, HANG, 20, INJECT_HANG_AT=str(HUNG_AT), INJECT_HANG_ONCE="1", **knobs
    )
    assert run.returncode == 0, run.output[-5000:]
    (report,) = _reports(work)
    _assert_reported(report, hung_rank=rank, world=world)
    trained = incidents.trained(work)
    assert max(trained[1]) == HUNG_AT - 1 and min(trained[2]) == 11 and max(trained[2]) == 20
    assert incidents.wait_for_no_survivors(run.marker) == []
    return run


@fault(
    "rank 1 of 2 stops making progress at iteration 12 (its forward sleeps for an hour, once); "
    "before, the peer waited for the 10-minute collective timeout and the job stopped as a "
    "crash with no stack",
    "the watchdog fires ~3 s after the hang (bound: 5x the slowest step, floor "
    "--hang-min-timeout); both ranks dump their stacks, rank 1 first and named as hung in the "
    "log and hang-*.md; exit 43; relaunch from checkpoint 10; the job ends at --train-iters",
    area="hangs",
)
def test_a_rank_that_hangs_once_is_restarted_with_every_stack(data_args, tmp_path) -> None:
    run = _hang_once(tmp_path, data_args, rank=1, world=2)
    lines = "\n".join(run.supervisor_lines())
    assert f"hang at iteration {HUNG_AT}: rank 1 made no progress" in lines
    assert "relaunching in place from the last checkpoint" in lines
    assert "training finished successfully (reached its last iteration)" in lines
    assert f"exiting {exit_codes.HUNG}" in run.output


@fault(
    "the only rank stops making progress at iteration 12, once (no collective waits on it: "
    "before, nothing would ever have ended it)",
    "the watchdog fires within its bound, dumps the rank's stacks, exits 43; relaunch from "
    "checkpoint 10; the job ends at --train-iters",
    area="hangs",
)
def test_a_single_rank_hang_is_caught_without_a_collective(data_args, tmp_path) -> None:
    _hang_once(tmp_path, data_args, rank=0, world=1)


@fault(
    "rank 1 hangs at iteration 12 on every attempt (before: the job hung again after each "
    "restart, forever)",
    "one restart; the second hang at the same iteration and place is said to repeat and the "
    "job stops with 43, the stacks in both reports; no process left",
    area="hangs",
)
def test_a_hang_that_repeats_stops_the_job(data_args, tmp_path) -> None:
    run = incidents.run(
        tmp_path, data_args, HANG, 20, INJECT_HANG_AT=str(HUNG_AT), INJECT_HANG_RANK="1"
    )
    assert run.returncode == exit_codes.HUNG, run.output[-5000:]
    reports = _reports(tmp_path)
    assert len(reports) == 2
    for report in reports:
        _assert_reported(report, hung_rank=1, world=2)
    lines = "\n".join(run.supervisor_lines())
    assert lines.count("relaunching in place") == 1
    assert "the same hang as the previous attempt (same iteration, same place)" in lines
    markdown = sorted((tmp_path / "ckpt" / INCIDENTS_DIR).glob("hang-*.md"))[-1].read_text()
    assert "- repeat of the previous attempt's hang: yes" in markdown
    assert incidents.wait_for_no_survivors(run.marker) == []
