"""A failure that comes back after its rollback (megatron_ext.incidents.planner.repeated, and
the plan): rolled back further and skipped more, bounded, never mistaken for a new failure."""

from __future__ import annotations

import pytest

from megatron_ext.incidents.planner import PlanConfig, PlanError, make_plan, repeated
from tests.support.spike_curves import events, records


def _applied(number: int, onset: int, target: int, window: list[int] | None) -> dict:
    action = "rollback-and-skip" if window else "rollback-and-replay"
    return {
        "incident": number,
        "onset": onset,
        "rollback_to": target,
        "skip_window": window,
        "action": action,
    }


def _ledger(onset: int, attempt: int) -> list[dict]:
    curve = records(onset + 30, {i: (5.0, 1.0) for i in range(onset, onset + 30)}, attempt)
    return [{**e.as_json(), "attempt": attempt} for e in events(curve)]


def test_an_incident_within_the_last_windows_reach_repeats_it() -> None:
    first = _applied(1, 120, 100, [101, 124])
    assert repeated({"onset": 130}, [first], 24) == [first]
    assert repeated({"onset": 148}, [first], 24) == [first]  # the reach: 124 + 24
    assert repeated({"onset": 149}, [first], 24) == []  # a new failure
    assert repeated({"onset": 90}, [first], 24) == []  # before the target: not after it
    second = _applied(2, 130, 80, [81, 148])
    assert repeated({"onset": 150}, [first, second], 24) == [first, second]
    # A replay (confirm policy) is the confirmation step, not a rollback that failed.
    assert repeated({"onset": 121}, [_applied(1, 120, 100, None)], 24) == []


def test_the_planner_rolls_back_past_every_target_and_skips_past_every_window() -> None:
    ledger = _ledger(130, attempt=2)
    onset = ledger[-1]["onset"]
    first = _applied(1, onset - 5, 100, [101, onset - 2])
    config = PlanConfig(rollback_iters=10, skip_batches=20)
    checkpoints = list(range(10, onset, 10))
    plain = make_plan(ledger, [], checkpoints, [], config, None, "/ckpt")
    again = make_plan(ledger, [], checkpoints, [], config, None, "/ckpt", applied=[first])
    assert plain.rollback_to == max(c for c in checkpoints if c <= onset - 10)
    assert again.rollback_to == 90  # older than the first target (100)
    # Past the incident (its rollback decision) and every earlier window, plus one window.
    assert again.skip_window == [91, ledger[-1]["iteration"] + 20]
    assert "The same failure came back after incident 001" in again.summary
    assert "came back" not in plain.summary


def test_too_many_repeats_stop_naming_what_was_tried() -> None:
    ledger = _ledger(130, attempt=4)
    onset = ledger[-1]["onset"]
    chain = [
        _applied(1, onset - 6, 100, [101, onset - 4]),
        _applied(2, onset - 4, 90, [91, onset - 2]),
        _applied(3, onset - 2, 80, [81, onset - 1]),
    ]
    config = PlanConfig(rollback_iters=10, skip_batches=20)
    with pytest.raises(PlanError, match="after 3 rollbacks") as refused:
        make_plan(ledger, [], list(range(10, onset, 10)), [], config, None, "/c", applied=chain)
    assert "incident 001" in str(refused.value) and "Megatron-LM #5281" in str(refused.value)
