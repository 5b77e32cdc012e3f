"""Stragglers and the overlay's per-step footprint, in the real loop: two CPU ranks (DP=2) with
the README's flags, one balanced launch (8 micro-batches per step: the more work, the more
timing noise on a shared CPU) and one where each training forward of rank 1 sleeps, injected
from outside the project (tests/support/incidents.py), with 2. A shared 2-core box alone makes
a rank 2-4x slower than its peer for a few steps; the rule's margin (--straggler-min-seconds)
is what tells that from a straggler there. Both count, per step, the collectives and host
reads the overlay's own code makes (tests/support/footprint.py); the figures are in
BENCHMARKS.md ("Per-step footprint").
"""

from __future__ import annotations

import collections
import socket
from pathlib import Path

import pytest

from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.records.signals import SignalRecord, read_signals
from tests.support import footprint, incidents
from tests.support.harness import TINY_TRAINING, Run, launch

ITERS = 10
STEPS = 3  # --straggler-steps
SLEEP = 1.5  # seconds, each training forward of the slowed rank
SLEPT = 2 * SLEEP  # per step: 2 micro-batches
README = ["--z-loss-coeff", "1e-5", "--embedding-weight-decay-mult", "0"]
README += ["--log-bucket-grad-norms", "--spike-detect"]
RULE = ["--straggler-steps", str(STEPS), "--straggler-min-seconds", str(SLEPT / 2)]
# Reads of the CPU-side batch (sample ids, token digests: no device sync) and the rerun state
# machine's NaN check, which the spike feature's wrapper makes in place of Megatron's own.
NOT_ADDED = {
    "tolist sample_log/adapter.py:on_batch",
    "numpy common/io.py:token_sha1",
    "__bool__ spikes/adapter.py:validate_result",
}
# After the change, per step on every rank: the bucket norms' all-reduce before the grad norm,
# the one after-step all-reduce, the spike decision's broadcast; Megatron's params-norm
# function (called for the signals when --log-params-norm is off) all-reduces 6 times.
COLLECTIVES = {
    "all_reduce telemetry/adapter.py:before_grad_norm": 1,
    "all_reduce telemetry/adapter.py:_reduce_after_step": 1,
    "broadcast spikes/adapter.py:after_step": 1,
    "all_reduce telemetry/adapter.py:after_step": 6,
}


# Reads of computed values per step, all after Megatron's own syncs: the spike decision, the
# params norm (Megatron's function), the bucket norms, the sample log's sums and a loss value;
# on the writer also the after-step all-reduce and two more loss values for the record.
READS = {0: 5, 1: 8}


def _launch(work: Path, data_args: list[str], batch: int, slow: bool) -> Run:
    env = footprint.install(work / "site", prefix=incidents.SITECUSTOMIZE)
    if slow:
        env |= {"INJECT_SLOW_RANK": "1", "INJECT_SLOW_S": str(SLEEP)}
    training = list(TINY_TRAINING)
    training[training.index("--global-batch-size") + 1] = str(batch)
    training[training.index("--train-iters") + 1] = str(ITERS)
    signals = ["--signals-dir", str(work / "signals")]
    flags = [*data_args, *README, *RULE, *signals]
    run = launch(work, flags, nproc=2, training=training, env=env)
    assert run.returncode == 0, run.log[-4000:]
    return run


@pytest.fixture(scope="module")
def balanced(tmp_path_factory, data_args) -> Run:
    return _launch(tmp_path_factory.mktemp("balanced"), data_args, batch=32, slow=False)


@pytest.fixture(scope="module")
def slowed(tmp_path_factory, data_args) -> Run:
    return _launch(tmp_path_factory.mktemp("slowed"), data_args, batch=8, slow=True)


def _signals(run: Run) -> list[SignalRecord]:
    records = read_signals(run.workdir / "signals" / SIGNALS_FILE)
    assert [r.iteration for r in records] == list(range(1, ITERS + 1))
    return records


def test_a_slowed_rank_is_named_with_its_node_within_a_few_steps(slowed) -> None:
    records = _signals(slowed)
    named = [r.iteration for r in records if r.straggler_rank is not None]
    # Measured from the first step: named at the STEPS-th, and stays named.
    assert named == list(range(STEPS, ITERS + 1)), [(r.iteration, r.slowest_rank) for r in records]
    for record in records:  # busy at least the injected sleeps; its peer's median is less
        assert record.slowest_rank == 1, record
        assert record.slowest_step_time > max(SLEPT, record.median_step_time) > 0, record
    assert {r.straggler_rank for r in records[STEPS - 1 :]} == {1}
    assert {r.straggler_node for r in records[STEPS - 1 :]} == {socket.gethostname()}
    announced = f"megatron-ext stragglers: iteration {STEPS}: rank 1 on {socket.gethostname()}"
    assert slowed.log.count(announced) == 1, slowed.log[-3000:]
    assert f"| slowest rank 1 ({socket.gethostname()}): busy " in slowed.log  # --log-interval 1


def test_a_balanced_run_names_nobody(balanced) -> None:
    records = _signals(balanced)
    assert all(r.straggler_rank is None and r.straggler_node is None for r in records)
    for record in records:  # measured every step, on both ranks
        assert record.slowest_rank in (0, 1) and record.median_step_time > 0, record
    assert "is a straggler" not in balanced.log


def _steady(run: Run) -> dict[int, list[collections.Counter[tuple[str, str]]]]:
    """Per rank, the counts of each step but the first and the last (same on every one)."""
    counts = footprint.per_iteration(run.workdir / "site")
    assert sorted(counts) == [0, 1]
    return {rank: [steps[i] for i in range(2, ITERS)] for rank, steps in counts.items()}


def test_the_overlay_adds_three_collectives_and_no_early_host_read_per_step(
    balanced, slowed
) -> None:
    for run, micro_batches in ((slowed, 2), (balanced, 8)):
        for rank, steps in _steady(run).items():
            assert all(step == steps[0] for step in steps), (rank, micro_batches)
            step = steps[0]
            collectives = {s: n for (k, s), n in step.items() if k == "collective"}
            assert collectives == COLLECTIVES, (rank, micro_batches, collectives)
            reads = {s: n for (k, s), n in step.items() if k == "host read" and s not in NOT_ADDED}
            early = [s for s in reads if s.rsplit(":", 1)[1] in ("on_loss", "before_grad_norm")]
            assert early == [], early  # before Megatron's own sync (the grad norm's .item())
            # One read of the after-step all-reduce, on the writer (rank 1) only.
            assert step[("host read", "tolist telemetry/adapter.py:after_step")] == 1 + rank, step
            assert sum(reads.values()) == READS[rank], (rank, micro_batches, reads)
