"""Forward-progress watchdog (no torch, no Megatron): a daemon thread bounds the time since the
last :meth:`Watchdog.beat` by the phase's own history; past it every rank dumps its stacks
through the attempt's hang folder and exits :data:`~megatron_ext.common.exit_codes.HUNG`
(docs/hangs.md)."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.common import exit_codes
from megatron_ext.common.io import atomic_write, atomic_write_json
from megatron_ext.common.records.hangs import (
    REPORT_FILE,
    REQUEST_FILE,
    HangDump,
    read_dumps,
    repeats_previous,
    report,
)


@dataclass(frozen=True)
class Bounds:
    factor: float = 5.0
    min_timeout: float = 120.0
    first_timeout: float = 1800.0
    history: int = 50  # recent durations kept per phase


def stacks() -> dict[str, list[str]]:
    """Every thread's Python stack, by thread name (innermost frame last)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        names.get(ident, f"thread-{ident}"): traceback.format_stack(frame)
        for ident, frame in sys._current_frames().items()
        if ident != threading.get_ident()
    }


@dataclass
class Watchdog:
    """One rank's watchdog; :meth:`start` it once the process group exists."""

    rank: int
    world_size: int
    directory: Path
    bounds: Bounds = field(default_factory=Bounds)
    poll: float = 0.5
    grace: float = 15.0
    exit: Callable[[int], None] = os._exit
    clock: Callable[[], float] = time.monotonic
    phase: str = "start-up"
    iteration: int = 0  # the last finished iteration
    last_progress: str = "start-up"
    _last: float = 0.0
    _started: float = field(default_factory=time.time)
    _phase_start: float = 0.0
    _durations: dict[str, deque[float]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._last = self._phase_start = self.clock()
        self._durations = {p: deque(maxlen=self.bounds.history) for p in ("train", "save", "eval")}

    # -- the training side ---------------------------------------------------------------
    def beat(self, what: str, phase: str = "train") -> None:
        """Progress: ``what`` just ran, in ``phase``; a phase's end is timed into its history.
        Start-up (and its bound) lasts until the first step ends (it builds communicators)."""
        now = self.clock()
        if phase != self.phase and self.phase != "start-up":
            if self.phase in ("save", "eval"):
                self._durations[self.phase].append(now - self._phase_start)
            self.phase, self._phase_start = phase, now
        self._last, self.last_progress = now, what

    def step_end(self, iteration: int) -> None:
        """A training iteration finished: its time joins the steps' history."""
        now = self.clock()
        if self.phase == "train" and self.iteration:
            self._durations["train"].append(now - self._phase_start)
        self.iteration = iteration
        self.beat("step end")
        self.phase, self._phase_start = "train", now

    def remember(self, path: Path) -> None:
        """Keep the durations for the next attempt (:meth:`recall`): a hang soon after a
        restart is then bounded by this run's history, not the first timeout."""
        try:
            atomic_write_json(path, {p: list(d) for p, d in self._durations.items()})
        except OSError as exc:  # a hint for the next attempt: never worth stopping training
            print(
                f"megatron-ext hang watchdog: cannot keep the durations in {path} ({exc}); "
                "the next attempt starts from --hang-first-timeout",
                file=sys.stderr,
                flush=True,
            )

    def recall(self, path: Path) -> None:
        """The durations :meth:`remember` kept; a damaged file (not this shape, or a duration
        that is not a finite number >= 0) is ignored like a missing one."""
        try:
            saved = json.loads(path.read_text())
            recalled = {p: [float(d) for d in saved.get(p, [])] for p in self._durations}
        except (OSError, ValueError, TypeError, AttributeError):
            return
        if all(math.isfinite(d) and d >= 0 for ds in recalled.values() for d in ds):
            for phase, durations in recalled.items():
                self._durations[phase].extend(durations)

    def bound(self) -> float:
        durations = self._durations.get(self.phase)  # None: start-up
        if not durations:
            return self.bounds.first_timeout
        return max(self.bounds.min_timeout, self.bounds.factor * max(durations))

    # -- the watching thread -------------------------------------------------------------
    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="megatron-ext-hang", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            request = self._request()
            stalled = self.clock() - self._last
            if request is not None or stalled > self.bound():
                self._fire(self._ask(stalled) if request is None else request, stalled)
                return

    def _request(self) -> int | None:
        """The rank that asked for dumps in this attempt (a request older than this process
        is a previous attempt's, in a folder the user reuses: ignored)."""
        path = self.directory / REQUEST_FILE
        try:
            if path.stat().st_mtime < self._started - 1.0:
                return None
            return int(json.loads(path.read_text())["rank"])
        except (OSError, ValueError, KeyError, TypeError):  # damaged: as if none
            return None

    def _ask(self, stalled: float) -> int:
        """Ask every rank to dump (the first to ask wins: an exclusive create)."""
        path = self.directory / REQUEST_FILE
        body = {"rank": self.rank, "iteration": self.iteration + 1, "stalled_s": stalled}
        try:
            with open(path, "x") as f:
                json.dump(body, f)
        except FileExistsError:
            first = self._request()
            return self.rank if first is None else first
        except OSError:  # the folder went away or turned read-only: this rank dumps anyway
            return self.rank
        return self.rank

    def _fire(self, detected_by: int, stalled: float) -> None:
        dump = HangDump(
            rank=self.rank,
            world_size=self.world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            iteration=self.iteration + 1,
            phase=self.phase,
            last_progress=self.last_progress,
            stalled_s=round(stalled, 3),
            bound_s=round(self.bound(), 3),
            detected_by=detected_by,
            stacks=stacks(),
        )
        try:
            stacks_at = f"stacks in {dump.write(self.directory)}"
        except OSError as exc:  # a full disk, a read-only folder: the rank still exits
            stacks_at = f"stacks not written ({exc})"
        asked = "" if detected_by == self.rank else f", asked by rank {detected_by}"
        print(
            f"megatron-ext hang watchdog: rank {self.rank}: no progress for {stalled:.1f} s at "
            f"iteration {dump.iteration} ({dump.phase}, last: {dump.last_progress}; bound "
            f"{dump.bound_s:.1f} s{asked}"
            f"); {stacks_at}; exiting {exit_codes.HUNG} "
            "so that the launcher restarts from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        # Nobody exits before the report is written: a launcher stops the other ranks as soon
        # as one exits, and the rank that fired writes the report once every rank dumped.
        try:
            deadline = self.clock() + self.grace
            while self.clock() < deadline and not self._settled(detected_by):
                time.sleep(self.poll / 5)
            if detected_by == self.rank:
                self._report()
        except Exception as exc:  # a damaged earlier report, a full disk: the rank still exits
            print(
                f"megatron-ext hang watchdog: rank {self.rank}: no report.md "
                f"({type(exc).__name__}: {exc})",
                file=sys.stderr,
                flush=True,
            )
        finally:
            sys.stdout.flush()
            self.exit(exit_codes.HUNG)

    def _settled(self, detected_by: int) -> bool:
        """The firing rank: every rank dumped; the others: the firing rank's report is out."""
        if detected_by != self.rank:
            path = self.directory / REPORT_FILE
            return path.is_file() and path.stat().st_mtime >= self._started - 1.0
        return len(read_dumps(self.directory, self._started - 1.0)) == self.world_size

    def _report(self) -> None:
        """The attempt's hang report beside the dumps (``report.{json,md}``), for launchers
        other than megatron-ext's supervisor (which writes its own)."""
        found = report(read_dumps(self.directory, self._started - 1.0), self.world_size)
        if found is None:
            return
        repeat = repeats_previous(self.directory, found.iteration, found.where)
        atomic_write_json(self.directory / REPORT_FILE, found.as_json(attempt=0))
        atomic_write(self.directory / "report.md", found.markdown(attempt=0, repeat=repeat))
        again = "; the same hang as the previous attempt: a restart will hang again" * repeat
        print(
            f"megatron-ext hang watchdog: hang at iteration {found.iteration}: ranks "
            f"{list(found.hung)} stuck at {found.where}{again}; report "
            f"{self.directory / 'report.md'}",
            file=sys.stderr,
            flush=True,
        )
