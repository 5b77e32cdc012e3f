"""Hang dumps: what a rank's watchdog writes when training stops making progress, and the
report the supervisor builds from them (no torch, no Megatron). An attempt's folder
(``MEGATRON_EXT_HANG_DIR``) holds ``request.json``, ``rank-R.json`` per rank and ``report.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.io import atomic_write_json, json_safe

HANG_DIR_ENV = "MEGATRON_EXT_HANG_DIR"
REQUEST_FILE = "request.json"
REPORT_FILE = "report.json"  # the attempt's report, beside the dumps
# An innermost frame inside torch.distributed: the thread waits on its peers, not stuck alone
# (only the innermost frames count: the whole forward runs inside Megatron's DDP wrapper).
COLLECTIVE_PATH = "torch/distributed/"
INNERMOST = 2


def dump_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}.json"


@dataclass
class HangDump:
    """One rank's view of a stall: where it was, how long it had made no progress, its stacks
    (thread name -> frames, innermost last, as ``traceback.format_stack`` gives them)."""

    rank: int
    world_size: int
    host: str
    pid: int
    iteration: int  # the iteration being trained (last finished + 1)
    phase: str  # start-up, train, save, eval
    last_progress: str  # the last hook that ran ("batch read", "loss", "step end", ...)
    stalled_s: float  # seconds without progress when it dumped
    bound_s: float  # the bound it had derived for that phase
    detected_by: int  # the rank whose watchdog fired first
    stacks: dict[str, list[str]] = field(default_factory=dict)

    @property
    def main_stack(self) -> list[str]:
        return self.stacks.get("MainThread") or next(iter(self.stacks.values()), [])

    def waiting_in_collective(self) -> bool:
        return any(COLLECTIVE_PATH in frame for frame in self.main_stack[-INNERMOST:])

    def where(self) -> str:
        """The innermost frame of the main thread outside the standard library's waits:
        ``file:line in function`` (the place a repeat is matched on)."""
        for frame in reversed(self.main_stack):
            head = frame.strip().splitlines()[0]
            if "/threading.py" not in head and "/selectors.py" not in head:
                return head.removeprefix("File ").replace('"', "")
        return "unknown"

    def write(self, directory: str | Path) -> Path:
        return atomic_write_json(dump_file(directory, self.rank), self)


def read_dumps(directory: str | Path, since: float = 0.0) -> list[HangDump]:
    """Every rank's dump in ``directory`` written at ``since`` (a time) or later (unreadable
    ones skipped: a rank killed mid-write)."""
    dumps = []
    for path in sorted(Path(directory).glob("rank-*.json")):
        try:
            if path.stat().st_mtime < since:
                continue
            dumps.append(HangDump(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(dumps, key=lambda d: d.rank)


@dataclass(frozen=True)
class HangReport:
    """Who hung, where, and every rank's stack, the hung rank's first."""

    iteration: int
    hung: tuple[int, ...]
    silent: tuple[int, ...]  # ranks that wrote no dump
    where: str
    dumps: tuple[HangDump, ...]

    def as_json(self, attempt: int) -> dict[str, Any]:
        return {
            "kind": "hang",
            "attempt": attempt,
            "iteration": self.iteration,
            "hung_ranks": list(self.hung),
            "silent_ranks": list(self.silent),
            "where": self.where,
            "ranks": [json_safe(asdict(d)) for d in self.dumps],
        }

    def markdown(self, attempt: int, repeat: bool) -> str:
        names = ", ".join(f"rank {r}" for r in self.hung) or "no rank named"
        lines = [
            f"# Hang at iteration {self.iteration} (attempt {attempt})",
            "",
            f"- hung: {names}; stuck at `{self.where}`",
            f"- silent (no stack: the process did not answer): {list(self.silent) or 'none'}",
            f"- repeat of the previous attempt's hang: {'yes' if repeat else 'no'}",
        ]
        for dump in self.dumps:
            state = "waiting in a collective" if dump.waiting_in_collective() else "not waiting"
            lines += [
                "",
                f"## rank {dump.rank} on {dump.host} (pid {dump.pid}): {dump.phase}, {state}, "
                f"no progress for {dump.stalled_s:.1f} s (bound {dump.bound_s:.1f} s; last: "
                f"{dump.last_progress})",
            ]
            for name, frames in dump.stacks.items():
                lines += ["", f"thread {name}:", "```", *(f.rstrip() for f in frames), "```"]
        return "\n".join(lines) + "\n"


def report(dumps: list[HangDump], world_size: int | None = None) -> HangReport | None:
    """The hang the dumps describe (None: no dumps): the ranks not waiting in a collective, else
    the silent ones (no dump), else the first to stop progressing."""
    if not dumps:
        return None
    world = world_size or max(d.world_size for d in dumps)
    seen = {d.rank for d in dumps}
    silent = tuple(r for r in range(world) if r not in seen)
    alone = [d for d in dumps if not d.waiting_in_collective()]
    if alone:
        hung = tuple(d.rank for d in alone)
    elif silent:
        hung = silent
    else:  # every rank waits: the one that stopped first
        hung = (max(dumps, key=lambda d: d.stalled_s).rank,)
    first = [d for d in dumps if d.rank in hung]
    ordered = tuple(first + [d for d in dumps if d.rank not in hung])
    where = first[0].where() if first else "unknown (the hung rank did not answer)"
    return HangReport(min(d.iteration for d in dumps), hung, silent, where, ordered)


def repeats_previous(directory: str | Path, iteration: int, where: str) -> bool:
    """Whether the newest earlier attempt's report (``report.json`` in a sibling of this
    attempt's ``directory``) names the same iteration and place."""
    directory = Path(directory)
    earlier = [p for p in directory.parent.glob(f"*/{REPORT_FILE}") if p.parent != directory]
    if not earlier:
        return False
    try:
        last = json.loads(max(earlier, key=lambda p: p.stat().st_mtime).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(last, dict):  # damaged (written atomically: only by hand): no repeat
        return False
    return (last.get("iteration"), last.get("where")) == (iteration, where)
