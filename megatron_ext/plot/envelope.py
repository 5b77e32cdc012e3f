"""A line decimated to pixel columns without losing what matters: every spike, every NaN.

Why: a 5 M-iteration line has ~4,000 points per pixel of a 1200-pixel figure. Keeping, per
column, the first, lowest, highest and last point (M4 aggregation) draws the same pixels as all
of them would, so no spike is ever averaged away, in memory bounded by the column count.
Non-finite values have no height: per column the first one is kept, drawn as a break in the
line and a cross on the panel's top edge. When a column is one iteration wide (a log shorter
than the column count), every point is kept as it is: the plot is the undecimated one.
"""

from __future__ import annotations

import math

import numpy as np

COLUMNS = 2400  # per x range: twice the figure's width in pixels


def column_width(first: int, last: int, columns: int = COLUMNS) -> int:
    """Iterations per column over ``first..last`` (1: every point kept)."""
    return max(1, math.ceil((last - first + 1) / columns))


class Envelope:
    """One line's columns; feed :meth:`add` points in increasing iteration order."""

    def __init__(self, start: int, width: int) -> None:
        self.start, self.width = start, width
        self.recorded = 0  # points with a value (finite or not)
        self._bins: list[np.ndarray] = []
        self._xs: list[np.ndarray] = []  # (columns, 4): first, min, max, last
        self._ys: list[np.ndarray] = []
        self._bad: list[np.ndarray] = []  # first non-finite iteration per column

    def add(self, x: np.ndarray, y: np.ndarray, present: np.ndarray) -> None:
        """Points ``x`` (iterations, increasing), ``y``; ``present``: False where not recorded."""
        x, y = x[present], y[present]
        self.recorded += len(x)
        finite = np.isfinite(y)
        if not finite.all():
            bad = x[~finite]
            bins = (bad - self.start) // self.width
            self._bad.append(bad[np.r_[True, bins[1:] != bins[:-1]]])
            x, y = x[finite], y[finite]
        if not len(x):
            return
        bins = (x - self.start) // self.width
        starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
        ends = np.r_[starts[1:], len(x)] - 1
        order = np.lexsort((y, bins))  # bins are sorted: each column keeps its index range
        index = np.stack([starts, order[starts], order[ends], ends], axis=1)
        self._bins.append(bins[starts])
        self._xs.append(x[index])
        self._ys.append(y[index])

    def finite_min(self) -> float | None:
        """The lowest finite value (kept exactly: it is some column's minimum)."""
        return float(min(y[:, 1].min() for y in self._ys)) if self._ys else None

    def finite_max(self) -> float | None:
        """The highest finite value (some column's maximum)."""
        return float(max(y[:, 2].max() for y in self._ys)) if self._ys else None

    def bad(self) -> np.ndarray:
        """Iterations of the non-finite values kept (one per column)."""
        if not self._bad:
            return np.array([], dtype=np.int64)
        bad = np.concatenate(self._bad)
        bins = (bad - self.start) // self.width
        return bad[np.r_[True, bins[1:] != bins[:-1]]]

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """The line to draw: x and y in order, NaN where a non-finite value breaks it."""
        columns: dict[int, list[tuple[int, float]]] = {}
        if self._bins:
            bins = np.concatenate(self._bins).tolist()
            xs, ys = np.concatenate(self._xs).tolist(), np.concatenate(self._ys).tolist()
            for column, x, y in zip(bins, xs, ys):
                points = list(zip(x, y))
                if column in columns:  # a column split over two blocks
                    kept = columns[column]
                    points = [kept[0], *points[1:3], *kept[1:3], points[3]]
                    low = min(points[1:5], key=lambda p: p[1])
                    high = max(points[1:5], key=lambda p: p[1])
                    points = [points[0], low, high, points[5]]
                columns[column] = points
        for x in self.bad().tolist():
            columns.setdefault((x - self.start) // self.width, []).append((x, math.nan))
        line: list[tuple[int, float]] = []
        for column in sorted(columns):
            seen = set()
            for x, y in sorted(columns[column], key=lambda p: p[0]):
                if x not in seen:
                    seen.add(x)
                    line.append((x, y))
        if not line:
            return np.array([], dtype=np.int64), np.array([], dtype=np.float64)
        x, y = zip(*line)
        return np.array(x), np.array(y)
