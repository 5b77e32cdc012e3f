"""Recovery after a rollback in Megatron's real loop (DP 1, the drill's garbage tokens), every
option at once: launch 1 meets garbage at 22-27 and exits 42; ``skiplist --apply`` rolls back
to 15 and skips 16-29; launch 2 resumes with ``--recovery-lr-mult``, ``--recovery-reset-moments``
and ``--recovery-clip-update`` over 4 updates (the first, 30, is checkpointed) and exits at 33
(saved); launch 3, an ordinary resume from 33, trains 34-35 with nothing applied.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_ext.common import exit_codes
from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.records.signals import SignalRecord, read_signals
from tests.support.drill import drill_args
from tests.support.harness import TINY_TRAINING, Run, launch, run_skiplist

TARGET, FIRST, ITERS, N, F, K = 15, 30, 35, 4, 0.75, 0.01
BETA1, BETA2 = 0.9, 0.999  # Megatron's defaults (TINY_TRAINING sets neither)
RECOVERY = [
    *("--recovery-iters", str(N), "--recovery-lr-mult", str(F), "--recovery-reset-moments"),
    *("--recovery-clip-update", str(K)),
]


def _training() -> list[str]:
    flags = list(TINY_TRAINING)
    # test_update_skip's lr: by the bad batches the model predicts its corpus.
    for flag, value in (("--lr", "3e-3"), ("--min-lr", "3e-4")):
        flags[flags.index(flag) + 1] = str(value)
    return flags


def _launch(work: Path, data_args: list[str], *extra: str) -> Run:
    flags = [*drill_args(data_args, work, "22-27:0", patience=3), "--spike-warmup", "10"]
    flags += ["--signals-update-ratio", *RECOVERY, "--train-iters", str(ITERS), *extra]
    return launch(work, flags, training=_training(), sample_log=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_args) -> Path:
    work = tmp_path_factory.mktemp("recovery")
    first = _launch(work, data_args)
    assert {e.get("exit_code") for e in first.exits().values()} == {exit_codes.SPIKE_ROLLBACK}
    assert "resumed from the rollback" not in first.log  # a fresh start
    skip = str(FIRST - TARGET - 1)
    plan = run_skiplist(work, "--rollback-iters", "5", "--skip-batches", skip, "--apply")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    resumed = _launch(work, data_args, "--exit-interval", str(FIRST + N - 1))
    assert resumed.returncode == 0, resumed.log[-4000:]
    assert f"resumed from the rollback to iteration {TARGET}" in resumed.log
    ordinary = _launch(work, data_args)
    assert ordinary.returncode == 0, ordinary.log[-4000:]
    assert "resumed from the rollback" not in ordinary.log
    return work


def _by_attempt(work: Path) -> dict[int, dict[int, SignalRecord]]:
    out: dict[int, dict[int, SignalRecord]] = {}
    for r in read_signals(work / "signals" / SIGNALS_FILE):
        out.setdefault(r.attempt, {})[r.iteration] = r
    return out


def test_the_lr_is_scaled_by_the_ramp_for_n_updates_then_megatrons(run: Path) -> None:
    first, resumed, ordinary = (_by_attempt(run)[a] for a in (1, 2, 3))
    assert sorted(resumed) == list(range(FIRST, FIRST + N))  # 16-29 skipped; exit at 33
    assert sorted(ordinary) == list(range(FIRST + N, ITERS + 1))
    # The schedule stood still over the skip: update k used the lr of iteration TARGET + k.
    for k, iteration in enumerate(range(FIRST, ITERS + 1), start=1):
        record = (resumed | ordinary)[iteration]
        factor = F + (1 - F) * (k - 1) / N if k <= N else 1.0
        assert record.lr == pytest.approx(factor * first[TARGET + k].lr, rel=1e-12)
        if k <= N:
            assert (record.recovery["update"], record.recovery["lr_mult"]) == (k, factor)
        else:
            assert record.recovery == {}
    assert not any(r.recovery for r in first.values())


def test_the_moments_start_from_zero_at_the_resume(run: Path) -> None:
    """After one Adam step from zeroed moments m = (1-b1)g and v = (1-b2)g²: m²/v is the
    constant (1-b1)²/(1-b2) in every element; from kept moments it is not."""
    converted = run / "first-update.pt"
    dcp_to_torch_save(run / "ckpt" / f"iter_{FIRST:07d}", converted)
    state = torch.load(converted, weights_only=False)
    ratios = []
    for key, m in state.items():
        if key.startswith("optimizer.state.exp_avg.") and torch.is_tensor(m):
            v = state[key.replace(".exp_avg.", ".exp_avg_sq.")]
            kept = v > 1e-30
            ratios.append((m[kept].double() ** 2 / v[kept].double()).flatten())
    ratios = torch.cat(ratios)
    assert ratios.numel() > 10_000
    expected = (1 - BETA1) ** 2 / (1 - BETA2)
    assert torch.allclose(ratios, torch.full_like(ratios, expected), rtol=1e-4)


def test_updates_are_clipped_at_the_rolling_mean_plus_k_sigma(run: Path) -> None:
    """The thresholds follow from the logged update norms up to the rollback target; a
    clipped step's applied update (the telemetry's ratio x params norm) is the threshold."""
    attempts = _by_attempt(run)
    before = [attempts[1][i] for i in range(TARGET - 9, TARGET + 1)]  # --spike-window 10
    norms = [r.update_ratio * r.params_norm for r in before]
    window = [r for _, r in sorted(attempts[2].items()) if r.recovery]  # attempt 3: none
    assert [r.recovery["update"] for r in window] == list(range(1, N + 1))
    for r in window:
        threshold = statistics.fmean(norms) + K * statistics.pstdev(norms)
        assert r.recovery["clip_threshold"] == pytest.approx(threshold, rel=1e-9)
        applied = r.recovery["update_norm"] * r.recovery["clip_scale"]
        if r.recovery["clip_scale"] < 1:
            assert applied == pytest.approx(threshold, rel=1e-9)
            assert r.update_ratio * r.params_norm == pytest.approx(threshold, rel=1e-3)
        else:
            assert r.recovery["update_norm"] <= threshold
        norms = [*norms, applied][-10:]
    assert window[0].recovery["clip_scale"] < 1  # Adam's first step after the reset
