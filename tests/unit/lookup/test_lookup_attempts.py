"""Which attempts trained an iteration and what became of it, judged from the layout history
and a sample log written by the real writer (one ``SampleLog`` per attempt, as each launch
opens one): a rollback that skipped the onset, then a second rollback that trained it again.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from megatron_ext.common.files import LAYOUT_FILE
from megatron_ext.common.records.sample_log import (
    LAYOUT_FIELDS,
    SampleLog,
    SampleRecord,
    append_layout,
    layout_record,
)
from megatron_ext.lookup.errors import ConfigError, NotTrained
from megatron_ext.lookup.history import History, Segment, attempts_at, log_segments

LAYOUT = {"data_parallel_size": 1, "micro_batch_size": 2, "global_batch_size": 2}


def _segment(first: int, skips: range = range(0)) -> Segment:
    return Segment(
        first, 2 * (first - 1), LAYOUT, frozenset(skips), {}, f"line {first}", time.time()
    )


def _train(directory: Path, iterations: range, skips: range = range(0)) -> None:
    log = SampleLog(directory, 0, job_id="job")
    for k in iterations:
        if k not in skips:
            log.write(SampleRecord(k, 0, 0, [2 * k - 2, 2 * k - 1], ["0" * 40] * 2, 1.0, 8))


def _fates(history: History, iteration: int, directory: Path | None) -> list[tuple]:
    found = attempts_at(history, iteration, None if directory is None else str(directory), 0)
    return [(a.number, a.trained, a.fate) for a in found.at]


def test_rolled_back_skipped_and_retrained_iterations_are_told_apart(tmp_path: Path) -> None:
    # attempt 1: 1..35 (spike at 32); attempt 2: from 26, skipping 26-37, to 40;
    # attempt 3: rolled back again to 30 with no skips, to 45.
    segments = [_segment(1)]
    _train(tmp_path, range(1, 36))
    segments.append(_segment(26, range(26, 38)))
    _train(tmp_path, range(26, 41), range(26, 38))
    segments.append(_segment(31))
    _train(tmp_path, range(31, 46))
    history = History(tuple(segments), (), None, {})
    rolled_back = "trained it; rolled back (attempt 2 resumed from iteration 25)"
    assert _fates(history, 28, tmp_path) == [
        (1, True, f"{rolled_back}, skipped afterwards by attempt 2"),
        (2, False, "skipped it (--iterations-to-skip)"),
    ]
    found = attempts_at(history, 28, str(tmp_path), 0)
    assert found.answer(None).number == 1  # what was trained there, not the skip
    assert found.answer(2).number == 2
    with pytest.raises(Exception, match="--attempt 3: the attempts that started"):
        found.answer(3)
    assert _fates(history, 32, tmp_path) == [
        (1, True, f"{rolled_back}, trained again by attempt 3"),
        (2, False, "skipped it (--iterations-to-skip)"),
        (3, True, "trained it; no checkpoint holds it yet (newest: None)"),
    ]
    assert attempts_at(history, 32, str(tmp_path), 0).answer(None).number == 3
    # 39: attempt 1 never got there (its records end at 35): no answer of it.
    assert [n for n, *_ in _fates(history, 39, tmp_path)] == [2, 3]
    with pytest.raises(
        NotTrained, match=r"iteration 46 is not yet trained: .* ends at iteration 45"
    ):
        attempts_at(history, 46, str(tmp_path), 0)
    # No sample log: attempts that were rolled back may have trained it; none chosen blindly.
    blind = attempts_at(history, 32, None, 0)
    assert [a.trained for a in blind.at] == [False, False, True]
    assert blind.at[0].fate.startswith("may have trained it before attempt 2")
    assert blind.answer(None).number == 3 and blind.caveat is not None


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="needs Linux /proc/self/io")
def test_judging_the_attempts_reads_only_the_asked_iteration(tmp_path: Path) -> None:
    """The evidence is one rank's records of the iteration: a few reads per attempt, not the
    file (a rank's log of a long run is hundreds of MB)."""
    from tests.support.io_counters import rchar
    from tests.unit.sample_log.test_sample_log_reader import _restarted_log

    path = _restarted_log(tmp_path, 0, length=3000)
    history = History((_segment(1), _segment(41)), (), None, {})
    attempts_at(history, 45, str(tmp_path), 0)  # once first: lazy imports read .py files too
    before = rchar()
    found = attempts_at(history, 45, str(tmp_path), 0)
    used = rchar() - before
    assert [a.number for a in found.at] == [1, 2] and found.answer(None).number == 2
    assert used < 64 << 10 < path.stat().st_size / 20, (used, path.stat().st_size)


def test_a_layout_line_without_its_sizes_is_refused_naming_the_line(tmp_path: Path) -> None:
    """A layout-log line whose DP/batch/parallel sizes are null or not numbers (an edited or
    foreign line) is refused where it is read, naming file and line, not a TypeError from deep
    inside the schedule when an iteration of its stretch is asked."""
    sizes = dict.fromkeys(LAYOUT_FIELDS[:6], 1) | {"global_batch_size": 2}
    args = argparse.Namespace(
        iteration=0, consumed_train_samples=0, iterations_to_skip=None, **sizes
    )
    append_layout(tmp_path, layout_record(args, "job", time.time()))
    assert log_segments(tmp_path / LAYOUT_FILE)[0].layout["global_batch_size"] == 2
    for name, value in (("data_parallel_size", None), ("micro_batch_size", "two")):
        append_layout(
            tmp_path,
            layout_record(argparse.Namespace(**{**vars(args), name: value}), "job", time.time()),
        )
        with pytest.raises(ConfigError, match=rf"{LAYOUT_FILE} line 2 is not a layout record"):
            log_segments(tmp_path / LAYOUT_FILE)
        lines = (tmp_path / LAYOUT_FILE).read_text().splitlines(keepends=True)
        (tmp_path / LAYOUT_FILE).write_text(lines[0])
