"""``megatron-ext plot``: the signals log as a PNG of panels, with what the tracker did.

    megatron-ext plot --signals-dir runs/7b/signals              # -> runs/7b/signals/signals.png
    megatron-ext plot --signals-dir DIR --attempts latest        # what the run finally trained
    megatron-ext plot --signals FILE.jsonl --attempts 2,3 --out spike.png
    megatron-ext plot --signals-dir DIR --spike-large-rel 0.5    # what those thresholds flag

Panels: LM loss, grad norm (pre-clip), params norm; the max attention logit and log Z of the
output softmax when the run recorded them (the figure names the flags otherwise); the loss of
each data source with the stage changes marked (:mod:`megatron_ext.plot.sources`). Steps
whose update ``--spike-skip-update`` withheld are diamonds under the loss, counted in the
legend. With ``--attempts all``
(the default) every attempt (launch, requeue, rollback) is its own coloured line, so a replay
after a rollback is seen next to what it replaced; ``latest`` plots one line, what the run
finally trained (the last attempt, and before its restart the attempt it resumed from, and so
on back; records past a later restart were rolled back). Marks:

- **what the tracker did**: the spike ledger's events (spike, recovered, divergence, rollback)
  of each attempt that ran ``--spike-detect``; the incident plans of ``megatron-ext skiplist``
  (found with the checkpoints: ``--ckpt-dir``, default the ``--save`` the ledger recorded): the
  rollback target of each incident (dashed line) and its skip window (shaded);
- **what a detector would flag**, for attempts without a ledger, or for every attempt when a
  ``--spike-*`` flag is given: a replay of the training-time detector
  (:class:`megatron_ext.spikes.detector.SpikeDetector`, primed after a restart as the tracker
  primes itself) with the thresholds the run recorded in its ledger, overridden by the flags
  given (defaults when nothing was recorded).

The log is read once, in blocks (:mod:`megatron_ext.plot.stream`): memory does not
grow with it. Each line keeps, per pixel column, its first, lowest, highest and last point
(:mod:`megatron_ext.plot.envelope`), so no spike is averaged away; a log shorter than the
column count is drawn point for point. Non-finite values (NaN/Inf) are drawn as crosses on the
panel's top edge, since they have no height, and break the line. Exit status: 0 written, 1
refused (the message says why), 2 usage error.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

# A bare Figure on an Agg canvas, not pyplot: no display needed on cluster nodes, and no global
# backend switch or figure registry in a process that imports this module.
from matplotlib import rcParams
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from megatron_ext.common.files import SIGNALS_FILE, SIGNALS_PLOT_FILE, SPIKE_LEDGER_FILE
from megatron_ext.common.gap_log import Gap
from megatron_ext.common.io import atomic_write
from megatron_ext.common.records.ledger import Ledger, read_incidents, read_ledger
from megatron_ext.common.records.signals_seek import SignalsLog
from megatron_ext.common.records.spike_config import (
    SpikeConfig,
    add_detector_args,
    config_from_args,
    flags_given,
)
from megatron_ext.plot import sources as plot_sources
from megatron_ext.plot.axes import draw_update_skips, log_axis
from megatron_ext.plot.envelope import COLUMNS
from megatron_ext.plot.stream import MARKERS, Series, Stats, plan_series, stream
from megatron_ext.spikes.detector import SpikeEvent

# (record field, panel title, the flag that records it: None for what every run records; a
# panel with a flag is left out when no iteration recorded it, and the figure names the flag)
PANELS: tuple[tuple[str, str, str | None], ...] = (
    ("lm_loss", "LM loss", None),
    ("grad_norm", "grad norm (pre-clip)", None),
    ("params_norm", "params norm", None),
    (
        "max_attention_logit",
        "max attention logit",
        "--signals-attention-logit, or --log-max-attention-logit with Transformer Engine",
    ),
    ("log_z", "log Z of the output softmax", "--log-output-z"),
)
MARKED_PANELS = {"lm_loss", "grad_norm"}  # what the detector reads; other panels get the line
MAX_LISTED = 20  # candidates printed; a run stuck at NaN has one per iteration


def build_parser() -> argparse.ArgumentParser:
    """The plot's flags; the ``--spike-*`` names and defaults match the training-time tracker."""
    parser = argparse.ArgumentParser(
        prog="megatron-ext plot",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--signals-dir", metavar="DIR", help=f"the run's --signals-dir (reads DIR/{SIGNALS_FILE})"
    )
    source.add_argument("--signals", metavar="FILE", help="a signals JSONL file")
    parser.add_argument(
        "--out",
        metavar="FILE.png",
        help="default: DIR/signals.png (FILE with a .png suffix for --signals)",
    )
    parser.add_argument(
        "--attempts",
        default="all",
        metavar="all|latest|N[,M]",
        help="all: one line per attempt (default); latest: the latest attempt "
        "per iteration; N[,M]: only these attempts",
    )
    parser.add_argument(
        "--ledger",
        metavar="FILE",
        help=f"the spike ledger (default: {SPIKE_LEDGER_FILE} next to the signals)",
    )
    parser.add_argument(
        "--ckpt-dir",
        metavar="DIR",
        help="the run's checkpoints, for the incident plans (default: the --save the ledger "
        "recorded)",
    )
    add_detector_args(
        parser.add_argument_group("spike detector replay (default: the run's thresholds)"),
        defaults=False,
    )
    return parser


def build_series(
    path: str | Path,
    attempts: str,
    config: SpikeConfig,
    ledger: Ledger | None = None,
    replay: bool = False,
    columns: int = COLUMNS,
) -> tuple[list[Series], Stats]:
    """The lines to draw and their marks, from one pass over the log at ``path`` (raises
    ValueError on a bad spec or a log out of the writer's order).

    An attempt whose ledger holds a config line ran the tracker: its marks are the ledger's
    events, unless ``replay``. Otherwise the detector is replayed with ``config`` over the
    attempt's records, primed as the tracker primes itself after a restart (see
    :mod:`megatron_ext.plot.stream`). Only marks inside the attempt are kept.
    """
    with SignalsLog(path) as log:
        lines = plan_series(log, attempts, config, ledger or Ledger(), replay, columns)
        return lines, stream(log, lines)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _draw_plans(axes: list, plans: list[dict]) -> None:
    """Each incident's skip window (shaded) and rollback target (dashed), on every panel."""
    for plan in plans:
        window = plan.get("skip_window")
        for axis in axes:
            if window:
                axis.axvspan(window[0] - 0.5, window[1] + 0.5, color="0.6", alpha=0.25, lw=0)
            axis.axvline(plan["rollback_to"], color="black", linestyle="--", linewidth=1.0)
        axes[0].annotate(
            f"incident {plan['number']}: onset {plan['onset']}, rollback to "
            f"{plan['rollback_to']}" + (f", skip {window[0]}-{window[1]}" if window else ""),
            xy=(plan["rollback_to"], 1.0),
            xycoords=axes[0].get_xaxis_transform(),
            fontsize=8,
            va="bottom",
        )


def _draw_gaps(axes: list, gaps: list[tuple[int, dict]]) -> None:
    """Iterations trained but not logged (a full disk's gap lines): hatched, on every panel."""
    for _, gap in gaps:
        first, last = gap.get("first_iteration"), gap.get("last_iteration")
        if isinstance(first, int) and isinstance(last, int):
            for axis in axes:
                axis.axvspan(first - 0.5, last + 0.5, color="red", alpha=0.12, hatch="//", lw=0)


def render(
    series: list[Series],
    title: str,
    plans: list[dict] | None = None,
    gaps: list[tuple[int, dict]] | None = None,
) -> Figure:
    """The four-panel figure (drawn on an Agg canvas; :func:`save_png` writes it); ``gaps``:
    the log's gap lines (attempt, gap), iterations whose records a write failure kept out."""
    by_source = any(line.sources is not None and line.sources.envelopes for line in series)
    recorded = {n for n, _, _ in PANELS if any(line.envelopes[n].recorded for line in series)}
    panels = [p for p in PANELS if p[2] is None or p[0] in recorded]
    rows = len(panels) + by_source
    figure = Figure(figsize=(12, max(11, 2.75 * rows)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    colours = rcParams["axes.prop_cycle"].by_key()["color"]
    _draw_plans(list(axes), plans or [])
    _draw_gaps(list(axes), gaps or [])
    for axis, (name, panel_title, _) in zip(axes, panels):
        axis.set_title(panel_title, loc="left", fontsize=10)
        axis.grid(True, alpha=0.3)
        if name not in recorded:
            axis.text(
                0.5,
                0.5,
                "not recorded",
                transform=axis.transAxes,
                ha="center",
                va="center",
                fontsize=11,
                color="0.4",
            )
            axis.set_yticks([])
        lowest, highest = [], []
        for index, line in enumerate(series):
            colour = colours[index % len(colours)]
            envelope = line.envelopes[name]
            xs, ys = envelope.points()  # NaN: a gap
            if (low := envelope.finite_min()) is not None:
                lowest.append(low)
                highest.append(envelope.finite_max())
            axis.plot(xs, ys, color=colour, linewidth=1.0, label=line.label)
            bad = envelope.bad()
            if len(bad):  # an empty line in axes coordinates collapses the constrained layout
                axis.plot(
                    bad,
                    [0.97] * len(bad),
                    linestyle="none",
                    marker="x",
                    color=colour,
                    markersize=8,
                    transform=axis.get_xaxis_transform(),
                    clip_on=False,
                )
            values = line.marks.get(name, {})
            drawn = set()  # one mark of a kind per envelope column (all of them at demo scale)
            for event in line.candidates:
                column = (event.iteration - envelope.start) // envelope.width
                if event.kind in ("spike", "divergence") and ("|", column) not in drawn:
                    drawn.add(("|", column))
                    axis.axvline(event.iteration, color=colour, linestyle=":", linewidth=1.0)
                value = values.get(event.iteration)
                if name in MARKED_PANELS and _finite(value) and (event.kind, column) not in drawn:
                    drawn.add((event.kind, column))
                    axis.plot(
                        [event.iteration],
                        [value],
                        linestyle="none",
                        marker=MARKERS[event.kind],
                        markersize=9,
                        color=colour,
                        markeredgecolor="black",
                    )
        if name == "grad_norm" and lowest and min(lowest) > 0:
            # Spikes are orders of magnitude; the baseline stays legible.
            log_axis(axis, min(lowest), max(highest))
    skips = draw_update_skips(axes[0], series, colours)
    if by_source:
        plot_sources.draw(axes[-1], series, colours)
    axes[-1].set_xlabel("iteration")
    shown = {e.kind for line in series for e in line.candidates} | {"spike", "divergence"}
    tracker = any(line.source == "ledger" for line in series)
    handles = axes[0].get_legend_handles_labels()[0] + [
        Line2D(
            [],
            [],
            linestyle="none",
            marker=MARKERS[kind],
            color="0.5",
            markeredgecolor="black",
            label=kind if tracker or kind in ("recovered", "rollback") else f"{kind} candidate",
        )
        for kind in MARKERS
        if kind in shown
    ]
    handles.append(
        Line2D([], [], linestyle="none", marker="x", color="0.5", label="NaN/Inf (top edge)")
    )
    if skips:
        label = f"update withheld ({skips}, loss panel's bottom edge)"
        handles.append(Line2D([], [], linestyle="none", marker="D", color="0.5", label=label))
    if gaps:
        handles.append(Patch(color="red", alpha=0.12, hatch="//", label="not logged (gap)"))
    if plans:
        handles += [
            Line2D([], [], color="black", linestyle="--", label="rollback target"),
            Patch(color="0.6", alpha=0.25, label="skipped iterations"),
        ]
    figure.legend(
        handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=9
    )
    missing = [f"{title} ({flag})" for name, title, flag in PANELS if flag and name not in recorded]
    if missing:
        title += "\nnot recorded: " + "; ".join(missing)
    figure.suptitle(title, x=0.01, ha="left", fontsize=11)
    return figure


def save_png(figure: Figure, out: Path) -> None:
    """Write ``figure`` atomically (the plot is often re-run while someone has it open)."""
    atomic_write(out, lambda stream: figure.savefig(stream, format="png"))


def _describe(event: SpikeEvent) -> str:
    return (
        f"  iteration {event.iteration:>8} attempt {event.attempt}: {event.kind} "
        f"(loss {event.loss}, threshold {event.loss_threshold}, grad norm "
        f"{event.grad_norm}, worst DP rank {event.culprit_dp_rank}) - {event.classification}"
    )


def main(argv: list[str] | None = None) -> int:
    """Plot a signals log; 0 written, 1 refused, 2 usage error."""
    parser = build_parser()
    options = parser.parse_args(argv)
    path = Path(options.signals) if options.signals else Path(options.signals_dir) / SIGNALS_FILE
    ledger_path = Path(options.ledger) if options.ledger else path.parent / SPIKE_LEDGER_FILE
    ledger = read_ledger(ledger_path) if ledger_path.is_file() else Ledger()
    recorded = ledger.config(max(ledger.configs)) if ledger.configs else None
    try:
        config = config_from_args(options, base=recorded)
    except ValueError as exc:
        parser.error(str(exc))
    ckpt_dir = options.ckpt_dir or ledger.save_dir()
    plans = read_incidents(ckpt_dir) if ckpt_dir else []
    out = (
        Path(options.out)
        if options.out
        else (path.with_suffix(".png") if options.signals else path.parent / SIGNALS_PLOT_FILE)
    )
    if not path.is_file():
        print(
            f"megatron-ext plot: {path} not found (was the run started with --signals-dir?)",
            file=sys.stderr,
        )
        return 1
    try:
        series, stats = build_series(path, options.attempts, config, ledger, flags_given(options))
        if not stats.records:
            raise ValueError(f"{path} holds no signals records (did the run reach iteration 1?)")
    except ValueError as exc:
        print(f"megatron-ext plot: {exc}", file=sys.stderr)
        return 1
    title = (
        f"{path}  |  {stats.records} records, attempts {sorted(stats.attempts)}, "
        f"iterations {stats.first}-{stats.last}"
    )
    save_png(render(series, title, plans, stats.gaps), out)
    tracked = [e for s in series if s.source == "ledger" for e in s.candidates]
    candidates = [e for s in series if s.source == "replay" for e in s.candidates]
    print(
        f"wrote {out}: {len(series)} line(s), {len(tracked)} tracker event(s) from "
        f"{ledger_path if ledger.configs else 'no ledger'}, {len(plans)} incident plan(s), "
        f"{len(candidates)} spike/divergence candidate(s) replayed with {config}"
    )
    for event in (tracked + candidates)[:MAX_LISTED]:
        print(_describe(event))
    if len(tracked) + len(candidates) > MAX_LISTED:
        print(f"  ... and {len(tracked) + len(candidates) - MAX_LISTED} more (all are marked)")
    for plan in plans:
        print(
            f"  incident {plan['number']}: onset {plan['onset']}, rollback to "
            f"{plan['rollback_to']}, skip window {plan.get('skip_window')}"
        )
    for _, gap in stats.gaps:
        print(f"  logging gap: {Gap(**gap).describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
