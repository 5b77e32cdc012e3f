"""The real ``megatron.training.pretrain`` loop on CPU: world size 1, DP=2, TP=2, and the
kill -9 / resume / ``--iterations-to-skip`` drills, plain and with the distributed optimizer
(the shared launches of conftest.py)."""

from __future__ import annotations

import importlib.metadata

import pytest

from tests.support.harness import (
    EXPECTED_SHIMS,
    GLOBAL_BATCH,
    MICRO_BATCH,
    SKIPPED,
    WS1_SHIMS,
    Run,
    checkpoint_args,
)

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(params=["ddp", "distopt"])
def drill(request: pytest.FixtureRequest) -> dict[str, Run]:
    return request.getfixturevalue(f"drill_{request.param}")


def _sampler_ids(iteration: int, microbatch: int, dp_rank: int, dp_size: int) -> list[int]:
    """MegatronPretrainingSampler's global sample ids (docs/megatron-facts.md, constant
    batch)."""
    start = (iteration - 1) * GLOBAL_BATCH + microbatch * MICRO_BATCH * dp_size
    start += dp_rank * MICRO_BATCH
    return list(range(start, start + MICRO_BATCH))


def _assert_clean_shims(run: Run, nproc: int) -> None:
    counts = run.shim_counts()
    assert sorted(counts) == list(range(nproc)), f"missing shim counters: {counts}"
    for rank, fired in counts.items():
        unexpected = set(fired) - EXPECTED_SHIMS
        assert not unexpected, f"rank {rank}: unexpected CUDA touch points {unexpected}"
        assert fired["initialize_megatron(allow_no_cuda)"] == 1
        assert fired["device=cuda"] > 0 and fired["Tensor.type"] > 0


def test_world_size_1_trains_checkpoints_and_hits_only_known_cuda_points(ws1: Run) -> None:
    records = ws1.records()[0]
    assert [(r.iteration, r.microbatch) for r in records] == [
        (k, m) for k in range(1, 21) for m in range(GLOBAL_BATCH // MICRO_BATCH)
    ]
    assert all(r.sample_ids == _sampler_ids(r.iteration, r.microbatch, 0, 1) for r in records)
    assert _learned(records), "the model did not learn"
    assert sorted(p.name for p in (ws1.workdir / "ckpt").glob("iter_*")) == [
        "iter_0000010",
        "iter_0000020",
    ]
    assert "successfully saved checkpoint from iteration      20" in ws1.log
    _assert_clean_shims(ws1, 1)
    line = ".".join(importlib.metadata.version("megatron-core").split(".")[:2])
    assert set(ws1.shim_counts()[0]) == WS1_SHIMS[line], f"megatron-core {line}'s CUDA points"


def _learned(records) -> bool:
    per_token = [r.loss_sum / r.num_tokens for r in records]
    return sum(per_token[-8:]) / 8 < sum(per_token[:8]) / 8 - 0.5


def test_tensor_parallel_2_reads_once_and_learns(tp2: Run) -> None:
    records = tp2.records()
    assert list(records) == [0], "TP=2 has a single data-parallel rank (TP rank 0 logs)"
    assert [(r.iteration, r.sample_ids) for r in records[0]] == [
        (k, _sampler_ids(k, m, 0, 1))
        for k in range(1, 21)
        for m in range(GLOBAL_BATCH // MICRO_BATCH)
    ]
    assert _learned(records[0]), "the TP=2 model did not learn"
    assert "successfully saved checkpoint from iteration      20" in tp2.log
    _assert_clean_shims(tp2, 2)


def test_data_parallel_2_ranks_read_the_sampler_slices(drill: dict[str, Run]) -> None:
    records = drill["U"].records()
    assert sorted(records) == [0, 1]
    for dp_rank, recs in records.items():
        assert len(recs) == 20 * GLOBAL_BATCH // (MICRO_BATCH * 2)
        for r in recs:
            assert r.sample_ids == _sampler_ids(r.iteration, r.microbatch, dp_rank, 2)
    _assert_clean_shims(drill["U"], 2)


# The distributed optimizer's kill -9 resume and skips are proven by the layout matrix
# (dp2-pp2-distopt-tied, bit-exact) and tests/faults; here DDP alone.
@pytest.mark.parametrize("drill", ["ddp"], indirect=True)
def test_kill_9_then_resume_replays_exactly(drill: dict[str, Run]) -> None:
    assert drill["K"].returncode != 0, "the crash drill must really kill the job"
    uninterrupted, killed, resumed = (drill[k].records() for k in "UKR")
    for dp_rank in (0, 1):
        before = [r for r in killed[dp_rank] if r.iteration <= 10]
        assert resumed[dp_rank][0].iteration == 11
        # Bit-exact: sample ids and token-summed losses, micro-batch by micro-batch.
        assert before + resumed[dp_rank] == uninterrupted[dp_rank]


@pytest.mark.parametrize("drill", ["ddp"], indirect=True)
def test_resume_with_skipped_iterations_drops_exactly_those_batches(
    drill: dict[str, Run],
) -> None:
    uninterrupted, killed, skipped = (drill[k].records() for k in "UKS")
    trained = 0
    for dp_rank in (0, 1):
        sequence = [r for r in killed[dp_rank] if r.iteration <= 10] + skipped[dp_rank]
        expected = [r for r in uninterrupted[dp_rank] if r.iteration not in SKIPPED]
        assert [(r.iteration, r.sample_ids) for r in sequence] == [
            (r.iteration, r.sample_ids) for r in expected
        ]
        # Training is identical until the first skipped iteration.
        assert [r for r in sequence if r.iteration < SKIPPED[0]] == [
            r for r in expected if r.iteration < SKIPPED[0]
        ]
        trained += sum(len(r.sample_ids) for r in sequence)
    final = checkpoint_args(drill["S"].workdir / "ckpt", 20)
    assert final.skipped_train_samples == len(SKIPPED) * GLOBAL_BATCH
    assert final.consumed_train_samples == 20 * GLOBAL_BATCH
    assert final.consumed_train_samples == trained + final.skipped_train_samples
