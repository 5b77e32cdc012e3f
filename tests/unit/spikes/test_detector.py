"""The streaming spike detector's rules on synthetic curves (real curves: test_detector_curves)."""

from __future__ import annotations

import pytest

from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.spikes.detector import SpikeDetector, replay
from tests.support.spike_curves import CONFIG
from tests.support.spike_curves import events as _events
from tests.support.spike_curves import records as _records


def _kinds(events) -> list[tuple[str, int, int]]:
    return [(e.kind, e.iteration, e.onset) for e in events]


def test_transient_spike_is_logged_and_recovers() -> None:
    events = _events(_records(80, {50: (5.0, 6.0), 51: (4.0, 3.5)}))
    assert _kinds(events) == [("spike", 50, 50), ("recovered", 52, 50)]
    assert events[0].culprit_dp_rank == 0 and events[0].loss_threshold < 5.0
    assert events[0].classification == "large loss jump"
    assert len(events[0].window) == CONFIG.context and events[0].window[-1]["iteration"] == 50


def test_unrecovered_spike_requests_a_rollback_after_patience() -> None:
    stuck = {i: (5.0, 6.0 if i == 50 else 1.0) for i in range(50, 80)}
    events = _events(_records(80, stuck))
    assert _kinds(events) == [("spike", 50, 50), ("rollback", 55, 50)]
    assert events[1].classification == "large loss jump; not recovered"


def test_a_large_jump_is_flagged_on_the_loss_alone() -> None:
    # +50 % with the grad norm unchanged (a log without grad corroboration, e.g. tr1-13B).
    assert _kinds(_events(_records(60, {40: (4.5, 1.0)})))[:1] == [("spike", 40, 40)]


@pytest.mark.parametrize(("grad", "flagged"), [(0.0, False), (0.8, False), (1.2, True)])
def test_a_moderate_jump_needs_the_grad_norm(grad: float, flagged: bool) -> None:
    grad = max(1.0, grad * CONFIG.grad_factor)  # x grad_factor of the baseline (~1.0)
    events = _events(_records(60, {40: (3.45, grad)}))  # +15 %: moderate, not large
    assert (_kinds(events)[:1] == [("spike", 40, 40)]) is flagged
    if not flagged:
        assert events == []


def test_a_skipped_step_corroborates_and_its_stale_grad_is_not_learned() -> None:
    records = _records(60, {40: (3.45, 1.0)})
    records[39].skipped_iter = True  # fp16 overflow: the log re-prints a grad norm
    assert _kinds(_events(records))[:1] == [("spike", 40, 40)]
    assert "skipped" in _events(records)[0].classification
    stale = _records(60)
    for r in stale[30:39]:
        r.skipped_iter, r.grad_norm = True, 100.0  # a stale, huge re-printed grad norm
    detector = SpikeDetector(CONFIG)
    for r in stale:
        detector.observe(r)
    assert detector.grad.median() < 1.5


def test_a_loss_scale_drop_is_a_skipped_step() -> None:
    records = _records(60, {40: (3.45, 1.0)})
    for r in records:
        r.loss_scale = 65536.0
    records[39].loss_scale = 32768.0  # the scaler backed off: an overflow, though not counted
    assert _kinds(_events(records))[:1] == [("spike", 40, 40)]


def test_a_streak_of_skipped_iterations_starts_an_incident() -> None:
    records = _records(60)
    for r in records[39 : 39 + CONFIG.skip_streak]:
        r.skipped_iter = True
    events = _events(records)
    flag = 40 + CONFIG.skip_streak - 1
    assert _kinds(events)[:1] == [("spike", flag, 40)]


def test_one_rank_jumping_over_the_average_is_flagged_with_its_rank() -> None:
    records = _records(60)
    for r in records:
        r.max_local_loss, r.max_loss_dp_rank = r.lm_loss + 0.05, 0
    records[39].lm_loss += 0.1  # the DP average barely moves (one rank of many)
    records[39].max_local_loss, records[39].max_loss_dp_rank = records[39].lm_loss + 3.0, 5
    events = _events(records)
    assert _kinds(events)[:1] == [("spike", 40, 40)]
    assert events[0].culprit_dp_rank == 5 and "one DP rank" in events[0].classification


def test_every_rank_rising_together_is_not_one_ranks_trouble() -> None:
    records = _records(60, {40: (3.45, 1.0)})  # moderate, no grad corroboration
    for r in records:
        r.max_local_loss = r.lm_loss + 0.05  # the worst rank tracks the average
    assert _events(records) == []


def test_recovery_needs_the_grad_norm_back_too() -> None:
    # BLOOM 176B's shape: the loss is back a step later while the grad norm is still x60.
    spike = {50: (5.0, 6.0), 51: (3.0, 60.0), 52: (3.0, 30.0)}
    assert _kinds(_events(_records(80, spike))) == [("spike", 50, 50), ("recovered", 53, 50)]


def test_non_finite_loss_is_divergence_and_rollback_at_once() -> None:
    events = _events(_records(40, {30: (float("nan"), 1.0)}))
    assert [(e.kind, e.iteration) for e in events] == [("divergence", 30), ("rollback", 30)]


def test_slow_moderate_drift_without_corroboration_is_divergence() -> None:
    drift = {i: (3.6, 1.0) for i in range(40, 60)}  # +20 %: moderate, never corroborated
    assert _kinds(_events(_records(60, drift))) == [("divergence", 44, 40), ("rollback", 44, 40)]


def test_not_armed_during_warmup_and_noise_is_not_a_spike() -> None:
    assert _events(_records(15, {10: (9.0, 9.0)})) == []
    assert _events(_records(2000, seed=3)) == []


def test_the_replay_goes_on_after_a_rollback() -> None:
    stuck = {i: (5.0, 6.0) for i in range(50, 60)}
    kinds = [e.kind for e in replay(_records(100, {**stuck, 80: (6.0, 9.0)}), CONFIG)]
    # Flagged again right after the rollback (the same bad stretch), then the spike at 80.
    assert kinds == ["spike", "rollback", "spike", "recovered", "spike", "recovered"]


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="grad_factor > 1"):
        SpikeConfig(grad_factor=1.0)
    with pytest.raises(ValueError, match="warmup >= window/2"):
        SpikeConfig(window=100, warmup=10)
    with pytest.raises(ValueError, match="large jump must be at least a moderate one"):
        SpikeConfig(loss_rel=0.4, large_rel=0.3)
