"""Skip windows kept in samples: placed at the global batch in force at a resume, the part of
a skip list the loaded checkpoint already trained, and the one-line refusal of a changed
global batch Megatron's LR scheduler would assert on."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.common.records.skip_ranges import (
    WINDOWS_BATCH_FLAG,
    WINDOWS_FLAG,
    SkipSources,
    format_windows,
    parse_window,
    persisted_text,
    read_windows,
    resolve_argv,
)
from megatron_ext.common.records.skip_windows import ResumePoint, Window, check_batch_change, place
from megatron_ext.incidents.planner import PlanConfig, make_plan
from tests.support.spike_curves import events, records

WINDOW = Window(9, 12, (64, 95))  # iterations 9-12 at global batch 8, after checkpoint 8
AT_8 = ResumePoint(iteration=8, consumed=64, global_batch=8, skipped=frozenset())


def test_a_window_is_placed_exactly_when_the_new_batch_divides_it() -> None:
    assert place(WINDOW, AT_8, 8) == ([WINDOW], "")
    placed, note = place(WINDOW, AT_8, 4)
    assert placed == [Window(9, 16, (64, 95))]
    assert note == (
        "skip window of samples 64-95 (planned as iterations 9-12) is iterations 9-16 at "
        "global batch 4"
    )
    placed, note = place(WINDOW, AT_8, 16)
    assert placed == [Window(9, 10, (64, 95))] and "outside" not in note


def test_a_window_that_is_not_whole_batches_skips_the_covering_iterations_and_says_so() -> None:
    placed, note = place(WINDOW, AT_8, 5)  # 32 samples: 6 batches and 2 samples
    assert placed == [Window(9, 15, (64, 95))]
    assert note.endswith(
        "iterations 9-15 at global batch 5; they hold samples 64-98: the 3 sample(s) outside "
        "the window are skipped too (it is not a whole number of batches of 5)"
    )
    off_grid = ResumePoint(8, 60, 6, frozenset())  # consumed 60: the window starts mid-batch
    placed, note = place(WINDOW, off_grid, 8)
    assert placed == [Window(9, 13, (64, 95))]
    assert "they hold samples 60-99: the 8 sample(s) outside" in note


def test_consumed_and_straddled_windows() -> None:
    past = ResumePoint(20, 160, 8, frozenset(range(9, 13)))
    assert place(WINDOW, past, 4) == ([WINDOW], "")  # history: stays as it was skipped
    inside = ResumePoint(10, 80, 8, frozenset({9, 10}))
    placed, note = place(WINDOW, inside, 4)
    assert placed == [Window(9, 10), Window(11, 14, (80, 95))]
    assert "samples 80-95 (planned as iterations 9-12) is iterations 11-14" in note


def test_the_part_of_a_list_the_checkpoint_trained_is_named_and_left_out() -> None:
    sources = SkipSources(global_batch=8)
    resume = ResumePoint(37, 296, 8, frozenset({31}))  # 31 was skipped by the run
    kept = sources.settle("--iterations-to-skip-file F", [Window(30, 45)], None, resume)
    assert kept == [31, *range(38, 46)]
    assert sources.notes == [
        "megatron-ext: --iterations-to-skip-file F: 30, 32-37 already trained (resuming at 38): "
        "not skipped; 38-45 will be skipped"
    ]
    sources = SkipSources(global_batch=8)
    assert sources.settle("L", [Window(3, 5)], None, resume) == []
    assert sources.notes[0].endswith(
        "3-5 already trained (resuming at 38): not skipped; none of it lies ahead"
    )
    assert sources.describe().endswith("megatron-ext: skipping no iterations")


def test_window_lines_round_trip_and_bad_lines_are_named(tmp_path: Path) -> None:
    text = format_windows([Window(3, 4), Window(9, 12, (64, 95)), Window(10, 11), Window(20, 20)])
    assert text.splitlines()[1:] == ["3-4", "9-12 samples 64-95", "20"]
    assert text.startswith("# A-B samples S-T")
    path = tmp_path / "skips.txt"
    path.write_text(text)
    assert read_windows(path) == [Window(3, 4), Window(9, 12, (64, 95)), Window(20, 20)]
    assert format_windows([Window(1, 3), Window(7, 7)]) == "1-3\n7\n"  # as before: no header
    assert persisted_text([5, 9, 10], ["9-16:64-95"]).splitlines()[1:] == [
        "5",
        "9-16 samples 64-95",
    ]
    for bad, message in (
        ("9-12 samples 95-64", "bad sample range '95-64'"),
        ("9-12 sample 64-95", "bad skip-list item"),
        ("9-12 samples x", "bad sample range 'x'"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_window(bad, "F:1: ")


def test_a_changed_global_batch_is_refused_unless_a_schedule_is_chosen() -> None:
    argv = ["--train-iters", "100", "--global-batch-size", "4"]
    with pytest.raises(ValueError, match=r"--global-batch-size 4 differs from the 8 of the "):
        check_batch_change(argv, AT_8, 4)
    for chosen in (
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
        "--no-load-optim",
        "--finetune",
    ):
        check_batch_change([*argv, chosen], AT_8, 4)
    check_batch_change(["--train-samples", "800"], AT_8, 4)  # a schedule in samples: unchanged
    check_batch_change(argv, AT_8, 8)
    check_batch_change(argv, None, 4)  # the checkpoint could not be read: Megatron says


def test_the_plan_records_the_window_in_samples_at_its_global_batch() -> None:
    curve = records(200, {i: (5.0, 6.0 if i == 150 else 1.0) for i in range(150, 200)})
    ledger = [e.as_json() for e in events(curve)]
    plan = make_plan(
        ledger,
        curve,
        [50, 100, 140],
        [],
        PlanConfig(rollback_iters=40, skip_batches=60),
        1000,
        "/ckpt",
        lambda checkpoint: (checkpoint * 8, 8),
    )
    assert plan.skip_window == [101, 160]
    assert plan.global_batch_size == 8 and plan.skip_samples == [800, 1279]
    assert "skip iterations 101-160 (samples 800-1279 at global batch 8)" in plan.summary
    unknown = make_plan(
        ledger, curve, [100], [], PlanConfig(rollback_iters=40, skip_batches=60), 1000, "/c"
    )
    assert unknown.skip_samples is None and unknown.global_batch_size is None


def test_start_up_places_windows_from_the_checkpoint_it_can_read(tmp_path: Path) -> None:
    (tmp_path / "megatron_ext_skipped_iterations.txt").write_text("9-12 samples 64-95\n")
    argv = ["--load", str(tmp_path), "--global-batch-size", "4"]
    megatron_argv, sources = resolve_argv(argv)  # no tracker: a fresh start, from sample 0
    assert sources.union() == list(range(17, 25))
    assert megatron_argv[-4:] == [WINDOWS_FLAG, "17-24:64-95", WINDOWS_BATCH_FLAG, "4"]
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8\n")
    (tmp_path / "iter_0000008").mkdir()
    (tmp_path / "iter_0000008" / "metadata.json").write_text("{}")  # not readable here
    megatron_argv, sources = resolve_argv(argv)
    assert sources.union() == list(range(9, 13))
    assert "the skip windows kept in samples stay at the iterations they were planned at" in (
        sources.describe()
    )
