"""``megatron-ext plot``: the signals log as a PNG of panels, with what the tracker did.

    megatron-ext plot --signals-dir runs/7b/signals              # -> runs/7b/signals/signals.png
    megatron-ext plot --signals-dir DIR --attempts latest        # what the run finally trained
    megatron-ext plot --signals FILE.jsonl --attempts 2,3 --out spike.png
    megatron-ext plot --signals-dir DIR --spike-large-rel 0.5    # what those thresholds flag

Panels: LM loss, grad norm (pre-clip), params norm; the max attention logit and log Z when
recorded (the figure names the flags otherwise); each data source's loss, stage changes marked;
per layer (--log-layer-norms), the gradient, weight and update norms, coloured by depth.
``--attempts all`` (default): one line per attempt; ``latest``: what the run finally trained.
Marks: the spike ledger's events of attempts that ran ``--spike-detect`` and the incident plans
of ``megatron-ext skiplist`` (rollback target dashed, skip window shaded; found with
``--ckpt-dir``, default the ledger's ``--save``); for attempts without a ledger, or for all when
a ``--spike-*`` flag is given, a replay of the detector with the run's recorded thresholds
overridden by the flags. Each line keeps per pixel column its first, lowest, highest and last
point, so no spike is averaged away; NaN/Inf are crosses on the top edge, withheld updates
diamonds under the loss, unlogged iterations hatched. Exit status: 0 written, 1 refused, 2
usage error.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

# A bare Figure on an Agg canvas, not pyplot: no display needed on cluster nodes, and no global
# backend switch or figure registry in a process that imports this module.
from matplotlib import colormaps, rcParams
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from megatron_ext.common.files import SIGNALS_FILE, SIGNALS_PLOT_FILE, SPIKE_LEDGER_FILE
from megatron_ext.common.gap_log import Gap
from megatron_ext.common.io import atomic_write
from megatron_ext.common.records.ledger import Ledger, read_incidents, read_ledger
from megatron_ext.common.records.signals import SignalsLog
from megatron_ext.common.records.spike_config import (
    SpikeConfig,
    add_detector_args,
    config_from_args,
    flags_given,
)
from megatron_ext.plot.stream import (
    COLUMNS,
    MARKED_FIELDS,
    MARKERS,
    Envelope,
    Series,
    Stats,
    plan_series,
    stage_changes,
    stream,
)
from megatron_ext.telemetry.layers import layer_order

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
# The per-layer panels (--log-layer-norms), each drawn when some record has it.
LAYER_PANELS = {
    "layer_grad_norms": "grad norm per layer (pre-clip)",
    "layer_param_norms": "weights' norm per layer",
    "layer_update_norms": "update norm per layer",
}
MAX_LAYER_LABELS = 12  # more layers: only the first, middle and last are named
MAX_LISTED = 20  # candidates printed; a run stuck at NaN has one per iteration


# Round log-axis labels: matplotlib labels only powers of ten, and a healthy grad norm stays
# within one decade; the 1-2-5 series first, then 1, 1.5, 2, 3, 5, 7, then even spacing.
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


def log_axis(axis: Any, envelopes: list[Envelope]) -> None:
    """A log y axis with the ticks of :func:`log_ticks` when every value drawn is positive
    (norms span orders of magnitude)."""
    drawn = [e for e in envelopes if e.finite_min() is not None]
    low = min((e.finite_min() for e in drawn), default=0.0)
    if low <= 0:
        return
    high = max(e.finite_max() for e in drawn)
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
        _edge_marks(axis, iterations, 0.03, "D", 5, colours[index % len(colours)])
    return total


def _edge_marks(axis: Any, xs: Any, height: float, marker: str, size: int, colour: str) -> None:
    """Marks at ``height`` of the panel (axes coordinates): values with no height."""
    axis.plot(
        xs,
        [height] * len(xs),
        linestyle="none",
        marker=marker,
        markersize=size,
        color=colour,
        transform=axis.get_xaxis_transform(),
        clip_on=False,
    )


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
    """The lines to draw and their marks, from one pass over the log at ``path`` (ValueError
    on a bad spec or a log out of order): the ledger's events for an attempt that ran the
    tracker, unless ``replay``; else a replay of the detector with ``config``."""
    with SignalsLog(path) as log:
        lines = plan_series(log, attempts, config, ledger or Ledger(), replay, columns)
        return lines, stream(log, lines)


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


def _not_recorded(axis, text: str = "not recorded") -> None:
    axis.text(
        0.5, 0.5, text, transform=axis.transAxes, ha="center", va="center", fontsize=11, color="0.4"
    )
    axis.set_yticks([])


def _draw_marks(axis, name: str, line: Series, colour: str) -> None:
    """The line's spike and divergence candidates (dotted) and event marks, one of a kind per
    envelope column (all of them at demo scale)."""
    envelope, values, drawn = line.envelopes[name], line.marks.get(name, {}), set()
    for event in line.candidates:
        column = (event.iteration - envelope.start) // envelope.width
        if event.kind in ("spike", "divergence") and ("|", column) not in drawn:
            drawn.add(("|", column))
            axis.axvline(event.iteration, color=colour, linestyle=":", linewidth=1.0)
        value = values.get(event.iteration)
        finite = value is not None and math.isfinite(value)
        if name in MARKED_FIELDS and finite and (event.kind, column) not in drawn:
            drawn.add((event.kind, column))
            axis.plot(
                [event.iteration],
                [value],
                linestyle="none",
                markersize=9,
                color=colour,
                marker=MARKERS[event.kind],
                markeredgecolor="black",
            )


def _draw_panel(axis, name: str, series: list[Series], colours: list[str]) -> None:
    """One panel: each line's envelope, its non-finite values on the top edge, its marks."""
    for index, line in enumerate(series):
        colour = colours[index % len(colours)]
        envelope = line.envelopes[name]
        xs, ys = envelope.points()  # NaN: a gap
        axis.plot(xs, ys, color=colour, linewidth=1.0, label=line.label)
        bad = envelope.bad()
        if len(bad):  # an empty line in axes coordinates collapses the constrained layout
            _edge_marks(axis, bad, 0.97, "x", 8, colour)
        _draw_marks(axis, name, line, colour)
    if name == "grad_norm":  # spikes are orders of magnitude
        log_axis(axis, [line.envelopes[name] for line in series])


def _handles(axis, series: list[Series], skips: int, gaps: list, plans: list) -> list:
    """The figure legend: the lines, the kinds of marks shown, and what else is drawn."""
    shown = {e.kind for line in series for e in line.candidates} | {"spike", "divergence"}
    tracker = any(line.source == "ledger" for line in series)

    def marker(label: str, **style) -> Line2D:
        return Line2D([], [], linestyle="none", color="0.5", label=label, **style)

    handles = axis.get_legend_handles_labels()[0] + [
        marker(
            kind if tracker or kind in ("recovered", "rollback") else f"{kind} candidate",
            marker=MARKERS[kind],
            markeredgecolor="black",
        )
        for kind in MARKERS
        if kind in shown
    ]
    handles.append(marker("NaN/Inf (top edge)", marker="x"))
    if skips:
        handles.append(marker(f"update withheld ({skips}, loss panel's bottom edge)", marker="D"))
    if gaps:
        handles.append(Patch(color="red", alpha=0.12, hatch="//", label="not logged (gap)"))
    if plans:
        handles += [
            Line2D([], [], color="black", linestyle="--", label="rollback target"),
            Patch(color="0.6", alpha=0.25, label="skipped iterations"),
        ]
    return handles


def render(
    series: list[Series],
    title: str,
    plans: list[dict] | None = None,
    gaps: list[tuple[int, dict]] | None = None,
) -> Figure:
    """The panels' figure (drawn on an Agg canvas; ``savefig`` writes it); ``gaps``:
    the log's gap lines (attempt, gap), iterations whose records a write failure kept out."""
    by_source = any(line.sources.envelopes for line in series)
    recorded = {n for n, _, _ in PANELS if any(line.envelopes[n].recorded for line in series)}
    panels = [p for p in PANELS if p[2] is None or p[0] in recorded]
    by_layer = [f for f in LAYER_PANELS if any(line.layers.get(f) for line in series)]
    rows = len(panels) + by_source + len(by_layer)
    figure = Figure(figsize=(12, max(11, 2.75 * rows)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    colours = rcParams["axes.prop_cycle"].by_key()["color"]
    titles = [t for _, t, _ in panels] + ["LM loss by data source"] * by_source
    for axis, panel_title in zip(axes, titles + [LAYER_PANELS[f] for f in by_layer]):
        axis.set_title(panel_title, loc="left", fontsize=10)
        axis.grid(True, alpha=0.3)
    _draw_plans(list(axes), plans or [])
    _draw_gaps(list(axes), gaps or [])
    for axis, (name, _, _) in zip(axes, panels):
        if name not in recorded:
            _not_recorded(axis)
        _draw_panel(axis, name, series, colours)
    skips = draw_update_skips(axes[0], series, colours)
    if by_source:
        _draw_sources(axes[len(panels)], series, colours)
    for axis, name in zip(axes[len(panels) + by_source :], by_layer):
        _draw_layers(axis, name, series)
    axes[-1].set_xlabel("iteration")
    handles = _handles(axes[0], series, skips, gaps or [], plans or [])
    figure.legend(
        handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=9
    )
    missing = [f"{title} ({flag})" for name, title, flag in PANELS if flag and name not in recorded]
    if missing:
        title += "\nnot recorded: " + "; ".join(missing)
    figure.suptitle(title, x=0.01, ha="left", fontsize=11)
    return figure


def _draw_sources(axis, lines: list, colours: list[str]) -> None:
    """The panel: each member of each line, stage changes as dash-dotted lines."""
    drawn = False
    for index, line in enumerate(lines):
        for number, (name, envelope) in enumerate(sorted(line.sources.envelopes.items())):
            xs, ys = envelope.points()
            label = name if len(lines) == 1 else f"{line.label}: {name}"
            colour = colours[(index + number) % len(colours)]
            axis.plot(xs, ys, color=colour, linewidth=1.0, label=label)
            drawn = True
        for first, label in stage_changes(line.pieces, line.sources.mixtures):
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
        _not_recorded(axis, "not recorded (a blend run with --signals-dir records it)")


def _draw_layers(axis, name: str, lines: list[Series]) -> None:
    """One per-layer panel: a line per layer entry, coloured by depth (viridis)."""
    cmap = colormaps["viridis"]
    for line in lines:
        layers = sorted(line.layers.get(name, {}).items(), key=lambda item: layer_order(item[0]))
        named = {0, len(layers) // 2, len(layers) - 1}
        for index, (layer, envelope) in enumerate(layers):
            xs, ys = envelope.points()
            shown = len(layers) <= MAX_LAYER_LABELS or index in named
            label = (layer if len(lines) == 1 else f"{line.label}: {layer}") if shown else None
            colour = cmap(index / max(1, len(layers) - 1))
            axis.plot(xs, ys, color=colour, linewidth=0.9, label=label)
    log_axis(axis, [e for line in lines for e in line.layers.get(name, {}).values()])
    axis.legend(loc="upper right", fontsize=7, ncols=2)


def _check_paths(path: Path, ledger_path: Path, out: Path) -> None:
    """ValueError for a log that is not there, or an ``--out`` that would replace a log (a PNG
    over the run's record) or is a folder."""
    if not path.is_file():
        raise ValueError(f"{path} not found (was the run started with --signals-dir?)")
    if out.resolve() in (path.resolve(), ledger_path.resolve()):
        raise ValueError(f"--out {out} is a log this plot reads; name a .png file")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name a .png file in it")


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
    default_out = path.with_suffix(".png") if options.signals else path.parent / SIGNALS_PLOT_FILE
    out = Path(options.out) if options.out else default_out
    try:
        _check_paths(path, ledger_path, out)
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
    figure = render(series, title, plans, stats.gaps)  # atomically: someone may have it open
    try:
        atomic_write(out, lambda stream: figure.savefig(stream, format="png"))
    except OSError as exc:
        print(
            f"megatron-ext plot: cannot write {out} ({exc.strerror or exc}); choose another "
            "--out or fix its folder's permissions",
            file=sys.stderr,
        )
        return 1
    tracked = [e for s in series if s.source == "ledger" for e in s.candidates]
    candidates = [e for s in series if s.source == "replay" for e in s.candidates]
    print(
        f"wrote {out}: {len(series)} line(s), {len(tracked)} tracker event(s) from "
        f"{ledger_path if ledger.configs else 'no ledger'}, {len(plans)} incident plan(s), "
        f"{len(candidates)} spike/divergence candidate(s) replayed with {config}"
    )
    for event in (tracked + candidates)[:MAX_LISTED]:
        print(
            f"  iteration {event.iteration:>8} attempt {event.attempt}: {event.kind} "
            f"(loss {event.loss}, threshold {event.loss_threshold}, grad norm "
            f"{event.grad_norm}, worst DP rank {event.culprit_dp_rank}) - {event.classification}"
        )
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
