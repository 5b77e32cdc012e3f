"""Per-bucket grad norms and the per-step signals log: the cores, and the real loop on CPU.

The end-to-end fixtures are real launches (DP=2 plain, DP=2 distributed optimizer with a
rollback relaunch, TP=2) with small DDP buckets so every model spans several buckets.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from harness import Run, launch
from megatron_ext.bucket_norms import BucketView, bucket_name, clip_range, squared_norms
from megatron_ext.signals import (
    SignalRecord,
    SignalsWriter,
    latest_per_iteration,
    read_signals,
)

TELEMETRY = ["--log-bucket-grad-norms", "--signals-update-ratio",
             "--overlap-grad-reduce", "--ddp-bucket-size", "20000"]


def _record(iteration: int, loss: float = 2.0) -> SignalRecord:
    return SignalRecord(iteration=iteration, attempt=0, job_id="j", wall_time=1.0,
                        consumed_samples=8 * iteration, skipped_samples=0, lm_loss=loss)


# -- cores ------------------------------------------------------------------------------------

def test_squared_norms_sum_segments_per_bucket() -> None:
    data = torch.arange(10, dtype=torch.float32)
    views = [BucketView("a", (data[0:3], data[5:7])), BucketView("b", (data[7:10],)),
             BucketView("empty", ())]
    expected = [0 + 1 + 4 + 25 + 36, 49 + 64 + 81, 0]
    assert squared_norms(views).tolist() == pytest.approx(expected, rel=1e-6)
    assert clip_range(2, 8, 5, 10) == (5, 8) and clip_range(0, 5, 5, 10) is None


def test_bucket_names_are_readable_and_stable() -> None:
    names = ["module.module.decoder.layers.1.mlp.linear_fc2.weight",
             "module.module.decoder.layers.0.self_attention.linear_qkv.weight"]
    assert bucket_name(3, names) == (
        "b3:layers0-1[decoder.layers.1.mlp.linear_fc2.weight.."
        "decoder.layers.0.self_attention.linear_qkv.weight]")
    assert bucket_name(0, ["module.output_layer.weight"]).startswith("b0:no-layers[")


def test_restart_appends_a_new_attempt_and_readers_take_the_latest(tmp_path: Path) -> None:
    first = SignalsWriter(tmp_path)
    for i in (1, 2, 3):
        first.write(_record(i, loss=float(i)))
    with open(first.path, "a") as f:
        f.write('{"iteration": 4, "attem')  # kill -9 mid-line
    second = SignalsWriter(tmp_path)  # the rollback restarts from iteration 2
    assert second.attempt == 2
    second.write(_record(3, loss=30.0))
    second.write(_record(4, loss=float("nan")))
    with pytest.warns(UserWarning, match="torn"):
        records = read_signals(first.path)
    assert [(r.iteration, r.attempt) for r in records] == [(1, 1), (2, 1), (3, 1), (3, 2), (4, 2)]
    latest = latest_per_iteration(records)
    assert [(r.iteration, r.attempt) for r in latest] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert latest[2].lm_loss == 30.0 and math.isnan(latest[3].lm_loss)


def test_foreign_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "signals.jsonl"
    path.write_text('{"iteration": 1, "who": "another tool"}\n')
    with pytest.raises(ValueError, match=r"record 1 is not a signals record.*unknown fields"):
        read_signals(path)


# -- the real loop ------------------------------------------------------------------------------

def _launch(work: Path, data_args: list[str], *extra: str, nproc: int = 2) -> Run:
    args = [*data_args, *TELEMETRY, "--signals-dir", str(work / "signals"), *extra]
    run = launch(work, args, nproc=nproc)
    assert run.returncode == 0, run.log[-4000:]
    return run


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, data_args) -> Run:
    return _launch(tmp_path_factory.mktemp("sig-ddp"), data_args)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, data_args) -> Run:
    return _launch(tmp_path_factory.mktemp("sig-tp2"), data_args,
                   "--tensor-model-parallel-size", "2")


@pytest.fixture(scope="module")
def distopt(tmp_path_factory, data_args) -> Run:
    """Distributed optimizer, then a rollback: the tracker is set back to iteration 10 and the
    job relaunched with the same signals dir (what the spike pipeline does)."""
    work = tmp_path_factory.mktemp("sig-distopt")
    ckpt = ["--save", str(work / "ckpt"), "--load", str(work / "ckpt"), "--save-interval", "10"]
    _launch(work, data_args, "--use-distributed-optimizer", *ckpt)
    (work / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10")
    shutil.rmtree(work / "ckpt" / "iter_0000020")
    shutil.rmtree(work / "samples")
    return _launch(work, data_args, "--use-distributed-optimizer", *ckpt)


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
        assert total == pytest.approx(r.grad_norm ** 2, rel=1e-5), r.iteration
        if r.iteration in grad_norms:  # this launch's console (3 digits)
            assert r.grad_norm == pytest.approx(grad_norms[r.iteration], rel=1e-3)
    assert len(grad_norms) >= 10
    assert "megatron-ext WARNING" not in run.log
    assert "bucket grad norms | b0:" in run.log
    return records


def _assert_signal_fields(run: Run, records: list[SignalRecord], dp: int) -> None:
    lm_losses = _console(run, "lm loss")
    per_rank = run.records()
    for r in records:
        if r.iteration != 2:  # Megatron's console averages iterations 1-2 at iteration 2
            assert r.lm_loss == pytest.approx(lm_losses[r.iteration], rel=1e-6)
        assert r.consumed_samples == 8 * r.iteration and r.skipped_samples == 0
        assert r.params_norm > 0 and r.lr > 0 and r.update_ratio < 1
        # Linear warm-up from lr 0: the first optimizer step moves nothing.
        assert (r.update_ratio > 0) == (r.iteration > 1)
        assert r.loss_scale == 1.0 and not r.skipped_iter and not r.nan_iter
        # The worst DP rank's local loss, recomputed from the per-rank sample log.
        local = {rank: sum(x.loss_sum for x in recs if x.iteration == r.iteration)
                 / sum(x.num_tokens for x in recs if x.iteration == r.iteration)
                 for rank, recs in per_rank.items()}
        worst = max(local, key=local.get)
        assert (r.max_loss_dp_rank, r.max_local_loss) == (worst, pytest.approx(local[worst]))
        assert len(local) == dp


def test_ddp_bucket_norms_and_signals(ddp: Run) -> None:
    _assert_signal_fields(ddp, _assert_buckets_cover_grad_norm(ddp), dp=2)


def test_distributed_optimizer_bucket_norms_and_rollback_attempts(distopt: Run) -> None:
    records = _assert_buckets_cover_grad_norm(distopt)
    assert [r.attempt for r in records] == [1] * 10 + [2] * 10
    everything = read_signals(distopt.workdir / "signals" / "signals.jsonl")
    assert [r.iteration for r in everything] == list(range(1, 21)) + list(range(11, 21))
    replayed = {r.iteration: r for r in everything if r.attempt == 1}
    for r in records[10:]:  # deterministic replay after the rollback: same losses
        assert r.lm_loss == replayed[r.iteration].lm_loss


def test_tensor_parallel_bucket_norms_count_duplicates_once(tp2: Run) -> None:
    records = _assert_buckets_cover_grad_norm(tp2)
    _assert_signal_fields(tp2, records, dp=1)
