"""The plot's per-source panel: one line per blend member's loss, stage changes marked.

Why: the averaged loss of a blend moves when the mixture does; drawn next to it, each
member's own loss (``lm_loss_by_dataset``) shows whether a jump is one source's or the
mixture's. Read in the plot's one pass (:mod:`megatron_ext.plot.stream`), each member keeps a
decimated envelope (:mod:`megatron_ext.plot.envelope`) like every other line: memory is bounded
by the member count, not by the log. A stage is a stretch trained under one mixture: a piece
of the line (an attempt) whose token shares differ from the previous piece's by more than
``STAGE_SHIFT`` (or whose members differ) starts a new stage, marked where it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_ext.common.records.signals_columns import Block
from megatron_ext.plot.envelope import Envelope

STAGE_SHIFT = 0.1  # half the L1 distance of two mixtures' token shares that is a new stage


@dataclass
class SourceLines:
    """A line's per-member envelopes and, per piece (attempt), the tokens of each member."""

    start: int
    width: int
    envelopes: dict[str, Envelope] = field(default_factory=dict)
    mixtures: dict[int, dict[str, int]] = field(default_factory=dict)  # attempt -> tokens

    def add(self, block: Block, rows: np.ndarray) -> None:
        sources = block.sources
        if sources is None:
            return
        iterations = block.values["iteration"][rows]
        attempts = block.values["attempt"][rows]
        has_tokens, tokens = sources.has_tokens[rows], sources.tokens[rows]
        for attempt in np.unique(attempts).tolist():
            mine = attempts == attempt
            totals = np.where(has_tokens[mine], tokens[mine], 0).sum(axis=0).tolist()
            named = has_tokens[mine].any(axis=0).tolist()
            mixture = self.mixtures.setdefault(attempt, {})
            for name, total, seen in zip(sources.names, totals, named):
                if seen:
                    mixture[name] = mixture.get(name, 0) + total
        for index, name in enumerate(sources.names):
            has = sources.has_loss[rows, index]
            if has.any():
                envelope = self.envelopes.setdefault(name, Envelope(self.start, self.width))
                envelope.add(iterations, sources.losses[rows, index], has)


def shares(tokens: dict[str, int]) -> dict[str, float]:
    total = sum(tokens.values())
    return {n: t / total for n, t in tokens.items()} if total else {}


def stage_changes(
    pieces: list[tuple[int, int, int]], mixtures: dict[int, dict[str, int]]
) -> list[tuple[int, str]]:
    """(first iteration, "stage: name share, ...") where a piece's mixture differs from the
    previous piece's; the first piece is the first stage (not marked)."""
    changes, previous = [], None
    for attempt, first, _ in pieces:
        mixture = shares(mixtures.get(attempt, {}))
        if not mixture:
            continue
        if previous is not None:
            names = set(mixture) | set(previous)
            shift = sum(abs(mixture.get(n, 0.0) - previous.get(n, 0.0)) for n in names) / 2
            if shift > STAGE_SHIFT or {n for n, s in mixture.items() if s} != {
                n for n, s in previous.items() if s
            }:
                label = ", ".join(f"{n} {s:.0%}" for n, s in sorted(mixture.items()))
                changes.append((first, f"stage: {label}"))
        previous = mixture
    return changes


def draw(axis, lines: list, colours: list[str]) -> None:
    """The panel: each member of each line, stage changes as dash-dotted lines."""
    axis.set_title("LM loss by data source", loc="left", fontsize=10)
    axis.grid(True, alpha=0.3)
    drawn = False
    for index, line in enumerate(lines):
        sources = line.sources
        if sources is None:
            continue
        for number, (name, envelope) in enumerate(sorted(sources.envelopes.items())):
            xs, ys = envelope.points()
            label = name if len(lines) == 1 else f"{line.label}: {name}"
            colour = colours[(index + number) % len(colours)]
            axis.plot(xs, ys, color=colour, linewidth=1.0, label=label)
            drawn = True
        for first, label in stage_changes(line.pieces, sources.mixtures):
            axis.axvline(first, color="0.3", linestyle="-.", linewidth=1.0)
            axis.annotate(
                label,
                xy=(first, 0.98),
                xycoords=axis.get_xaxis_transform(),
                fontsize=8,
                va="top",
                ha="left",
            )
    if drawn:
        axis.legend(loc="upper right", fontsize=8)
    else:
        axis.text(
            0.5,
            0.5,
            "not recorded (a blend run with --signals-dir records it)",
            transform=axis.transAxes,
            ha="center",
            va="center",
            fontsize=11,
            color="0.4",
        )
        axis.set_yticks([])
