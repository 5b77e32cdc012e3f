"""Per-bucket grad norms and the signals log in the real loop: DP=2 (DDP), DP=2 with the
distributed optimizer and a rollback relaunch, TP=2 (the shared launches of conftest.py,
with small DDP buckets so every model spans several buckets)."""

from __future__ import annotations

import re

import pytest

from megatron_ext.common.records.signals import SignalRecord, latest_per_iteration, read_signals
from tests.support.harness import Run


def _console(run: Run, key: str) -> dict[int, float]:
    pattern = re.compile(rf"iteration\s+(\d+)/\s*\d+ \|.*\| {key}: ([0-9.E+-]+) \|")
    return {int(m[1]): float(m[2]) for m in pattern.finditer(run.log)}


def _assert_buckets_cover_grad_norm(run: Run) -> list[SignalRecord]:
    records = latest_per_iteration(read_signals(run.workdir / "signals" / "signals.jsonl"))
    assert [r.iteration for r in records] == list(range(1, 21))
    grad_norms = _console(run, "grad norm")
    for r in records:
        assert len(r.bucket_grad_norms) >= 3, "small buckets: several per model"
        total = sum(v * v for v in r.bucket_grad_norms.values())
        assert total == pytest.approx(r.grad_norm**2, rel=1e-5), r.iteration
        if r.iteration in grad_norms:  # this launch's console (3 digits)
            assert r.grad_norm == pytest.approx(grad_norms[r.iteration], rel=1e-3)
    assert len(grad_norms) >= 10
    assert "megatron-ext WARNING" not in run.log
    assert "bucket grad norms | b0:" in run.log
    return records


def _assert_signal_fields(run: Run, records: list[SignalRecord], dp: int) -> None:
    lm_losses = _console(run, "lm loss")
    # Megatron's console prints the next iteration's rate; the record holds the step's own.
    next_lrs = _console(run, "learning rate")
    per_rank = run.records()
    for r in records:
        if r.iteration != 2:  # Megatron's console averages iterations 1-2 at iteration 2
            assert r.lm_loss == pytest.approx(lm_losses[r.iteration], rel=1e-6)
        assert r.consumed_samples == 8 * r.iteration and r.skipped_samples == 0
        assert r.params_norm > 0 and r.update_ratio < 1
        # Linear warm-up from lr 0: the first optimizer step ran at lr 0 and moved nothing.
        assert (r.update_ratio > 0) == (r.iteration > 1) == (r.lr > 0)
        if r.iteration - 1 in next_lrs:
            assert r.lr == pytest.approx(next_lrs[r.iteration - 1], rel=1e-6)
        assert r.loss_scale == 1.0 and not r.skipped_iter and not r.nan_iter
        # The worst DP rank's local loss, recomputed from the per-rank sample log.
        local = {
            rank: sum(x.loss_sum for x in recs if x.iteration == r.iteration)
            / sum(x.num_tokens for x in recs if x.iteration == r.iteration)
            for rank, recs in per_rank.items()
        }
        worst = max(local, key=local.get)
        assert (r.max_loss_dp_rank, r.max_local_loss) == (worst, pytest.approx(local[worst]))
        assert len(local) == dp


def test_ddp_bucket_norms_and_signals(drill_ddp: dict[str, Run]) -> None:
    run = drill_ddp["U"]
    _assert_signal_fields(run, _assert_buckets_cover_grad_norm(run), dp=2)


def test_distributed_optimizer_bucket_norms_and_rollback_attempts(distopt_rollback: Run) -> None:
    records = _assert_buckets_cover_grad_norm(distopt_rollback)
    assert [r.attempt for r in records] == [1] * 10 + [2] * 10
    everything = read_signals(distopt_rollback.workdir / "signals" / "signals.jsonl")
    assert [r.iteration for r in everything] == list(range(1, 21)) + list(range(11, 21))
    replayed = {r.iteration: r for r in everything if r.attempt == 1}
    for r in records[10:]:  # deterministic replay after the rollback: same losses
        assert r.lm_loss == replayed[r.iteration].lm_loss


def test_tensor_parallel_bucket_norms_count_duplicates_once(tp2: Run) -> None:
    records = _assert_buckets_cover_grad_norm(tp2)
    _assert_signal_fields(tp2, records, dp=1)
