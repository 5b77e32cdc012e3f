"""The detector's rolling windows: a fixed-size window with an O(log n) median (no Megatron
imports)."""

from __future__ import annotations

import bisect
from collections import deque

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class RollingWindow:
    """Fixed-size window with O(log n) median (sorted mirror of a deque)."""

    __slots__ = ("_order", "size", "values")

    def __init__(self, size: int) -> None:
        self.size = size
        self._order: deque[float] = deque()
        self.values: list[float] = []  # sorted; read directly on the per-step path

    def __len__(self) -> int:
        return len(self.values)

    def push(self, value: float) -> None:
        order, ordered = self._order, self.values
        order.append(value)
        bisect.insort(ordered, value)
        if len(ordered) > self.size:
            del ordered[bisect.bisect_left(ordered, order.popleft())]

    def median(self) -> float:
        s = self.values
        n = len(s)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

    def mad(self) -> float:
        med = self.median()
        deviations = sorted(abs(v - med) for v in self.values)
        n = len(deviations)
        return deviations[n // 2] if n % 2 else 0.5 * (deviations[n // 2 - 1] + deviations[n // 2])

    def above(self, value: float, rel: float, k: float, scale: float | None = None) -> bool:
        """``value`` above both ``median + rel·scale`` (scale: the median itself unless given)
        and ``median + k·σ``; the cheap test first."""
        median = self.median()
        if value <= median + abs(median if scale is None else scale) * rel:
            return False
        return value > median + k * MAD_TO_SIGMA * self.mad()

    def threshold(self, rel: float, k: float, scale: float | None = None) -> float:
        median = self.median()
        relative = median + abs(median if scale is None else scale) * rel
        return max(relative, median + k * MAD_TO_SIGMA * self.mad())
