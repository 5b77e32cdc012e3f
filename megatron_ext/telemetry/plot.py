"""``megatron-ext plot``: the signals log as a four-panel PNG with the spike candidates marked.

    megatron-ext plot --signals-dir runs/7b/signals              # -> runs/7b/signals/signals.png
    megatron-ext plot --signals-dir DIR --attempts latest        # what the run finally trained
    megatron-ext plot --signals FILE.jsonl --attempts 2,3 --out spike.png

Panels: LM loss, grad norm (pre-clip), params norm, max attention logit. With ``--attempts all``
(the default) every attempt (launch, requeue, rollback) is its own coloured line, so a replay
after a rollback is seen next to what it replaced; ``latest`` plots one line, the latest attempt
per iteration. Spike and divergence candidates come from the same detector training runs
(:func:`megatron_ext.spikes.detector.spike_candidates`), with the same ``--spike-*`` flags,
so the picture shows what training would have flagged with those thresholds. Non-finite
values (NaN/Inf) are drawn as crosses on the panel's top edge, since they have no height.
Exit status: 0 written, 1 refused (the message says why), 2 usage error.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

# A bare Figure on an Agg canvas, not pyplot: no display needed on cluster nodes, and no global
# backend switch or figure registry in a process that imports this module.
from matplotlib import rcParams
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from megatron_ext.files import SIGNALS_FILE, SIGNALS_PLOT_FILE
from megatron_ext.io import atomic_write
from megatron_ext.spikes.config import SpikeConfig, add_detector_args, config_from_args
from megatron_ext.spikes.detector import SpikeEvent, spike_candidates
from megatron_ext.telemetry.signals import SignalRecord, latest_per_iteration, read_signals

# (record field, panel title, the note shown when no iteration recorded it)
PANELS: tuple[tuple[str, str, str], ...] = (
    ("lm_loss", "LM loss", "not recorded"),
    ("grad_norm", "grad norm (pre-clip)", "not recorded"),
    ("params_norm", "params norm", "not recorded"),
    (
        "max_attention_logit",
        "max attention logit",
        "not recorded (enable --log-max-attention-logit)",
    ),
)
MARKERS = {"spike": "^", "divergence": "X"}
MARKED_PANELS = {"lm_loss", "grad_norm"}  # what the detector reads; other panels get the line
MAX_LISTED = 20  # candidates printed; a run stuck at NaN has one per iteration


@dataclass
class Series:
    """One line per panel: an attempt (or the latest-per-iteration view) and its candidates."""

    label: str
    records: list[SignalRecord]  # sorted by iteration, one per iteration
    candidates: list[SpikeEvent]


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
    add_detector_args(parser.add_argument_group("spike detector (as the training-time tracker)"))
    return parser


def build_series(records: list[SignalRecord], attempts: str, config: SpikeConfig) -> list[Series]:
    """The lines to draw and the candidates to mark on them (raises ValueError on a bad spec).

    An attempt that starts mid-run (requeue, rollback) resumed the timeline of the attempts
    before it, so its detector is first fed their latest records before its first iteration:
    it is armed as the training-time tracker was, instead of re-learning a baseline from the
    restart on. Only candidates inside the attempt itself are kept.
    """
    if attempts == "latest":
        latest = latest_per_iteration(records)
        return [Series("latest per iteration", latest, spike_candidates(latest, config))]
    present = sorted({r.attempt for r in records})
    if attempts == "all":
        chosen = present
    else:
        try:
            chosen = sorted({int(a) for a in attempts.split(",")})
        except ValueError:
            raise ValueError(f"--attempts takes all, latest or N[,M], got {attempts!r}") from None
        missing = [a for a in chosen if a not in present]
        if missing:
            raise ValueError(f"no attempt {missing} in the log (attempts present: {present})")
    series = []
    for attempt in chosen:
        own = latest_per_iteration([r for r in records if r.attempt == attempt])
        history = latest_per_iteration(
            [r for r in records if r.attempt < attempt and r.iteration < own[0].iteration]
        )
        found = spike_candidates(history + own, config)
        series.append(Series(f"attempt {attempt}", own, [e for e in found if e.attempt == attempt]))
    return series


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def render(series: list[Series], title: str) -> Figure:
    """The four-panel figure (drawn on an Agg canvas; :func:`save_png` writes it)."""
    figure = Figure(figsize=(12, 11), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(PANELS), 1, sharex=True)
    colours = rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (name, panel_title, missing) in zip(axes, PANELS):
        axis.set_title(panel_title, loc="left", fontsize=10)
        axis.grid(True, alpha=0.3)
        if all(getattr(r, name) is None for line in series for r in line.records):
            axis.text(
                0.5,
                0.5,
                missing,
                transform=axis.transAxes,
                ha="center",
                va="center",
                fontsize=11,
                color="0.4",
            )
            axis.set_yticks([])
        finite_values = []
        for index, line in enumerate(series):
            colour = colours[index % len(colours)]
            points = [
                (r.iteration, getattr(r, name))
                for r in line.records
                if getattr(r, name) is not None
            ]
            xs = [i for i, _ in points]
            ys = [v if math.isfinite(v) else math.nan for _, v in points]  # NaN: a gap
            finite_values += [v for v in ys if math.isfinite(v)]
            axis.plot(xs, ys, color=colour, linewidth=1.0, label=line.label)
            bad = [i for i, v in points if not math.isfinite(v)]
            if bad:  # an empty line in axes coordinates collapses the constrained layout
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
            values = dict(points)
            for event in line.candidates:
                axis.axvline(event.iteration, color=colour, linestyle=":", linewidth=1.0)
                value = values.get(event.iteration)
                if name in MARKED_PANELS and _finite(value):
                    axis.plot(
                        [event.iteration],
                        [value],
                        linestyle="none",
                        marker=MARKERS[event.kind],
                        markersize=9,
                        color=colour,
                        markeredgecolor="black",
                    )
        if name == "grad_norm" and finite_values and min(finite_values) > 0:
            axis.set_yscale("log")  # spikes are orders of magnitude; the baseline stays legible
    axes[-1].set_xlabel("iteration")
    handles = axes[0].get_legend_handles_labels()[0] + [
        Line2D(
            [],
            [],
            linestyle="none",
            marker=MARKERS["spike"],
            color="0.5",
            markeredgecolor="black",
            label="spike candidate",
        ),
        Line2D(
            [],
            [],
            linestyle="none",
            marker=MARKERS["divergence"],
            color="0.5",
            markeredgecolor="black",
            label="divergence candidate",
        ),
        Line2D([], [], linestyle="none", marker="x", color="0.5", label="NaN/Inf (top edge)"),
    ]
    figure.legend(
        handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=9
    )
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
    try:
        config = config_from_args(options)
    except ValueError as exc:
        parser.error(str(exc))
    path = Path(options.signals) if options.signals else Path(options.signals_dir) / SIGNALS_FILE
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
        records = read_signals(path)
        if not records:
            raise ValueError(f"{path} holds no signals records (did the run reach iteration 1?)")
        series = build_series(records, options.attempts, config)
    except ValueError as exc:
        print(f"megatron-ext plot: {exc}", file=sys.stderr)
        return 1
    attempts = sorted({r.attempt for r in records})
    title = (
        f"{path}  |  {len(records)} records, attempts {attempts}, "
        f"iterations {min(r.iteration for r in records)}-"
        f"{max(r.iteration for r in records)}"
    )
    save_png(render(series, title), out)
    candidates = [e for s in series for e in s.candidates]
    print(f"wrote {out}: {len(series)} line(s), {len(candidates)} spike/divergence candidate(s)")
    for event in candidates[:MAX_LISTED]:
        print(_describe(event))
    if len(candidates) > MAX_LISTED:
        print(f"  ... and {len(candidates) - MAX_LISTED} more (all are marked on the plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
