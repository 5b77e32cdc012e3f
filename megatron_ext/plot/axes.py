"""Pieces of the plot's panels (:mod:`megatron_ext.plot.draw`): the grad norm's log axis with
enough labels to read, and the steps whose update ``--spike-skip-update`` withheld.

Why a log axis needs help: matplotlib labels a log axis at powers of ten, and a healthy grad
norm stays within one decade (the demo's: 0.9 to 2.7), so its panel had two labels, one of
them ``9×10⁻¹``. Within two decades the ticks here are round numbers of the 1-2-5 series (1,
1.5, 2, 3, 5, 7 when that gives too few; evenly spaced ones when even that does), written
plainly.
"""

from __future__ import annotations

import math
from typing import Any

from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

MIN_LABELS = 4
SERIES = ((1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0))


def log_ticks(low: float, high: float) -> list[float]:
    """Round tick values in ``[low, high]`` (both > 0), at least :data:`MIN_LABELS` of them
    when the range allows; empty past two decades (matplotlib's powers of ten then do)."""
    if high / low >= 100:
        return []
    for mantissas in SERIES:
        ticks = [
            round(m * 10.0**exponent, 12)
            for exponent in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            for m in mantissas
        ]
        ticks = [t for t in ticks if low <= t <= high]
        if len(ticks) >= MIN_LABELS:
            return ticks
    ticks = MaxNLocator(nbins=MIN_LABELS + 1).tick_values(low, high)
    return [round(float(t), 12) for t in ticks if low <= t <= high and t > 0]


def log_axis(axis: Any, low: float, high: float) -> None:
    """A log y axis over the data's ``low..high`` with the ticks of :func:`log_ticks`."""
    axis.set_yscale("log")
    ticks = log_ticks(low, high)
    if ticks:
        axis.yaxis.set_major_locator(FixedLocator(ticks))
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_locator(NullLocator())


def draw_update_skips(axis: Any, series: list, colours: list[str]) -> int:
    """Each line's withheld updates as diamonds on the panel's bottom edge (one per envelope
    column, like the non-finite values); the count over every line."""
    total = 0
    for index, line in enumerate(series):
        total += line.update_skips
        if not line.skipped_at:
            continue
        iterations = [int(i) for part in line.skipped_at for i in part]
        axis.plot(
            iterations,
            [0.03] * len(iterations),
            linestyle="none",
            marker="D",
            markersize=5,
            color=colours[index % len(colours)],
            transform=axis.get_xaxis_transform(),
            clip_on=False,
        )
    return total
