"""`megatron-ext plot` past demo scale: decimated columns that keep every spike and NaN, one
read of the log, memory that does not grow with it."""

from __future__ import annotations

import math
import random
import tracemalloc
from pathlib import Path

import pytest

from megatron_ext.common.records import signals
from megatron_ext.common.records.ledger import Ledger
from megatron_ext.common.records.signals import (
    SignalRecord,
    SignalsLog,
    SignalsWriter,
    read_signals,
)
from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.plot import stream as plot_stream
from megatron_ext.plot.draw import build_series, render
from megatron_ext.spikes.detector import replay
from tests.support.default_run import SOURCE, lines

CONFIG = SpikeConfig(window=20, warmup=20, patience=5)


def _log(directory: Path, length: int, seed: int = 0) -> tuple[Path, dict[int, float]]:
    """Two attempts (a restart 500 back); spikes, NaN and Inf at random iterations, a stretch
    without grad norms; returns the log and attempt 2's grad norms (None left out)."""
    rng = random.Random(seed)
    spikes = set(rng.sample(range(100, length), length // 150))
    bad = {i: rng.choice([math.nan, math.inf, -math.inf]) for i in rng.sample(range(length), 15)}
    grads = {}
    for first, last in ((1, length - 200), (length - 700, length)):
        writer = SignalsWriter(directory)
        for i in range(first, last + 1):
            grad = 1.0 + rng.gauss(0, 0.05) + (rng.uniform(20, 60) if i in spikes else 0.0)
            grad = bad.get(i, grad)
            grad = None if 3000 <= i < 3100 else grad
            if writer.attempt == 2 and grad is not None:
                grads[i] = grad
            writer.write(
                SignalRecord(
                    iteration=i,
                    attempt=0,
                    job_id="j",
                    wall_time=float(i),
                    consumed_samples=8 * i,
                    skipped_samples=0,
                    lm_loss=3.0 + rng.gauss(0, 0.01),
                    grad_norm=grad,
                )
            )
    return writer.path, grads


def test_every_column_keeps_its_first_lowest_highest_last_and_its_non_finite(
    tmp_path: Path,
) -> None:
    path, grads = _log(tmp_path, 6000)
    lines, stats = build_series(path, "2", CONFIG, columns=100)
    envelope = lines[0].envelopes["grad_norm"]
    assert envelope.width == 60 and stats.records == 6000 - 200 + 701
    xs, ys = envelope.points()
    assert len(xs) <= 4 * 100 + 15  # bounded by the columns, not by the log
    kept = dict(zip(xs.tolist(), ys.tolist()))
    columns: dict[int, list[tuple[int, float]]] = {}
    for i, g in grads.items():
        columns.setdefault((i - envelope.start) // 60, []).append((i, g))
    for points in columns.values():
        finite = [(i, g) for i, g in points if math.isfinite(g)]
        if finite:
            low, high = min(finite, key=lambda p: p[1]), max(finite, key=lambda p: p[1])
            for i, g in (finite[0], low, high, finite[-1]):
                assert kept[i] == g  # every spike is some column's highest point
        non_finite = [i for i, g in points if not math.isfinite(g)]
        if non_finite:  # drawn as a break and a cross
            assert non_finite[0] in envelope.bad().tolist() and math.isnan(kept[non_finite[0]])
    assert envelope.recorded == len(grads)
    assert envelope.finite_min() == min(g for g in grads.values() if math.isfinite(g))


def test_the_log_is_read_once_on_the_fast_path(tmp_path: Path) -> None:
    path, _ = _log(tmp_path, 3000)
    with SignalsLog(path) as log:
        lines = plot_stream.plan_series(log, "all", CONFIG, Ledger(), False, 100)
        plot_stream.stream(log, lines)
        assert log.bytes_read < 1.25 * log.size  # once, and the probes and primes
    assert lines[0].records == 2800 and lines[1].records == 701


def _peak(path: Path) -> int:
    tracemalloc.start()
    try:
        build_series(path, "all", CONFIG, columns=100)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plot_stream, "READ_BLOCK", 1 << 16)
    short, _ = _log(tmp_path / "short", 2000)
    long, _ = _log(tmp_path / "long", 8000)
    # Holding the records (the old plot) makes it ~4x; columns and blocks keep it flat.
    assert _peak(long) < 1.5 * _peak(short)


def test_a_gap_line_is_drawn_as_a_missing_stretch(tmp_path: Path) -> None:
    path, _ = _log(tmp_path, 1000)
    with open(path, "a") as handle:  # what a full disk leaves, once writing works again
        handle.write('{"gap": {"first_iteration": 1001, "last_iteration": 1020}}\n')
    lines, stats = build_series(path, "all", CONFIG)
    assert stats.gaps == [(2, {"first_iteration": 1001, "last_iteration": 1020})]
    figure = render(lines, "t", None, stats.gaps)
    for axis in figure.axes:
        assert [(p.get_x(), p.get_width()) for p in axis.patches] == [(1000.5, 20)]


def _default_run_log(directory: Path, length: int) -> Path:
    """What a default run writes (tests/support/default_run.py: the demo's own record, one
    source, no ledger), a falling loss with two spikes."""
    rng = random.Random(length)
    directory.mkdir(parents=True)

    def moving():
        for i in range(1, length + 1):
            loss = 2.0 + 3.0 / (1 + i / 1000) + rng.gauss(0, 0.02)
            loss += 3.0 if i in (length // 2, length - 300) else 0.0
            yield {
                "iteration": i,
                "attempt": 1,
                "wall_time": 1.7e9 + i,
                "consumed_samples": 8 * i,
                "lm_loss": loss,
                "max_local_loss": loss,
                "grad_norm": 1.0 + rng.gauss(0, 0.05),
                "params_norm": 20.0 + i * 1e-5,
                "lr": 3e-4,
                "source_loss": loss,
            }

    path = directory / "signals.jsonl"
    path.write_text("".join(lines(moving())))
    return path


def test_a_default_run_s_log_costs_no_python_call_per_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's 38 s: two json.loads per line for the per-source fields and a detector
    call per record. On logs 4x apart the detector observes the same few records, no line
    goes through json.loads, and the replay's events are the full replay's."""
    monkeypatch.setattr(signals, "_json_block", None)  # the json.loads path: not taken
    observed = {}
    for length in (8000, 32000):
        path = _default_run_log(tmp_path / str(length), length)
        (line,), stats = build_series(path, "all", SpikeConfig(), columns=100)
        assert stats.records == length and stats.slow_lines == 0
        assert line.sources is not None and list(line.sources.envelopes) == [SOURCE]
        expected = [e for e in replay(read_signals(path), SpikeConfig()) if e.kind == "spike"]
        assert [e.as_json() for e in line.candidates] == [e.as_json() for e in expected]
        assert len(expected) == 2
        observed[length] = line.detector.observed
    assert observed[32000] <= observed[8000] + 200 and observed[8000] < 1000, observed
