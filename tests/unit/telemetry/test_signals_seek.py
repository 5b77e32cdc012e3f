"""Seeking into the signals log (planner, detector prime): the same records as a full scan,
from a small fraction of the file, across restarts, torn and foreign lines."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from megatron_ext.common.records.signals import (
    BLOCK,
    OrderError,
    SignalRecord,
    SignalsLog,
    SignalsWriter,
    history_before,
    latest_per_iteration,
    next_attempt,
    read_signals,
    read_window,
)
from tests.support.io_counters import PROC_IO, rchar
from tests.support.spike_curves import records as _records


def _write(path: Path, records: list[SignalRecord]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the writer's own read of a torn log
        writer = SignalsWriter(path.parent)
    for record in records:
        writer.write(record)


def restarted_log(directory: Path, length: int = 400) -> Path:
    """Attempt 1 trains 1..length and is killed mid-line; attempt 2 resumes at length/2 and
    crashes 100 iterations later; attempt 3 resumes at 3/4 of the way (a foreign line from
    another tool in the middle) and trains to 1.5 x length."""
    path = directory / "signals.jsonl"
    _write(path, _records(length, seed=1))
    with open(path, "a") as handle:
        handle.write(f'{{"iteration":{length + 1},"attempt":1,"job_id":"j","wall')
    half, three_quarters = length // 2, 3 * length // 4
    _write(path, _records(half + 100, seed=2)[half - 1 :])
    third = _records(3 * length // 2, seed=3)[three_quarters - 1 :]
    _write(path, third[:50])
    with open(path, "a") as handle:
        handle.write('{"step": 7, "note": "another tool"}\n')
    _write(path, third[50:])  # a fourth attempt: the writer counts the foreign line as a stop
    return path


def _old(path: Path, first: int, last: int) -> list[SignalRecord]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return read_signals(path, iterations=(first, last))


def _same(new: list[SignalRecord], old: list[SignalRecord]) -> bool:
    return [r.as_json() for r in latest_per_iteration(new)] == [
        r.as_json() for r in latest_per_iteration(old)
    ] and len({(r.attempt, r.iteration) for r in new}) == len(new)


@pytest.mark.parametrize(
    "first,last",
    [(-50, 10), (1, 1), (150, 260), (199, 201), (290, 310), (395, 405), (500, 700), (601, 900)],
)
def test_a_window_holds_what_a_full_scan_finds(tmp_path: Path, first: int, last: int) -> None:
    path = restarted_log(tmp_path)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with SignalsLog(path) as log:
            assert [s.attempt for s in log.segments()] == [1, 2, 3, 4]
            assert [(s.first_iteration, s.last_iteration) for s in log.segments()] == [
                (1, 401),  # the torn line's key is whole
                (200, 300),
                (300, 349),
                (350, 600),
            ]
            got = log.window(first, last)
    assert _same(got, _old(path, first, last))
    assert {(r.attempt, r.iteration) for r in got} == {
        (r.attempt, r.iteration) for r in _old(path, first, last)
    }


def test_torn_and_foreign_lines_inside_the_window_are_reported(tmp_path: Path) -> None:
    path = restarted_log(tmp_path)
    with pytest.warns(UserWarning, match=r"1 torn.*byte \d+ \(torn\)"):
        read_window(path, 395, 405)
    with pytest.warns(UserWarning, match=r"not signals records.*unknown fields \['note', 'step'\]"):
        read_window(path, 345, 352)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report outside them: never read
        read_window(path, 100, 120)


def test_a_window_reads_a_small_fraction_of_a_long_log(tmp_path: Path) -> None:
    path = tmp_path / "signals.jsonl"
    _write(path, _records(20_000))
    _write(path, _records(20_100)[19_900:])  # a restart 100 iterations back
    with SignalsLog(path) as log:
        got = log.window(19_950, 20_000)
        stretch = range(19_950, 20_001)
        assert [(r.attempt, r.iteration) for r in got] == [(a, i) for a in (1, 2) for i in stretch]
        # A full scan reads the whole file; the seek reads the window and a few probes.
        assert log.lines_parsed == 102
        assert log.bytes_read < path.stat().st_size / 20
        history = log.history(2, 19_901, 120)
    assert [(r.attempt, r.iteration) for r in history] == [(1, i) for i in range(19_781, 19_901)]


@pytest.mark.skipif(not PROC_IO.is_file(), reason="needs Linux /proc/self/io")
def test_a_restart_s_start_up_reads_a_small_fraction_of_a_long_log(tmp_path: Path) -> None:
    """The writer's attempt number and the detector's prime, what a training start-up after a
    restart reads, come from seeking: each used to read the whole log (1 M iterations: ~550
    MiB into GiBs of records, twice)."""
    path = tmp_path / "signals.jsonl"
    _write(path, _records(20_000))
    _write(path, _records(20_100)[19_900:])  # a restart 100 iterations back
    next_attempt(path)  # once first: lazy imports read .py files too
    before = rchar()
    assert next_attempt(path) == 3
    history = history_before(path, 19_951, 120)
    read = rchar() - before
    expected = latest_per_iteration(_old(path, 1, 19_950))[-120:]
    assert [r.as_json() for r in history] == [r.as_json() for r in expected]
    # Bounded by the seek's block, whatever the log's length (a full read: all of it).
    assert read < BLOCK < path.stat().st_size / 8, (read, path.stat().st_size)


def test_history_is_what_the_tracker_primed_from(tmp_path: Path) -> None:
    """The tracker's prime read the latest attempt per iteration before the restart."""
    path = restarted_log(tmp_path)
    everything = _old(path, 0, 10**9)
    for attempt, first in ((2, 200), (3, 300), (4, 350)):
        earlier = latest_per_iteration([r for r in everything if r.attempt < attempt])
        expected = [r for r in earlier if r.iteration < first][-40:]
        with warnings.catch_warnings(record=True), SignalsLog(path) as log:
            got = log.history(attempt, first, 40)
        assert [r.as_json() for r in got] == [r.as_json() for r in expected]


def test_a_log_out_of_the_writer_s_order_falls_back_to_a_full_scan(tmp_path: Path) -> None:
    path = tmp_path / "signals.jsonl"
    lines = [json.dumps(r.as_json(), separators=(",", ":")) for r in _records(30)]
    path.write_text("\n".join(lines[15:] + lines[:15]) + "\n")  # two halves swapped
    with pytest.raises(OrderError), SignalsLog(path) as log:
        log.window(1, 30)
    with pytest.warns(UserWarning, match="reading the whole log instead"):
        assert [r.iteration for r in read_window(path, 10, 12)] == [10, 11, 12]
    with pytest.warns(UserWarning, match="reading the whole log for its attempts"):
        assert next_attempt(path) == 2
    with pytest.warns(UserWarning, match="reading the whole log instead"):
        assert [r.iteration for r in history_before(path, 13, 3)] == [10, 11, 12]
