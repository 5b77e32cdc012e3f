"""Iteration ranges for ``--iterations-to-skip`` (no Megatron imports): ranges, files of them
and a rollback's ``A-B samples S-T`` windows; :func:`resolve_argv` gives Megatron the flat union
of every source, less what the loaded checkpoint already trained.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.files import SKIPPED_ITERATIONS_FILE
from megatron_ext.common.records.skip_windows import (
    ResumePoint,
    Window,
    check_batch_change,
    place,
    resume_point,
)

# Most iterations one start-up may skip: Megatron keeps the list flat; more is a typo.
MAX_SKIPPED = 100_000


def parse_range(text: str, where: str = "") -> tuple[int, int]:
    """``"12"`` → (12, 12); ``"10-13"`` → (10, 13); anything else is an error."""
    start, sep, end = text.strip().partition("-")
    try:
        first, last = int(start), int(end) if sep else int(start)
    except ValueError:
        raise ValueError(f"{where}bad iteration or range {text!r} (want N or A-B)") from None
    if first < 1 or last < first:
        raise ValueError(f"{where}bad range {text!r}: iterations are 1-indexed and A <= B")
    return first, last


def _parse_samples(text: str, where: str) -> tuple[int, int]:
    start, sep, end = text.partition("-")
    try:
        first, last = int(start), int(end)
    except ValueError:
        raise ValueError(f"{where}bad sample range {text!r} (want S-T)") from None
    if not sep or first < 0 or last < first:
        raise ValueError(f"{where}bad sample range {text!r}: samples are 0-indexed and S <= T")
    return first, last


def parse_window(text: str, where: str = "") -> Window:
    """``"12"``, ``"10-13"`` or ``"10-13 samples 72-103"``; anything else is an error."""
    parts = text.split()
    if len(parts) == 1:
        return Window(*parse_range(parts[0], where))
    if len(parts) == 3 and parts[1] == "samples":
        return Window(*parse_range(parts[0], where), _parse_samples(parts[2], where))
    raise ValueError(f"{where}bad skip-list item {text!r} (want N, A-B or A-B samples S-T)")


def read_windows(path: str | os.PathLike[str]) -> list[Window]:
    """Every item of a skip file (nothing expanded)."""
    windows: list[Window] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        item = line.split("#", 1)[0].strip()
        if item:
            windows.append(parse_window(item, where=f"{path}:{number}: "))
    return windows


def read_file(path: str | os.PathLike[str]) -> list[int]:
    """Every iteration listed in a skip file, sorted (ranges expanded; refused above
    :data:`MAX_SKIPPED`, as at start-up)."""
    return clip([(w.first, w.last) for w in read_windows(path)], None, f"{path}: ")[0]


def clip(
    ranges: list[tuple[int, int]], train_iters: int | None, where: str
) -> tuple[list[int], str | None]:
    """The iterations of ``ranges`` that training can reach (<= ``train_iters``), expanded,
    and a note naming what was dropped. Raises ValueError above :data:`MAX_SKIPPED`."""
    kept = [(a, min(b, train_iters or b)) for a, b in ranges if not train_iters or a <= train_iters]
    merged = to_merged(kept)
    refuse_too_many(sum(b - a + 1 for a, b in merged), where)
    dropped = [f"{a}-{b}" for a, b in ranges if train_iters and b > train_iters]
    note = (
        f"megatron-ext: {where}{', '.join(dropped)} clipped to --train-iters {train_iters} "
        "(iterations past the end of training are never reached; give them again if you "
        "extend --train-iters)"
        if dropped
        else None
    )
    return [i for a, b in merged for i in range(a, b + 1)], note


def refuse_too_many(count: int, where: str) -> None:
    if count > MAX_SKIPPED:
        raise ValueError(
            f"{where}skipping {count} iterations is more than the {MAX_SKIPPED} a skip list may "
            "hold (Megatron keeps it flat in memory and in every checkpoint); a typo? "
            "Shorten the range, or end the run with --train-iters"
        )


def to_merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged inclusive ranges of (first, last) ranges (nothing expanded)."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def to_ranges(iterations: list[int]) -> list[tuple[int, int]]:
    """Sorted, merged inclusive ranges."""
    return to_merged([(i, i) for i in iterations])


def format_ranges(iterations: list[int]) -> str:
    """File content: one ``A-B`` (or ``N``) per line."""
    return "".join(f"{Window(a, b).iterations()}\n" for a, b in to_ranges(iterations))


SAMPLES_HEADER = (
    "# A-B samples S-T: consumed samples S-T (0-based) are never trained; each start-up places "
    "them at the global batch in force\n"
)


def format_windows(windows: list[Window]) -> str:
    """File content: each window with samples on its own line, the other iterations merged
    into ``A-B`` lines (exactly :func:`format_ranges` when no window has samples)."""
    sampled = sorted({w for w in windows if w.samples}, key=lambda w: (w.first, w.samples))
    covered = {i for w in sampled for i in range(w.first, w.last + 1)}
    plain = {i for w in windows if not w.samples for i in range(w.first, w.last + 1)}
    lines = [(a, Window(a, b).text()) for a, b in to_ranges(sorted(plain - covered))]
    lines += [(w.first, w.text()) for w in sampled]
    header = SAMPLES_HEADER if sampled else ""
    return header + "".join(f"{text}\n" for _, text in sorted(lines))


def show(iterations: list[int]) -> str:
    """Iterations as ranges for people: ``5-7, 10``."""
    return ", ".join(Window(a, b).iterations() for a, b in to_ranges(iterations))


@dataclass
class SkipSources:
    """Where each iteration to skip came from; training skips the union of all of them."""

    flags: list[int] = field(default_factory=list)  # --iterations-to-skip (any spelling)
    files: dict[str, list[int]] = field(default_factory=dict)  # --iterations-to-skip-file
    persisted: list[int] = field(default_factory=list)  # LOAD/megatron_ext_skipped_iterations
    persisted_path: str | None = None
    windows: list[Window] = field(default_factory=list)  # those with samples, as placed
    global_batch: int | None = None  # the global batch the windows were placed at
    notes: list[str] = field(default_factory=list)  # placed, clipped, trained: at start-up

    def union(self) -> list[int]:
        return sorted(set(self.flags).union(self.persisted, *self.files.values()))

    def describe(self) -> str:
        """The start-up lines: what was placed, clipped or already trained, then the union
        and each source, as ranges."""
        parts = [f"--iterations-to-skip {show(self.flags)}"] if self.flags else []
        parts += [f"--iterations-to-skip-file {p}: {show(i)}" for p, i in self.files.items()]
        if self.persisted:
            parts.append(f"persisted in {self.persisted_path}: {show(self.persisted)}")
        union = (
            f"megatron-ext: skipping iterations {show(self.union())} (the union of "
            + "; ".join(parts)
            + ")"
            if parts
            else "megatron-ext: skipping no iterations"
        )
        return "\n".join([*self.notes, union])

    def settle(
        self,
        label: str,
        windows: list[Window],
        train_iters: int | None,
        resume: ResumePoint | None,
    ) -> list[int]:
        """One source's iterations: its windows placed at :attr:`global_batch`, clipped to
        ``train_iters``, less what the checkpoint's run trained; changes go to :attr:`notes`."""
        placed: list[Window] = []
        for window in windows:
            if resume is None or self.global_batch is None:
                placed.append(window)
                continue
            pieces, note = place(window, resume, self.global_batch)
            placed += pieces
            self.notes += [f"megatron-ext: {label}: {note}"] if note else []
        where = f"{label} " if label == "--iterations-to-skip" else f"{label}: "
        iterations, note = clip([(w.first, w.last) for w in placed], train_iters, where)
        self.notes += [note] if note else []
        done = resume.iteration if resume else 0
        trained = [i for i in iterations if i <= done and i not in resume.skipped] if resume else []
        if trained:
            ahead = [i for i in iterations if i > done]
            self.notes.append(
                f"megatron-ext: {label}: {show(trained)} already trained (resuming at "
                f"{done + 1}): not skipped; "
                + (f"{show(ahead)} will be skipped" if ahead else "none of it lies ahead")
            )
            iterations = sorted(set(iterations) - set(trained))
        self.windows += [
            w for w in placed if w.samples and not any(w.first <= i <= w.last for i in trained)
        ]
        return iterations


def _flag(argv: list[str], flag: str, kind: type = str) -> Any:
    """``flag`` as Megatron's parser will read it (the last one wins; None: not given)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(flag, type=kind, dest="value")
    return parser.parse_known_args(argv)[0].value


def load_dir(argv: list[str]) -> str | None:
    return _flag(argv, "--load")


# Added to Megatron's argv here for the skip-list feature: the placed windows it persists,
# and the global batch they were placed at.
WINDOWS_FLAG = "--skip-sample-windows"
WINDOWS_BATCH_FLAG = "--skip-windows-global-batch"


def resolve_argv(argv: list[str]) -> tuple[list[str], SkipSources]:
    """Megatron's argv with one flat ``--iterations-to-skip`` (flags, files and the list
    persisted in ``--load``, settled as above), and where each came from. ``ValueError`` /
    ``OSError`` name a bad item or file, or a batch change Megatron refuses."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--iterations-to-skip", nargs="*", action="extend", default=[])
    parser.add_argument("--iterations-to-skip-file", action="append", default=[])
    known, rest = parser.parse_known_args(argv)
    sources, last = SkipSources(), _flag(argv, "--train-iters", int)  # None: by samples
    resume = resume_point(argv)
    batch = _flag(argv, "--global-batch-size", int)
    check_batch_change(argv, resume, batch)
    sources.global_batch = batch or (resume.global_batch if resume else None)
    flags = [
        Window(*parse_range(i, where="--iterations-to-skip: ")) for i in known.iterations_to_skip
    ]
    sources.flags = sources.settle("--iterations-to-skip", flags, last, resume)
    for path in known.iterations_to_skip_file:
        label = f"--iterations-to-skip-file {path}"
        sources.files[path] = sources.settle(label, read_windows(path), last, resume)
    load = load_dir(argv)
    if load and (Path(load) / SKIPPED_ITERATIONS_FILE).exists():
        sources.persisted_path = str(Path(load) / SKIPPED_ITERATIONS_FILE)
        label = f"persisted in {sources.persisted_path}"
        sources.persisted = sources.settle(
            label, read_windows(sources.persisted_path), None, resume
        )
    if resume is None and sources.windows:
        sources.notes.append(
            "megatron-ext: the checkpoint to load could not be read here, so the skip windows "
            "kept in samples stay at the iterations they were planned at"
        )
    union = sources.union()
    refuse_too_many(len(union), "the union of the skip lists: ")
    out = [*rest, "--iterations-to-skip", *map(str, union)] if union else rest
    if sources.windows:
        items = [f"{w.iterations()}:{w.samples[0]}-{w.samples[1]}" for w in sources.windows]
        out += [WINDOWS_FLAG, *items]
        out += [WINDOWS_BATCH_FLAG, str(sources.global_batch)] if sources.global_batch else []
    return out, sources


def persisted_text(iterations: list[int], window_items: list[str]) -> str:
    """What the skip-list feature keeps in SAVE: Megatron's flat list, with the
    :data:`WINDOWS_FLAG` items (``A-B:S-T``) as their sample windows."""
    windows = [parse_window(item.replace(":", " samples ", 1)) for item in window_items]
    return format_windows([*(Window(a, b) for a, b in to_ranges(iterations)), *windows])
