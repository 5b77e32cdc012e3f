"""The hang watchdog's core with a real thread: the bound follows the run's own history, a
stall past it dumps every thread's stack and exits 43 once, a peer's request makes a rank
dump too, and the report names the rank that is not waiting in a collective."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from megatron_ext.common import exit_codes
from megatron_ext.common.records.hangs import HangDump, read_dumps, repeats_previous, report
from megatron_ext.hang.watchdog import Bounds, Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_bound_follows_the_steps_saves_and_a_first_timeout() -> None:
    clock = Clock()
    dog = Watchdog(0, 1, Path("unused"), Bounds(5.0, 1.0, 100.0), clock=clock)
    assert dog.bound() == 100.0  # start-up, whatever the first step does
    for iteration, seconds in enumerate([9.0, 0.2, 0.4, 0.3], start=1):
        clock.now += seconds
        dog.beat("batch read")
        dog.step_end(iteration)
    assert dog.bound() == pytest.approx(5.0 * 0.4)  # the first step (9 s) is start-up's
    dog.beat("save", "save")
    assert dog.bound() == 100.0  # no save seen yet
    clock.now += 3.0
    dog.beat("batch read")  # the save took 3 s
    dog.beat("save", "save")
    assert dog.bound() == pytest.approx(15.0)


def test_durations_carry_over_to_the_next_attempt(tmp_path: Path) -> None:
    clock = Clock()
    dog = Watchdog(0, 1, tmp_path, Bounds(5.0, 0.1, 100.0), clock=clock)
    for iteration in range(1, 5):
        clock.now += 0.5
        dog.step_end(iteration)
    dog.remember(tmp_path / "durations.json")
    again = Watchdog(0, 1, tmp_path, Bounds(5.0, 0.1, 100.0), clock=clock)
    again.recall(tmp_path / "durations.json")
    again.step_end(11)  # the first step after the restart ends start-up
    assert again.bound() == pytest.approx(2.5)


def _run_until_exit(dogs: list[Watchdog], timeout: float = 10.0) -> dict[int, int]:
    exits: dict[int, int] = {}
    done = threading.Event()
    for dog in dogs:
        dog.exit = lambda code, rank=dog.rank: (exits.__setitem__(rank, code), done.set())
        dog.start()
    deadline = time.monotonic() + timeout
    while len(exits) < len(dogs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return exits


def test_a_stall_dumps_every_rank_and_exits_43(tmp_path: Path) -> None:
    bounds = Bounds(5.0, 0.3, 0.3)
    stuck = Watchdog(1, 2, tmp_path, bounds, poll=0.05, grace=2.0)
    busy = Watchdog(0, 2, tmp_path, Bounds(5.0, 60.0, 60.0), poll=0.05, grace=2.0)
    started = time.monotonic()
    exits = _run_until_exit([stuck, busy])
    assert exits == {0: exit_codes.HUNG, 1: exit_codes.HUNG}
    dumps = read_dumps(tmp_path)
    assert [d.rank for d in dumps] == [0, 1] and {d.detected_by for d in dumps} == {1}
    assert 0.3 <= dumps[1].stalled_s < time.monotonic() - started
    assert "MainThread" in dumps[1].stacks and dumps[1].iteration == 1
    # The rank that fired writes the attempt's report (no supervisor needed).
    assert (tmp_path / "report.md").read_text().startswith("# Hang at iteration 1")


def test_a_hang_at_the_same_place_as_the_last_attempt_is_said_to_repeat(tmp_path: Path) -> None:
    reports = []
    for attempt in ("run-0", "run-1"):
        dog = Watchdog(0, 1, tmp_path / attempt, Bounds(5.0, 0.2, 0.2), poll=0.05, grace=0.1)
        assert _run_until_exit([dog]) == {0: exit_codes.HUNG}
        reports.append((tmp_path / attempt / "report.md").read_text())
    assert "repeat of the previous attempt's hang: no" in reports[0]
    assert "repeat of the previous attempt's hang: yes" in reports[1]


def _dump(rank: int, innermost: str, stalled: float = 5.0) -> HangDump:
    frames = ['  File "/x/megatron/core/distributed/distributed_data_parallel.py", line 1, in f\n']
    frames.append(f'  File "{innermost}", line 7, in g\n    wait()\n')
    stacks = {"MainThread": frames}
    return HangDump(rank, 3, "h", 1, 12, "train", "loss", stalled, 3.0, rank, stacks)


def test_the_report_names_the_rank_not_waiting_in_a_collective() -> None:
    c10d = "/v/torch/distributed/distributed_c10d.py"
    found = report([_dump(0, c10d, 9.0), _dump(1, "/data/reader.py"), _dump(2, c10d)])
    assert found is not None and found.hung == (1,) and found.silent == ()
    assert found.where == "/data/reader.py, line 7, in g"
    assert [d.rank for d in found.dumps] == [1, 0, 2]
    # A rank that wrote nothing (stopped, or in the kernel) is the one named.
    silent = report([_dump(0, c10d), _dump(2, c10d)], world_size=3)
    assert silent is not None and silent.hung == (1,) and silent.silent == (1,)
    assert report([]) is None


def test_on_under_the_launchers_unless_nvrx_times_the_sections(monkeypatch, tmp_path) -> None:
    from argparse import Namespace

    from megatron_ext.common.records.hangs import HANG_DIR_ENV
    from megatron_ext.hang.adapter import HangFeature

    def enabled(**flags: object) -> bool:
        return HangFeature().enabled(Namespace(**{"hang_detect": None, **flags}))

    assert not enabled()  # a plain run stays plain Megatron
    monkeypatch.setenv(HANG_DIR_ENV, str(tmp_path))
    assert enabled() and enabled(enable_ft_package=False)
    assert not enabled(enable_ft_package=True)  # Megatron's --enable-ft-package: nvrx's
    assert enabled(enable_ft_package=True, hang_detect=True) and not enabled(hang_detect=False)


def test_a_request_by_rank_0_is_credited_to_rank_0(tmp_path: Path) -> None:
    first = Watchdog(0, 2, tmp_path)
    assert first._ask(5.0) == 0
    assert Watchdog(1, 2, tmp_path)._ask(5.0) == 0  # the exclusive create lost to rank 0


@pytest.mark.parametrize(
    "saved",
    ["[]", "null", '{"train": 5}', '{"train": ["x"]}', '{"train": [null]}', '{"train": [1e999]}'],
)
def test_a_damaged_durations_file_is_ignored_like_a_missing_one(tmp_path: Path, saved: str) -> None:
    """durations.json valid JSON of another shape: the start-up died in an AttributeError or a
    TypeError, and an infinite duration made the bound infinite (the watchdog never fired)."""
    (tmp_path / "durations.json").write_text(saved)
    dog = Watchdog(0, 1, tmp_path, Bounds(5.0, 0.1, 100.0))
    dog.recall(tmp_path / "durations.json")
    dog.step_end(11)
    assert dog.bound() == 100.0  # no history: the first timeout


def test_durations_that_cannot_be_kept_do_not_stop_the_save(tmp_path: Path, capsys) -> None:
    (tmp_path / "durations.json").mkdir()  # in the way: the replace fails
    dog = Watchdog(0, 1, tmp_path)
    dog.remember(tmp_path / "durations.json")
    assert "cannot keep the durations in" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["durations.json"]  # no temporary left


@pytest.mark.parametrize("request_body", ["[1]", '{"rank": null}', '"x"'])
def test_a_damaged_request_still_lets_the_stall_fire(tmp_path: Path, request_body: str) -> None:
    """A request.json of another shape killed the watching thread (a TypeError): the hang went
    on with no stacks and no exit."""
    dog = Watchdog(0, 1, tmp_path, Bounds(5.0, 0.3, 0.3), poll=0.05, grace=0.1)
    (tmp_path / "request.json").write_text(request_body)
    assert _run_until_exit([dog]) == {0: exit_codes.HUNG}


def test_the_rank_exits_43_when_its_folder_is_gone_or_a_report_is_damaged(
    tmp_path: Path,
) -> None:
    """The attempt's folder removed under the watchdog (FileNotFoundError on the request) or
    an earlier attempt's report.json damaged (AttributeError): the thread died, no exit."""
    gone = Watchdog(0, 1, tmp_path / "run-1", Bounds(5.0, 0.3, 0.3), poll=0.05, grace=0.1)
    gone.start = lambda: (Watchdog.start(gone), (tmp_path / "run-1").rmdir())  # type: ignore
    assert _run_until_exit([gone]) == {0: exit_codes.HUNG}
    assert read_dumps(tmp_path / "run-1")  # the dump recreated the folder
    (tmp_path / "run-0").mkdir()
    (tmp_path / "run-0" / "report.json").write_text("[]")
    (tmp_path / "run-1" / "report.json").unlink()
    assert not repeats_previous(tmp_path / "run-2", 1, "x")  # the supervisor reads it too
    again = Watchdog(0, 1, tmp_path / "run-2", Bounds(5.0, 0.3, 0.3), poll=0.05, grace=0.1)
    assert _run_until_exit([again]) == {0: exit_codes.HUNG}
