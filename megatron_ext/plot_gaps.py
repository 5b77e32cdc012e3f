"""Logging gaps on the ``megatron-ext plot`` figure (kept apart from the plot's body).

A write failure of the signals log (a full disk) no longer stops training; the iterations it
could not log are named by a gap record (:mod:`megatron_ext.gap_log`). The plot hatches them
so that a stretch with no points reads as "not logged", never as a quiet stretch.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from megatron_ext.gap_log import Gap


def mark_gaps(figure: Figure, gaps: list[Gap]) -> None:
    """Hatch every logging gap (trained, not logged: a write failure) on every panel, so a
    flat stretch is never read as a quiet one."""
    for gap in gaps:
        for axis in figure.axes:
            axis.axvspan(
                gap.first_iteration - 0.5,
                gap.last_iteration + 0.5,
                facecolor="none",
                edgecolor="tab:red",
                hatch="//",
                linewidth=0,
            )
        figure.axes[0].annotate(
            f"not logged {gap.first_iteration}-{gap.last_iteration}",
            xy=(gap.first_iteration, 0.0),
            xycoords=figure.axes[0].get_xaxis_transform(),
            fontsize=8,
            color="tab:red",
            va="bottom",
        )
