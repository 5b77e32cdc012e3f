"""The straggler rule and the one after-step all-reduce's vector, on their own: the slowest
rank against its peers, the rule's streak and margin, the busy-time clock on a real module, and
the vector's values summed over ranks as the all-reduce sums them (worst-rank loss divided as
the old per-rank gather did, per-source sums, busy times)."""

from __future__ import annotations

import math
import random
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.telemetry.step_sums import StepSums
from megatron_ext.telemetry.stragglers import (
    Slowest,
    StepClock,
    Stragglers,
    StragglerWatch,
    check_straggler_args,
    slowest,
)


def test_the_slowest_rank_is_compared_with_its_own_peers() -> None:
    # Ranks 0-1 one DP group (stage 0), 2-3 another (stage 1, naturally slower).
    times, groups = [1.0, 1.1, 3.0, 3.1], [0, 0, 2, 2]
    step = slowest(times, groups)
    assert step == Slowest(rank=1, seconds=1.1, median=1.0)
    # Rank 2 twice its peer: the slowest, though stage 0's ranks are not its peers.
    step = slowest([1.0, 1.0, 6.0, 3.0], groups)
    assert step is not None and (step.rank, step.median, step.ratio) == (2, 3.0, 2.0)
    # No DP peers (DP=1): every other rank; an unmeasured rank (NaN) is left out.
    assert slowest([1.0, 2.0, math.nan], [0, 1, 2]) == Slowest(1, 2.0, 1.0)
    assert slowest([1.0, math.nan], [0, 0]) is None
    assert slowest([1.0], [0]) is None


def _by_definition(times: list[float], groups: list[int]) -> Slowest | None:
    """The rule as the docstring states it, rank by rank (quadratic)."""
    measured = [r for r, t in enumerate(times) if math.isfinite(t)]
    if len(measured) < 2:
        return None
    best: Slowest | None = None
    by_lowest_rank = {groups[r]: None for r in measured}  # of equal ratios, the first
    for group in by_lowest_rank:
        members = [r for r in measured if groups[r] == group]
        top = max(members, key=lambda r: (times[r], -r))
        peers = [r for r in members if r != top] or [r for r in measured if r != top]
        candidate = Slowest(top, times[top], statistics.median(times[r] for r in peers))
        best = candidate if best is None or candidate.ratio > best.ratio else best
    return best


def test_the_sorted_search_equals_the_rule_rank_by_rank() -> None:
    rng = random.Random(0)
    for _ in range(3000):  # ties, zeros, unmeasured ranks, lone ranks and shared groups
        n = rng.randint(0, 12)
        times = [rng.choice([0.0, 1.0, 2.0, math.nan, 3 * rng.random()]) for _ in range(n)]
        groups = [rng.randint(0, 4) for _ in range(n)] if rng.random() < 0.7 else list(range(n))
        assert slowest(times, groups) == _by_definition(times, groups), (times, groups)


def test_a_rank_is_named_after_its_streak_and_cleared_when_it_recovers() -> None:
    watch = StragglerWatch(factor=1.5, steps=3)
    slow, fast = Slowest(1, 2.0, 1.0), Slowest(1, 1.2, 1.0)
    assert [watch.observe(slow) for _ in range(2)] == [(None, None)] * 2
    assert watch.observe(slow) == (1, "named")
    assert watch.observe(slow) == (1, None)
    assert watch.observe(fast) == (None, "cleared")
    # Another rank breaks the streak; so does a step without a measurement.
    assert [watch.observe(s) for s in (slow, slow, Slowest(0, 2.0, 1.0), slow)] == [
        (None, None)
    ] * 4
    assert [watch.observe(s) for s in (slow, None, slow, slow)] == [(None, None)] * 4
    assert watch.observe(slow) == (1, "named")


def test_the_margin_keeps_small_absolute_noise_unnamed() -> None:
    watch = StragglerWatch(factor=1.5, steps=1, margin=0.5)
    assert watch.observe(Slowest(1, 0.3, 0.1)) == (None, None)  # 3x, but 0.2 s
    assert watch.observe(Slowest(1, 1.6, 1.0)) == (1, "named")


def test_what_a_step_adds_to_the_signals_tensorboard_and_console() -> None:
    stragglers = Stragglers(StragglerWatch(1.5, 2), ["node-a", "node-b"])
    out = stragglers.observe(7, Slowest(1, 2.0, 0.5))
    assert out.fields == {
        "straggler_rank": None,
        "straggler_node": None,
        "slowest_rank": 1,
        "slowest_step_time": 2.0,
        "median_step_time": 0.5,
    }
    assert out.scalars == {
        "rank-step-time/slowest": 2.0,
        "rank-step-time/median": 0.5,
        "rank-step-time/slowest-rank": 1.0,
    }
    assert out.news is None and "slowest rank 1 (node-b)" in out.line
    out = stragglers.observe(8, Slowest(1, 2.0, 0.5))
    assert (out.fields["straggler_rank"], out.fields["straggler_node"]) == (1, "node-b")
    assert out.news is not None and out.news.startswith("iteration 8: rank 1 on node-b is a")
    out = stragglers.observe(9, None)
    assert out.fields == {"straggler_rank": None, "straggler_node": None}
    assert out.news == "iteration 9: rank 1 on node-b is no longer slow"


@pytest.mark.parametrize(
    ("factor", "steps", "margin", "message"),
    [
        (1.0, 5, 0.0, "--straggler-factor 1.0: must be a number > 1"),
        (math.nan, 5, 0.0, "--straggler-factor nan"),
        (1.5, 0, 0.0, "--straggler-steps 0: must be >= 1"),
        (1.5, 5, -1.0, "--straggler-min-seconds -1.0: must be >= 0"),
    ],
)
def test_a_rule_that_cannot_work_is_refused(factor, steps, margin, message) -> None:
    args = SimpleNamespace(
        straggler_factor=factor, straggler_steps=steps, straggler_min_seconds=margin
    )
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_straggler_args(args)


def test_the_clock_times_the_training_forwards_only() -> None:
    module = torch.nn.Linear(4, 4)
    clock = StepClock(cuda=False)
    clock.attach([module])
    assert math.isnan(clock.read())  # no forward yet
    module(torch.ones(1, 4))
    time.sleep(0.05)
    module(torch.ones(1, 4))
    busy = clock.read()
    assert 0.05 <= busy < 5
    module.eval()
    module(torch.ones(1, 4))  # an evaluation's forward is not the step's
    assert math.isnan(clock.read())


def test_the_summed_vector_gives_the_worst_rank_sources_and_busy_times() -> None:
    """DP=2 x CP=2 on 4 ranks: each DP replica's two CP ranks add their parts of its loss."""
    sums = StepSums(sources=2, replicas=2, world=4)
    parts = {  # rank: (dp replica, loss sum part, tokens part), fp32 as on_loss sums them
        0: (0, 10.1, 7.0),
        1: (0, 3.3, 2.0),
        2: (1, 20.7, 5.0),
        3: (1, 1.9, 4.0),
    }
    vectors = []
    for rank, (replica, loss, tokens) in parts.items():
        sources = torch.tensor([[loss, 0.0], [tokens, 0.0]], dtype=torch.float64)
        if rank == 3:
            sources = torch.tensor([[0.0, loss], [0.0, tokens]], dtype=torch.float64)
        part = (torch.tensor(loss, dtype=torch.float32), torch.tensor(tokens))
        vectors.append(
            sums.pack(
                "cpu",
                rank,
                0.1 * (rank + 1),
                group=rank % 2,
                sources=sources,
                loss=part,
                replica=replica,
            )
        )
    summed = torch.stack(vectors).sum(dim=0)  # what the all-reduce computes
    assert summed.numel() == sums.size == 2 * 2 + 2 * 2 + 2 * 4
    step = sums.read(summed.tolist(), ["a", "b"])
    # As the old CP all-reduce (fp32 sum) then per-rank fp32 division computed it.
    old = [
        float((torch.tensor(10.1) + torch.tensor(3.3)) / torch.tensor(9.0)),
        float((torch.tensor(20.7) + torch.tensor(1.9)) / torch.tensor(9.0)),
    ]
    assert (step.worst_loss, step.worst_rank) == (max(old), old.index(max(old)))
    losses, tokens = step.by_dataset
    assert tokens == {"a": 14, "b": 4}
    assert losses == {"a": pytest.approx((10.1 + 3.3 + 20.7) / 14), "b": pytest.approx(1.9 / 4)}
    # Peers: ranks 0 and 2 (group 0), 1 and 3 (group 1); rank 2 is 3x rank 0, rank 3 2x rank 1.
    assert step.slowest == Slowest(2, pytest.approx(0.3), pytest.approx(0.1))


def test_a_vector_without_losses_has_no_worst_rank() -> None:
    sums = StepSums(sources=0, replicas=2, world=2)
    summed = sums.pack("cpu", 0, 1.0, 0) + sums.pack("cpu", 1, 1.0, 0)
    step = sums.read(summed.tolist(), [])
    assert (step.worst_loss, step.worst_rank, step.by_dataset) == (None, None, ({}, {}))
