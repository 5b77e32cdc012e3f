"""Early warning on synthetic trajectories with the shapes the monitor must tell apart: a
steady climb (warns, once, with a lead), a transient spike and a plateau after a jump (no
warning), healthy noise (none), and log Z drifting down (warns). The real judgement is on the
organic runs (benchmarks/instability.py, BENCHMARKS.md "Instabilities")."""

from __future__ import annotations

import math
import random

from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.spikes.precursors import replay


def _record(i: int, grad: float, log_z: float = 0.0, logit: float | None = None) -> SignalRecord:
    return SignalRecord(
        iteration=i,
        attempt=1,
        job_id="t",
        wall_time=float(i),
        consumed_samples=i,
        skipped_samples=0,
        lm_loss=3.0,
        grad_norm=grad,
        log_z=log_z,
        max_attention_logit=logit,
    )


def _noisy(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [1.0 + rng.gauss(0, 0.1) for _ in range(n)]


def test_healthy_noise_and_a_transient_spike_do_not_warn() -> None:
    grads = _noisy(1500)
    grads[700:703] = [20.0, 15.0, 8.0]  # a transient spike: no precursor, no warning
    assert replay([_record(i + 1, g) for i, g in enumerate(grads)]) == []


def test_a_plateau_after_a_jump_is_not_a_climb() -> None:
    grads = _noisy(1000)
    grads = grads[:600] + [3 * g for g in grads[600:]]  # level shift, flat afterwards
    assert replay([_record(i + 1, g) for i, g in enumerate(grads)]) == []


def test_a_steady_climb_warns_once_long_before_it_blows_up() -> None:
    grads = _noisy(1200)
    # From 600 the grad norm climbs 1% per step (x2 after ~70 steps); it "blows up" at 1000.
    climb = [g * 1.01 ** max(0, i - 600) for i, g in enumerate(grads)]
    warnings = replay([_record(i + 1, g) for i, g in enumerate(climb)])
    assert [w.signal for w in warnings] == ["grad_norm"]
    assert 650 < warnings[0].iteration < 720  # the lead over iteration 1000: ~300 steps
    assert warnings[0].value / warnings[0].reference >= 2.0


def test_log_z_drifting_down_warns_and_the_attention_logit_climb_warns() -> None:
    n = 900
    rng = random.Random(1)
    records = []
    for i in range(n):
        drift = -0.02 * max(0, i - 500)  # log Z falls 0.02 nats per step
        logit = 150.0 * math.exp(0.005 * max(0, i - 400)) + rng.gauss(0, 3.0)
        records.append(_record(i + 1, 1.0 + rng.gauss(0, 0.05), drift + rng.gauss(0, 0.1), logit))
    by_signal = {w.signal: w for w in replay(records)}
    assert set(by_signal) == {"log_z", "max_attention_logit"}
    assert by_signal["log_z"].value < by_signal["log_z"].reference - 5.0
    assert "falling" in by_signal["log_z"].classification
    assert by_signal["max_attention_logit"].iteration < by_signal["log_z"].iteration


def test_an_attention_logit_climbing_below_the_bf16_limit_is_early_training() -> None:
    """Healthy small runs climb steadily from ~0.2 to tens; only past ~100 is it a risk."""
    records = [_record(i + 1, 1.0, 0.0, 0.2 * 1.01**i) for i in range(600)]  # 0.2 -> 78
    assert replay(records) == []
    records += [_record(i + 1, 1.0, 0.0, 0.2 * 1.01**i) for i in range(600, 800)]  # -> 570
    assert [w.signal for w in replay(records)] == ["max_attention_logit"]


def test_skipped_steps_are_not_read() -> None:
    records = [_record(i + 1, g) for i, g in enumerate(_noisy(800))]
    for r in records[600:]:
        r.grad_norm, r.skipped_iter = 100.0, True  # withheld updates: norms of rejected steps
    assert replay(records) == []


def _learning_then_stalling(stall_at: int | None, n: int = 800) -> list[SignalRecord]:
    """The attention logit climbs 0.5 % per step from 150 throughout; the loss falls 0.1 %
    per step (learning: the climb buys loss) until ``stall_at``, then stays (the organic shape
    of ``tests/e2e/test_organic_instability.py`` at lr 0.3)."""
    rng = random.Random(2)
    records = []
    for i in range(n):
        learning = i if stall_at is None else min(i, stall_at)
        record = _record(i + 1, 1.0 + rng.gauss(0, 0.05), 0.0, 150.0 * 1.005**i)
        record.lm_loss = 5.0 * 0.999**learning + rng.gauss(0, 0.005)
        records.append(record)
    return records


def test_a_climb_that_learns_does_not_warn_and_warns_once_the_loss_stalls() -> None:
    """The reference is the lowest point the loss has not improved on since, not the horizon's
    lowest point: the latter lies where the loss was still higher, so a stall after learning
    would never warn."""
    assert replay(_learning_then_stalling(None)) == []
    warnings = replay(_learning_then_stalling(400))
    assert [w.signal for w in warnings] == ["max_attention_logit"]
    assert 400 < warnings[0].iteration < 520  # x1.5 after ~81 steps of the stall
    assert warnings[0].value / warnings[0].reference >= 1.5
