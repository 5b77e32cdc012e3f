"""The real training loop (CPU harness, TP=2) with and without ``--z-loss-coeff`` (with
``--log-output-z``, under ``--cross-entropy-loss-fusion``): z loss and log z are logged,
``lm loss`` stays the pure cross entropy, and what is trained is CE + c·log²Z."""

from __future__ import annotations

import re

import pytest

from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.records.signals import read_signals
from tests.support.harness import Run

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")


def _per_iteration(run: Run, key: str) -> dict[int, float]:
    values = {}
    for line in run.log.splitlines():
        match = _ITERATION.search(line)
        found = match and re.search(rf"\| {key}: ([0-9.E+-]+) \|", match.group(2) + "|")
        if found:
            values[int(match.group(1))] = float(found.group(1))
    return values


def test_training_with_z_loss_logs_it_and_keeps_lm_loss_pure_ce(tp2: Run, tp2_zloss: Run) -> None:
    plain, with_z = tp2, tp2_zloss
    assert re.search(r"cross_entropy_loss_fusion \.+ True", with_z.log)  # composed, not refused
    signals = with_z.workdir / "signals"
    lm_plain, lm_z = _per_iteration(plain, "lm loss"), _per_iteration(with_z, "lm loss")
    z, log_z = _per_iteration(with_z, "z loss"), _per_iteration(with_z, "log z")
    assert sorted(lm_plain) == sorted(lm_z) == sorted(z) == sorted(log_z) == list(range(1, 21))
    assert not _per_iteration(plain, "z loss")
    assert all(value > 0 for value in z.values())
    assert lm_z[1] == lm_plain[1], "same weights and batch: the CE must be identical"
    assert log_z[1] ** 2 == pytest.approx(z[1], rel=0.5), "log z: the signed mean of log Z"
    assert lm_z != lm_plain, "the z term must change the training dynamics"
    # The signals log gets the z loss too. Megatron's console accumulator is not reset after
    # the first iteration, so its iteration-2 figure is the mean of iterations 1 and 2.
    logged = {r.iteration: r.z_loss for r in read_signals(signals / SIGNALS_FILE)}
    assert sorted(logged) == list(range(1, 21))
    assert {k: v for k, v in logged.items() if k != 2} == pytest.approx(
        {k: v for k, v in z.items() if k != 2}, rel=1e-6
    )
    assert (logged[1] + logged[2]) / 2 == pytest.approx(z[2], rel=1e-6)
    # What was trained is CE + c·log²Z: the sample log's token-summed loss per iteration.
    records = with_z.records()[0]
    for iteration in (1, 20):
        recs = [r for r in records if r.iteration == iteration]
        trained = sum(r.loss_sum for r in recs) / sum(r.num_tokens for r in recs)
        assert trained == pytest.approx(lm_z[iteration] + 1e-4 * z[iteration], rel=1e-5)
