"""The streaming spike detector on synthetic curves (real curves: benchmarks/detector.py)."""

from __future__ import annotations

import pytest

from megatron_ext.spikes.detector import SpikeConfig

from spike_curves import CONFIG
from spike_curves import events as _events
from spike_curves import records as _records


def test_transient_spike_is_logged_and_recovers() -> None:
    events = _events(_records(80, {50: (5.0, 6.0), 51: (4.0, 3.5)}))
    assert [(e.kind, e.iteration, e.onset) for e in events] == [
        ("spike", 50, 50),
        ("recovered", 52, 50),
    ]
    assert events[0].culprit_dp_rank == 0 and events[0].loss_threshold < 5.0
    assert len(events[0].window) == CONFIG.context and events[0].window[-1]["iteration"] == 50


def test_unrecovered_spike_requests_a_rollback_after_patience() -> None:
    stuck = {i: (5.0, 6.0 if i == 50 else 1.0) for i in range(50, 80)}
    events = _events(_records(80, stuck))
    assert [(e.kind, e.iteration, e.onset) for e in events] == [
        ("spike", 50, 50),
        ("rollback", 55, 50),
    ]


def test_non_finite_loss_is_divergence_and_rollback_at_once() -> None:
    events = _events(_records(40, {30: (float("nan"), 1.0)}))
    assert [(e.kind, e.iteration) for e in events] == [("divergence", 30), ("rollback", 30)]


def test_slow_drift_without_grad_corroboration_is_divergence() -> None:
    drift = {i: (4.0, 1.0) for i in range(40, 60)}
    events = _events(_records(60, drift))
    assert [(e.kind, e.iteration, e.onset) for e in events] == [
        ("divergence", 44, 40),
        ("rollback", 44, 40),
    ]


def test_not_armed_during_warmup_and_noise_is_not_a_spike() -> None:
    assert _events(_records(15, {10: (9.0, 9.0)})) == []
    assert _events(_records(2000, seed=3)) == []


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="grad_factor > 1"):
        SpikeConfig(grad_factor=1.0)
    with pytest.raises(ValueError, match="warmup >= window/2"):
        SpikeConfig(window=100, warmup=10)


# -- planner -------------------------------------------------------------------------------------


# -- skip ranges ---------------------------------------------------------------------------------


# -- the drill in the real loop --------------------------------------------------------------------
