"""Iteration ranges for ``--iterations-to-skip`` (no Megatron imports).

Megatron takes a flat list of 1-indexed iterations. megatron-ext also accepts ranges
(``137000-137400``, inclusive) and a file of them (``--iterations-to-skip-file``: one item per
line, ``#`` comments), and persists the applied list next to the checkpoints so every later
restart skips the same absolute iterations.

:func:`resolve_argv` is how the entry point reads them: with argparse (so
``--iterations-to-skip-file=PATH`` and repeated flags count), the union of every source
(flags, files, the list persisted in ``--load``), announced at start-up.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.files import SKIPPED_ITERATIONS_FILE

MAX_SKIPPED = 100_000
"""Most iterations one start-up may skip. Megatron keeps the list flat (``args``, every
checkpoint, an ``in`` test per iteration): ``50-2000000`` cost 1.4 GB RSS and a 12 MB
checkpoint. A skip list is for incidents (hundreds of iterations), so more is a typo."""


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


def parse_item(text: str, where: str = "") -> list[int]:
    """``"12"`` → [12]; ``"10-13"`` → [10, 11, 12, 13]; anything else is an error."""
    first, last = parse_range(text, where)
    return list(range(first, last + 1))


def read_ranges(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """Every item of a skip file, as (first, last) ranges (nothing expanded)."""
    ranges: list[tuple[int, int]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        item = line.split("#", 1)[0].strip()
        if item:
            ranges.append(parse_range(item, where=f"{path}:{number}: "))
    return ranges


def read_file(path: str | os.PathLike[str]) -> list[int]:
    """Every iteration listed in a skip file (ranges expanded)."""
    return [i for a, b in read_ranges(path) for i in range(a, b + 1)]


def clip(
    ranges: list[tuple[int, int]], train_iters: int | None, where: str
) -> tuple[list[int], str | None]:
    """The iterations of ``ranges`` that training can reach (<= ``train_iters``), expanded,
    and a note naming what was dropped. Raises ValueError above :data:`MAX_SKIPPED`."""
    kept = [(a, min(b, train_iters or b)) for a, b in ranges if not train_iters or a <= train_iters]
    count = sum(b - a + 1 for a, b in to_merged(kept))
    refuse_too_many(count, where)
    dropped = [f"{a}-{b}" for a, b in ranges if train_iters and b > train_iters]
    note = (
        f"megatron-ext: {where}{', '.join(dropped)} clipped to --train-iters {train_iters} "
        "(iterations past the end of training are never reached; give them again if you "
        "extend --train-iters)"
        if dropped
        else None
    )
    return [i for a, b in to_merged(kept) for i in range(a, b + 1)], note


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
    ranges: list[tuple[int, int]] = []
    for i in sorted(set(iterations)):
        if ranges and i == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], i)
        else:
            ranges.append((i, i))
    return ranges


def format_ranges(iterations: list[int]) -> str:
    """File content: one ``A-B`` (or ``N``) per line."""
    return "".join(f"{a}-{b}\n" if a != b else f"{a}\n" for a, b in to_ranges(iterations))


@dataclass
class SkipSources:
    """Where each iteration to skip came from; training skips the union of all of them."""

    flags: list[int] = field(default_factory=list)  # --iterations-to-skip (any spelling)
    files: dict[str, list[int]] = field(default_factory=dict)  # --iterations-to-skip-file
    persisted: list[int] = field(default_factory=list)  # LOAD/megatron_ext_skipped_iterations
    persisted_path: str | None = None
    notes: list[str] = field(default_factory=list)  # what was clipped, printed at start-up

    def union(self) -> list[int]:
        merged = set(self.flags) | set(self.persisted)
        for iterations in self.files.values():
            merged |= set(iterations)
        return sorted(merged)

    def describe(self) -> str:
        """One start-up line: the union and each source, as ranges."""

        def show(iterations: list[int]) -> str:
            return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in to_ranges(iterations))

        parts = [f"--iterations-to-skip {show(self.flags)}"] if self.flags else []
        parts += [f"--iterations-to-skip-file {p}: {show(i)}" for p, i in self.files.items()]
        if self.persisted:
            parts.append(f"persisted in {self.persisted_path}: {show(self.persisted)}")
        return "\n".join(
            [
                *self.notes,
                f"megatron-ext: skipping iterations {show(self.union())} (the union of "
                + "; ".join(parts)
                + ")",
            ]
        )


def _skip_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--iterations-to-skip", nargs="*", action="extend", default=[])
    parser.add_argument("--iterations-to-skip-file", action="append", default=[])
    return parser


def train_iters(argv: list[str]) -> int | None:
    """``--train-iters`` as Megatron's parser will read it (None: trained by samples)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--train-iters", type=int)
    return parser.parse_known_args(argv)[0].train_iters


def load_dir(argv: list[str]) -> str | None:
    """``--load`` as Megatron's parser will read it (either spelling, the last one wins)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--load")
    return parser.parse_known_args(argv)[0].load


def resolve_argv(argv: list[str]) -> tuple[list[str], SkipSources]:
    """Parse the skip flags as argparse does (``--flag=value`` too, every occurrence), add the
    list persisted in ``--load``, and return Megatron's argv with one flat
    ``--iterations-to-skip`` (the union) plus where each iteration came from.

    Raises ``ValueError``/``OSError`` naming the bad item or file.
    """
    known, rest = _skip_parser().parse_known_args(argv)
    sources, last = SkipSources(), train_iters(argv)
    flag_ranges = [parse_range(i, where="--iterations-to-skip: ") for i in known.iterations_to_skip]
    sources.flags, note = clip(flag_ranges, last, "--iterations-to-skip ")
    sources.notes += [note] if note else []
    for path in known.iterations_to_skip_file:
        where = f"--iterations-to-skip-file {path}: "
        sources.files[path], note = clip(read_ranges(path), last, where)
        sources.notes += [note] if note else []
    load = load_dir(argv)
    if load and (Path(load) / SKIPPED_ITERATIONS_FILE).exists():
        sources.persisted_path = str(Path(load) / SKIPPED_ITERATIONS_FILE)
        where = f"{sources.persisted_path}: "
        sources.persisted, _ = clip(read_ranges(sources.persisted_path), None, where)
    union = sources.union()
    refuse_too_many(len(union), "the union of the skip lists: ")
    return ([*rest, "--iterations-to-skip", *map(str, union)] if union else rest), sources
