"""The detector's per-source baselines on blend records (lm_loss_by_dataset): a mixture change
is no spike, a small-share bad source is one, a moderate jump of the average is corroborated
by one source's own jump. Each case also runs with per-source baselines off, which gets it
wrong, so the tests fail if the per-source path stops working."""

from __future__ import annotations

import random

from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.spikes.detector import SpikeDetector, replay

TOKENS = 4096
CONFIG = SpikeConfig(window=20, warmup=20, patience=5)


def _record(i: int, shares: dict[str, float], losses: dict[str, float]) -> SignalRecord:
    tokens = {n: round(TOKENS * s) for n, s in shares.items()}
    mean = sum(losses[n] * t for n, t in tokens.items()) / sum(tokens.values())
    return SignalRecord(
        iteration=i,
        attempt=1,
        job_id="t",
        wall_time=0.0,
        consumed_samples=8 * i,
        skipped_samples=0,
        lm_loss=mean,
        grad_norm=1.0 + 0.01 * (i % 3),
        lm_loss_by_dataset={n: losses[n] for n, t in tokens.items() if t},
        tokens_by_dataset=tokens,
    )


def _run(
    iterations: int,
    shares: callable,
    bad: callable = lambda i: 1.0,
    seed: int = 0,
) -> list[SignalRecord]:
    """prose ~2.0 and code ~3.0 (their own noise), code times ``bad(i)``."""
    rng = random.Random(seed)
    return [
        _record(
            i,
            shares(i),
            {"prose": 2.0 + rng.gauss(0, 0.01), "code": (3.0 + rng.gauss(0, 0.015)) * bad(i)},
        )
        for i in range(1, iterations + 1)
    ]


def _off() -> SpikeConfig:
    return SpikeConfig(**{**CONFIG.as_json(), "per_source": False})


def test_a_mixture_change_moves_the_average_but_starts_no_incident() -> None:
    # Stage change at 60: prose 90% -> 10%; the average goes 2.1 -> 2.9 (+38%).
    records = _run(
        100, lambda i: {"prose": 0.9, "code": 0.1} if i < 60 else {"prose": 0.1, "code": 0.9}
    )
    assert records[70].lm_loss > 1.3 * records[50].lm_loss
    assert replay(records, CONFIG) == []
    # The per-source baselines did not move: each member's median is its own loss.
    detector = SpikeDetector(CONFIG)
    for record in records:
        detector.observe(record)
    assert abs(detector.sources.median("prose") - 2.0) < 0.02
    assert abs(detector.sources.median("code") - 3.0) < 0.03
    # Judged on the average alone, the same change is a large jump: the test can fail.
    assert [e.kind for e in replay(records, _off())][:1] == ["spike"]


def test_a_small_share_bad_source_starts_an_incident_and_is_named() -> None:
    # code at 10% jumps +60% from 70 on: the average moves +7%, under the 10% threshold.
    records = _run(
        100, lambda i: {"prose": 0.9, "code": 0.1}, bad=lambda i: 1.6 if i >= 70 else 1.0
    )
    assert records[75].lm_loss < 1.1 * records[60].lm_loss
    events = replay(records, CONFIG)
    assert events and events[0].kind == "spike"
    assert events[0].onset == 70 and events[0].culprit_source == "code"
    assert "source code" in events[0].classification
    assert events[0].source_loss > 4.5 and abs(events[0].source_baseline - 3.0) < 0.05
    assert [e.kind for e in events][:2] == ["spike", "rollback"]  # it does not recover
    assert events[1].culprit_source == "code"
    assert replay(records, _off()) == []  # hidden in the average without per-source baselines


def test_a_moderate_jump_of_the_average_is_corroborated_by_one_source() -> None:
    # code at 50% jumps +20% (under a large jump): the average +12%, moderate; the grad norm
    # stays flat.
    records = _run(
        100, lambda i: {"prose": 0.5, "code": 0.5}, bad=lambda i: 1.2 if 70 <= i < 72 else 1.0
    )
    events = replay(records, CONFIG)
    assert [e.kind for e in events] == ["spike", "recovered"]
    assert events[0].iteration == 70 and events[0].culprit_source == "code"
    assert events[0].classification == "loss jump corroborated by source code"
    # Without sources nothing corroborates it: two elevated iterations, no incident.
    assert replay(records, _off()) == []


def test_a_new_source_in_a_later_stage_is_learned_not_flagged() -> None:
    def shares(i: int) -> dict[str, float]:
        return {"prose": 1.0} if i < 60 else {"prose": 0.5, "code": 0.5}

    records = _run(120, shares)
    for record in records[:59]:
        assert set(record.lm_loss_by_dataset) == {"prose"}
    assert replay(records, CONFIG) == []


def test_a_single_dataset_is_judged_by_its_average_alone() -> None:
    # One member's loss is the average itself: a jump of it is the average's jump, judged
    # and classified exactly as with per-source off (no "corroborated by source").
    records = _run(100, lambda i: {"prose": 1.0}, bad=lambda i: 1.0)
    records = [
        _record(
            r.iteration, {"prose": 1.0}, {"prose": r.lm_loss * (1.3 if r.iteration >= 70 else 1)}
        )
        for r in records
    ]
    on, off = replay(records, CONFIG), replay(records, _off())
    assert on and [(e.kind, e.iteration, e.classification) for e in on] == [
        (e.kind, e.iteration, e.classification) for e in off
    ]
    assert all(e.culprit_source is None for e in on)
