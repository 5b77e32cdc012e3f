"""Iteration ranges for ``--iterations-to-skip`` (no Megatron imports).

Megatron takes a flat list of 1-indexed iterations. megatron-ext also accepts ranges
(``137000-137400``, inclusive) and a file of them (``--iterations-to-skip-file``: one item per
line, ``#`` comments), and persists the applied list next to the checkpoints so every later
restart skips the same absolute iterations.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_ext.files import SKIPPED_ITERATIONS_FILE


def parse_item(text: str, where: str = "") -> list[int]:
    """``"12"`` → [12]; ``"10-13"`` → [10, 11, 12, 13]; anything else is an error."""
    start, sep, end = text.strip().partition("-")
    try:
        first, last = int(start), int(end) if sep else int(start)
    except ValueError:
        raise ValueError(f"{where}bad iteration or range {text!r} (want N or A-B)") from None
    if first < 1 or last < first:
        raise ValueError(f"{where}bad range {text!r}: iterations are 1-indexed and A <= B")
    return list(range(first, last + 1))


def read_file(path: str | os.PathLike[str]) -> list[int]:
    """Every iteration listed in a skip file (ranges expanded)."""
    iterations: list[int] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        item = line.split("#", 1)[0].strip()
        if item:
            iterations += parse_item(item, where=f"{path}:{number}: ")
    return iterations


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


def expand_argv(argv: list[str]) -> tuple[list[str], list[int]]:
    """Rewrite ``--iterations-to-skip`` ranges and ``--iterations-to-skip-file F`` into
    Megatron's integer list; returns the new argv and the iterations requested."""
    out: list[str] = []
    requested: list[int] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--iterations-to-skip":
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                requested += parse_item(argv[i], where="--iterations-to-skip: ")
                i += 1
            continue
        if arg == "--iterations-to-skip-file":
            if i + 1 >= len(argv):
                raise ValueError("--iterations-to-skip-file needs a path")
            requested += read_file(argv[i + 1])
            i += 2
            continue
        out.append(arg)
        i += 1
    return out, sorted(set(requested))


def with_persisted(argv: list[str], requested: list[int], load: str | None) -> list[str]:
    """Add what earlier runs persisted in the checkpoint dir; return Megatron's argv."""
    merged = set(requested)
    if load and (Path(load) / SKIPPED_ITERATIONS_FILE).exists():
        merged |= set(read_file(Path(load) / SKIPPED_ITERATIONS_FILE))
    return [*argv, "--iterations-to-skip", *map(str, sorted(merged))] if merged else argv
