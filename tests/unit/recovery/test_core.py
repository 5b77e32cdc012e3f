"""Recovery after a rollback: the decisions (pure) and the flags' refusals at start-up."""

from __future__ import annotations

import argparse
import math
import statistics
from types import SimpleNamespace

import pytest

from megatron_ext.common.features import FeatureError
from megatron_ext.recovery.adapter import RecoveryFeature
from megatron_ext.recovery.core import (
    MIN_NORMS,
    RecoveryConfig,
    UpdateNorms,
    clip_scale,
    lr_multiplier,
    rollback_resumed,
    update_norms_from,
)

APPLIED = [{"incident_id": "a", "rollback_to": 25}, {"incident_id": "b", "rollback_to": 40}]


def test_only_a_resume_at_the_newest_applied_target_is_a_rollback_resume() -> None:
    assert rollback_resumed(40, APPLIED) == APPLIED[-1]
    assert rollback_resumed(25, APPLIED) is None  # an older plan's target: the run moved on
    assert rollback_resumed(45, APPLIED) is None  # an ordinary resume past the target
    assert rollback_resumed(0, APPLIED) is None  # a fresh start
    assert rollback_resumed(40, []) is None  # no plan applied
    assert rollback_resumed(40, [{"rollback_to": "40"}]) is None  # a foreign record


def test_the_lr_factor_ramps_from_f_to_one_over_the_window() -> None:
    config = RecoveryConfig(iters=4, lr_mult=0.2)
    factors = [lr_multiplier(config, k) for k in range(1, 7)]
    assert factors == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert lr_multiplier(config, 0) == 1.0


def test_the_clip_is_mean_plus_k_sigma_of_the_recent_norms() -> None:
    norms = UpdateNorms(window=12)
    norms.prime([1.0] * (MIN_NORMS - 1))
    assert norms.threshold(3.0) == math.inf  # too few norms: nothing clipped
    values = [1.0, 2.0] * 8  # the window keeps the last 12
    norms.prime(values)
    kept = values[-12:]
    expected = statistics.fmean(kept) + 3.0 * statistics.pstdev(kept)
    assert norms.threshold(3.0) == pytest.approx(expected)
    norms.push(math.inf)  # a non-finite norm never enters
    assert norms.threshold(3.0) == pytest.approx(expected)
    assert clip_scale(10.0, 2.5) == pytest.approx(0.25)
    assert clip_scale(2.0, 2.5) == 1.0
    assert clip_scale(math.nan, 2.5) == 1.0


def test_past_update_norms_are_ratio_times_params_norm_of_applied_steps() -> None:
    records = [
        SimpleNamespace(update_ratio=0.01, params_norm=20.0, skipped_iter=False),
        SimpleNamespace(update_ratio=None, params_norm=20.0, skipped_iter=False),
        SimpleNamespace(update_ratio=0.5, params_norm=20.0, skipped_iter=True),
    ]
    assert update_norms_from(records) == pytest.approx([0.2])


def _args(*flags: str, **more: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    RecoveryFeature().add_args(parser.add_argument_group())
    args = parser.parse_args(list(flags))
    defaults = dict(
        load="/ckpt",
        optimizer="adam",
        spike_window=100,
        signals_dir="/signals",
        signals_update_ratio=True,
        use_distributed_optimizer=False,
        fp16=False,
        bf16=False,
    )
    return argparse.Namespace(**vars(args), **(defaults | more))


@pytest.mark.parametrize(
    ("flags", "more", "message"),
    [
        (["--recovery-iters", "-1"], {}, "--recovery-iters must be >= 0"),
        (["--recovery-iters", "5", "--recovery-lr-mult", "0"], {}, "in (0, 1]"),
        (["--recovery-iters", "5", "--recovery-lr-mult", "2"], {}, "in (0, 1]"),
        (["--recovery-iters", "5", "--recovery-clip-update", "-1"], {}, "must be > 0"),
        (["--recovery-lr-mult", "0.5"], {}, "need(s) --recovery-iters N > 0"),
        (["--recovery-iters", "5"], {"load": None}, "needs --load"),
        (["--recovery-iters", "5", "--recovery-reset-moments"], {"optimizer": "sgd"}, "adam"),
        (
            ["--recovery-iters", "5", "--recovery-clip-update", "2"],
            {"signals_update_ratio": False},
            "--signals-update-ratio",
        ),
        (
            ["--recovery-iters", "5", "--recovery-clip-update", "2"],
            {"use_distributed_optimizer": True},
            "--use-distributed-optimizer",
        ),
        (
            ["--recovery-iters", "5", "--recovery-clip-update", "2"],
            {"spike_window": 5},
            "--spike-window update norms: it must be >= 10",
        ),
    ],
)
def test_bad_flags_are_refused_with_what_to_do(flags, more, message) -> None:
    feature = RecoveryFeature()
    args = _args(*flags, **more)
    assert feature.enabled(args)
    with pytest.raises(FeatureError, match=message.replace("(", r"\(").replace(")", r"\)")):
        feature.validate(args)


def test_no_flag_leaves_the_feature_off_and_good_flags_pass() -> None:
    assert not RecoveryFeature().enabled(_args())
    RecoveryFeature().validate(_args("--recovery-iters", "5", spike_window=5))  # no clip
    args = _args(
        "--recovery-iters", "20", "--recovery-lr-mult", "0.1", "--recovery-reset-moments",
        "--recovery-clip-update", "2",
    )  # fmt: skip
    RecoveryFeature().validate(args)
    assert RecoveryFeature().enabled(args)
