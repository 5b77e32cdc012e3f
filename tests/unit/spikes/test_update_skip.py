"""The adaptive update skip's gate (pure) and its refusals at start-up; the tier runs the
version check on every supported megatron-core (0.17: refused, 0.18+: accepted)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron_ext.common.features import FeatureError
from megatron_ext.common.versions import installed, parse
from megatron_ext.spikes.update_skip import GateConfig, UpdateGate, UpdateSkipFeature

pytestmark = pytest.mark.compat

CONFIG = GateConfig(factor=2.0, mad_k=6.0, window=10, warmup=10)


def _warm(gate: UpdateGate, norms: list[float]) -> None:
    for norm in norms:
        gate.learn(norm, skipped=False)


def test_not_armed_before_the_warm_up_then_median_and_mad() -> None:
    gate = UpdateGate(CONFIG)
    _warm(gate, [1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 1.1, 0.9])
    assert gate.threshold() == math.inf  # 9 < warm-up 10
    gate.learn(1.0, skipped=False)
    # median 1.0, MAD 0.1: max(2 x 1.0, 1.0 + 6 x 1.4826 x 0.1) = 2.0
    assert gate.threshold() == pytest.approx(2.0)
    _warm(gate, [1.0, 3.0, 0.2, 1.0, 2.5, 0.3, 1.0, 2.8, 0.1, 1.0])  # a noisy baseline
    assert gate.threshold() > 2.0 * gate.norms.median()  # the MAD term dominates


def test_a_withheld_or_overflowed_step_never_enters_the_baseline() -> None:
    gate = UpdateGate(CONFIG)
    _warm(gate, [1.0] * 10)
    before = gate.threshold()
    for _ in range(20):  # a long run of skipped steps with huge norms
        gate.learn(50.0, skipped=True)
    gate.learn(None, skipped=True)  # an fp16 overflow: no norm
    gate.learn(math.nan, skipped=False)  # not a measurement
    assert gate.threshold() == before
    assert gate.seen == 32


def test_priming_restores_the_baseline_of_the_history() -> None:
    gate = UpdateGate(CONFIG)
    gate.prime(seen=200, norms=[1.0] * 10)
    assert gate.threshold() == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"factor": 1.0}, "factor must be > 1"),
        ({"mad_k": 0.0}, "mad-k must be > 0"),
        ({"factor": math.nan}, "factor must be > 1"),
    ],
)
def test_bad_thresholds_are_refused(config: dict, message: str) -> None:
    feature = UpdateSkipFeature()
    with pytest.raises(FeatureError, match=message):
        feature.validate(_args(**config))


def _args(**overrides: object) -> SimpleNamespace:
    values = {
        "spike_skip_update": True,
        "spike_detect": True,
        "factor": 2.0,
        "mad_k": 6.0,
        "spike_window": 100,
        "spike_warmup": 100,
        **overrides,
    }
    return SimpleNamespace(
        spike_skip_update_factor=values.pop("factor"),
        spike_skip_update_mad_k=values.pop("mad_k"),
        **values,
    )


def test_without_the_detector_it_is_refused() -> None:
    with pytest.raises(FeatureError, match="needs --spike-detect"):
        UpdateSkipFeature().validate(_args(spike_detect=False))


def test_megatron_core_0_17_is_refused_with_the_reason_0_18_accepted() -> None:
    feature = UpdateSkipFeature()
    version = installed()
    assert version is not None
    if parse(version) < (0, 18):
        with pytest.raises(FeatureError, match=r"needs megatron-core >= 0\.18.*0\.17"):
            feature.validate(_args())
    else:
        feature.validate(_args())
