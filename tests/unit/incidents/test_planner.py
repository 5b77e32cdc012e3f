"""The rollback + skip planner, skip lists (ranges, files, the list kept with the
checkpoints) and Megatron's own tracker parser agreeing with the confirm policy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.common.records.skip_ranges import format_ranges, parse_range, resolve_argv
from megatron_ext.incidents.planner import PlanConfig, PlanError, make_plan, tracker_lines
from tests.support.checkpoints import write_loadable_checkpoint
from tests.support.harness import run_skiplist
from tests.support.spike_curves import events as _events
from tests.support.spike_curves import records as _records


def _ledger(records: list[SignalRecord]) -> list[dict]:
    return [e.as_json() for e in _events(records)]


STUCK = {i: (5.0, 6.0 if i == 150 else 1.0) for i in range(150, 200)}


def test_plan_rolls_back_k_before_onset_and_skips_a_window_reaching_past_it() -> None:
    records = _records(200, STUCK)
    plan = make_plan(
        _ledger(records),
        records,
        [50, 100, 140, 150],
        [20, 21],
        PlanConfig(rollback_iters=40, skip_batches=60),
        1000,
        "/ckpt",
    )
    assert plan.rollback_to == 100 and plan.moved_checkpoints == [140, 150]
    assert plan.skip_window == [101, 160] and plan.skip_ranges == [[20, 21], [101, 160]]
    assert plan.restart_args == ["--load", "/ckpt", "--iterations-to-skip", "20-21", "101-160"]
    assert "Roll back to checkpoint 100, skip iterations 101-160" in plan.summary
    loss, baseline = plan.incident["loss"], plan.incident["loss_baseline"]
    assert f"loss {loss:.4g} vs baseline {baseline:.4g}" in plan.summary  # rounded for people
    assert plan.as_json()["incident"]["loss"] == loss  # the JSON keeps full precision


def test_skiplist_help_shows_the_defaults() -> None:
    from megatron_ext.incidents.cli import build_parser

    options = " ".join(build_parser().format_help().split("options:", 1)[1].split())
    for flag, default in (("--rollback-iters", 100), ("--skip-batches", 300), ("--policy", "skip")):
        described = options.split(f" {flag} ", 1)[1].split(" --", 1)[0]
        assert f"(default: {default})" in described, (flag, described)


def test_onset_moves_earlier_when_the_grad_norm_rose_first() -> None:
    records = _records(200, {**STUCK, 147: (3.0, 2.5), 148: (3.0, 2.6), 149: (3.0, 2.4)})
    ledger = _ledger(records)
    plan = make_plan(
        ledger, records, [100, 110], [], PlanConfig(rollback_iters=38, skip_batches=60), None, "/c"
    )
    assert plan.onset == 147 and plan.rollback_to == 100  # 147 - 38 = 109 < 110


def test_beta2_window_and_impossible_plans() -> None:
    records = _records(200, STUCK)
    ledger = _ledger(records)
    plan = make_plan(
        ledger, records, [100], [], PlanConfig(rollback_iters=10, beta2=0.95), None, "/c"
    )
    assert plan.skip_window == [101, 300]  # 10 time constants of beta2=0.95
    with pytest.raises(PlanError, match=r"no complete checkpoint at or before iteration 140"):
        make_plan(ledger, records, [145, 150], [], PlanConfig(rollback_iters=10), None, "/c")
    with pytest.raises(PlanError, match="runs past --train-iters 250"):
        make_plan(
            ledger, records, [100], [], PlanConfig(rollback_iters=10, skip_batches=300), 250, "/c"
        )
    with pytest.raises(PlanError, match="does not reach the incident at iteration 155"):
        make_plan(
            ledger, records, [100], [], PlanConfig(rollback_iters=10, skip_batches=20), None, "/c"
        )
    with pytest.raises(PlanError, match="no rollback request"):
        make_plan(
            _ledger(_records(80, {50: (5.0, 6.0)})), records, [10], [], PlanConfig(), None, "/c"
        )


def test_confirm_policy_replays_first_then_skips_and_megatron_agrees(tmp_path: Path) -> None:
    first = _ledger(_records(200, STUCK, attempt=1))
    replay = make_plan(
        first, [], [100], [], PlanConfig(rollback_iters=10, policy="confirm"), None, "/c"
    )
    assert replay.action == "rollback-and-replay" and replay.skip_window is None
    assert replay.tracker_lines == []
    both = first + _ledger(_records(200, STUCK, attempt=2))
    confirmed = make_plan(
        both,
        [],
        [100],
        [],
        PlanConfig(rollback_iters=10, policy="confirm", skip_batches=60),
        None,
        "/c",
    )
    assert confirmed.action == "rollback-and-skip" and len(confirmed.tracker_lines) == 2
    tracker = tmp_path / "tracker.txt"
    other_tool = (
        "ts=2026-01-01 node=n1 device=0 jobID=7 rank=3 iteration=99 "
        "status=RerunValidationStatus.RERUN_DISABLED result=nan message='x'\n"
    )
    tracker.write_text(
        other_tool + "garbage line from another tool\n" + "".join(confirmed.tracker_lines)
    )
    from megatron.core.rerun_state_machine import RerunStateMachine

    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(str(tracker)) == [150]
    assert tracker_lines(confirmed.incident, both)[0].startswith("ts=megatron-ext ")


def test_ranges_files_and_persisted_lists(tmp_path: Path) -> None:
    assert parse_range("137000-137003") == (137000, 137003)
    with pytest.raises(ValueError, match="bad range '9-3'"):
        parse_range("9-3")
    skip_file = tmp_path / "skip.txt"
    skip_file.write_text("# incident 1\n10-12\n\n20\n")
    argv, sources = resolve_argv(
        [
            "--lr",
            "1",
            "--iterations-to-skip",
            "5",
            "7-8",
            "--iterations-to-skip-file",
            str(skip_file),
            "--seed",
            "3",
        ]
    )
    assert sources.union() == [5, 7, 8, 10, 11, 12, 20]
    assert argv == ["--lr", "1", "--seed", "3", "--iterations-to-skip", *map(str, sources.union())]
    (tmp_path / "megatron_ext_skipped_iterations.txt").write_text("30-31\n")
    argv, sources = resolve_argv(["--load", str(tmp_path), "--iterations-to-skip", "5"])
    assert argv[-4:] == ["--iterations-to-skip", "5", "30", "31"]
    assert format_ranges([3, 1, 2, 7]) == "1-3\n7\n"
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nx-3\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: bad iteration or range 'x-3'"):
        resolve_argv(["--iterations-to-skip-file", str(bad)])


def test_entry_point_merges_the_list_persisted_with_the_loaded_checkpoints(tmp_path: Path) -> None:
    from megatron_ext.fork.start import prepare_skips

    (tmp_path / "megatron_ext_skipped_iterations.txt").write_text("5-6\n")
    for load in (["--load", str(tmp_path)], [f"--load={tmp_path}"]):
        argv = prepare_skips([*load, "--iterations-to-skip", "9-10"])
        assert argv == [*load, "--iterations-to-skip", "5", "6", "9", "10"]
    with pytest.raises(SystemExit, match="bad range"):
        prepare_skips(["--iterations-to-skip", "10-9"])


def test_planner_merges_applied_skips_but_not_an_unapplied_earlier_plan(tmp_path: Path) -> None:
    from megatron_ext.common.io import JsonlAppender

    signals, ckpt = tmp_path / "signals", tmp_path / "ckpt"
    records = _records(200, STUCK)
    writer, ledger = (
        JsonlAppender(signals / "signals.jsonl"),
        JsonlAppender(signals / "spikes.jsonl"),
    )
    for record in records:
        writer.append(record.as_json())
    for event in _events(records):
        ledger.append(event.as_json())
    for iteration in (100, 140):
        write_loadable_checkpoint(ckpt / f"iter_{iteration:07d}")
    (ckpt / "megatron_ext_skipped_iterations.txt").write_text("20-21\n")  # applied earlier
    common = ["--no-lookup", "--train-iters", "1000", "--skip-batches", "60"]
    first = run_skiplist(tmp_path, *common, "--rollback-iters", "40")  # planned, not applied
    assert first.returncode == 0 and "skip iterations 101-160" in first.stdout, first.stderr
    second = run_skiplist(tmp_path, *common, "--rollback-iters", "10")
    assert second.returncode == 0, second.stderr
    assert "all skipped iterations: 20-21, 141-200." in second.stdout
    # The same rollback request re-planned keeps its incident number.
    assert not (ckpt / "megatron_ext_incidents" / "incident-002.json").exists()
    plan = json.loads((ckpt / "megatron_ext_incidents" / "incident-001.json").read_text())
    assert plan["skip_ranges"] == [[20, 21], [141, 200]]


def test_rollback_iters_below_one_is_refused() -> None:
    """A target at or after the onset keeps the bad update and never skips the onset's batch."""
    records = _records(200, STUCK)
    for bad in (0, -5):
        with pytest.raises(PlanError, match=rf"--rollback-iters {bad}: must be >= 1"):
            make_plan(
                _ledger(records), records, [100, 150, 155], [], PlanConfig(bad, 60), 1000, "/c"
            )


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"attempt": "2"}, "has attempt='2', not a whole number"),
        ({"attempt": [1]}, "has attempt=[1], not a whole number"),
        ({"culprit_dp_rank": "x"}, "has culprit_dp_rank='x', not a whole number"),
        ({"culprit_dp_rank": 1.5}, "has culprit_dp_rank=1.5, not a whole number"),
        ({"onset": 170}, "has onset=170 after its iteration 155"),
    ],
)
def test_a_hand_edited_rollback_record_is_refused(edit: dict, words: str) -> None:
    records = _records(200, STUCK)
    ledger = _ledger(records)
    ledger[-1] = {**ledger[-1], **edit}
    with pytest.raises(PlanError, match=re.escape(words)):
        make_plan(ledger, records, [100], [], PlanConfig(10, 60), 1000, "/c")
