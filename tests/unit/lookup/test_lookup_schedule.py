"""Lookup batch arithmetic against Megatron's own micro-batch calculators, samplers and rank
generator: iteration / micro-batch / DP rank <-> sample positions, skips, phases, anchors."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from megatron.core import num_microbatches_calculator as nmc
from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
from megatron.core.parallel_state import RankGenerator
from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
)

from megatron_ext.common import versions
from megatron_ext.lookup.config import honours_rampup, megatron_namespace, run_config
from megatron_ext.lookup.errors import ConfigError, PositionError
from megatron_ext.lookup.schedule import (
    Anchor,
    CyclicOrder,
    Schedule,
    Topology,
    parse_step_schedule,
    rampup_schedule,
    rampup_train_iters,
)

# The compatibility tier runs this module on every supported megatron-core (tests/compat).
pytestmark = pytest.mark.compat


# megatron-core 0.17 ramps the batch up; 0.18 replaced that with the step schedule.
RAMPUP_CALCULATOR = getattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator", None)
STEP_CALCULATOR = getattr(nmc, "StepBatchsizeNumMicroBatchesCalculator", None)


def test_positions_equal_megatron_calculators_and_locate_inverts_them() -> None:
    """Constant, rounded-down and step-schedule batches walk like Megatron's training loop."""
    cases = [
        (dict(global_batch_size=12), ConstantNumMicroBatchesCalculator(12, 2, 3, False, 0)),
        (
            dict(global_batch_size=14, decrease_batch_size_if_needed=True),
            ConstantNumMicroBatchesCalculator(14, 2, 3, True, 0),
        ),
    ]
    if STEP_CALCULATOR is not None:  # 0.18 on
        cases.append(
            (
                dict(global_batch_size=6, step_schedule=parse_step_schedule("0:6 1K:12 3K:24", 16)),
                STEP_CALCULATOR(2, 3, False, 0, "0:6 1K:12 3K:24", 16),
            )
        )
    if RAMPUP_CALCULATOR is not None:  # 0.17: the ramp-up, also rounded down
        for rampup, gbs, decrease in (((6, 6, 200), 30, False), ((8, 4, 97), 24, True)):
            cases.append(
                (
                    dict(
                        global_batch_size=gbs,
                        step_schedule=rampup_schedule(rampup, gbs, 6, decrease),
                    ),
                    RAMPUP_CALCULATOR(gbs, 2, 3, decrease, 0, *rampup),
                )
            )
    for fields, calculator in cases:
        schedule = Schedule(micro_batch_size=2, data_parallel_size=3, train_iters=40, **fields)
        consumed = 0
        for iteration in range(1, 41):
            calculator.update(consumed, consistency_check=True)
            batch = schedule.batch(iteration)
            assert (batch.consumed_before, batch.size, batch.num_microbatches) == (
                consumed,
                calculator.get_current_running_global_batch_size(),
                calculator.get(),
            )
            for m in range(batch.num_microbatches):
                for r in range(3):
                    positions = schedule.positions(batch, m, r)
                    its, mbs, ranks = schedule.locate(positions, 0)
                    assert set(its) == {iteration} and set(mbs) == {m} and set(ranks) == {r}
            consumed += batch.size
        assert schedule.batch_at_consumed(schedule.batch(7).consumed_before).iteration == 7


def _megatron_rampup_sizes(rampup: list[int], gbs: int, mbs: int, dp: int) -> list[int]:
    """Per-iteration global batch sizes of the installed megatron-core's calculator, walked as
    train() walks it (update before each iteration, consumed += the running size)."""
    nmc.init_num_microbatches_calculator(0, rampup, gbs, mbs, dp)
    try:
        consumed, sizes = 0, []
        for _ in range(12):
            nmc.update_num_microbatches(consumed, consistency_check=True)
            sizes.append(nmc.get_current_running_global_batch_size())
            consumed += sizes[-1]
        return sizes
    finally:
        nmc.destroy_num_microbatches_calculator()


RAMPED = [4, 4, 4, 4, 4, 4, 8, 8, 8, 12, 12, 16]  # `--rampup-batch-size 4 4 64`, GBS 16, on 0.17.1


def test_rampup_batch_size_per_megatron_core_line() -> None:
    """0.17 ramps the batch up (the lookup follows it, to the sample), 0.18 on ignore it (the
    lookup says so); the installed megatron-core's own calculator is the reference."""
    ramped = Schedule(2, 2, 16, step_schedule=rampup_schedule((4, 4, 64), 16, 4, False))
    assert [ramped.batch(k).size for k in range(1, 13)] == RAMPED
    megatron = _megatron_rampup_sizes([4, 4, 64], 16, 2, 2)
    if RAMPUP_CALCULATOR is not None:
        assert megatron == RAMPED
        assert rampup_train_iters((4, 4, 64), 16, sum(RAMPED), 4) == len(RAMPED)
    else:
        assert megatron == [16] * 12  # deprecated and ignored
    with pytest.raises(ConfigError, match="divides by zero"):
        rampup_schedule((16, 4, 64), 16, 4, False)


def test_which_megatron_core_trained_the_run_decides_the_rampup() -> None:
    """A 0.17 checkpoint's args lack step_batch_size_schedule: its ramp-up is followed; a
    0.18+ checkpoint's ramp-up flag is reported as ignored; flags alone follow the installed
    megatron-core."""
    flags = "--seq-length 8 --micro-batch-size 2 --train-samples 88 --rampup-batch-size 4 4 64 "
    flags += "--global-batch-size 16 --data-path x"
    newer = megatron_namespace(flags.split(), None)
    older = argparse.Namespace(**vars(newer))
    if "step_batch_size_schedule" in vars(older):
        del older.step_batch_size_schedule  # as a 0.17 checkpoint saved it
    assert honours_rampup(older, from_checkpoint=True)
    newer_saved = argparse.Namespace(step_batch_size_schedule=None)
    assert not honours_rampup(newer_saved, from_checkpoint=True)
    installed_ramps = versions.installed().startswith("0.17.")
    assert honours_rampup(argparse.Namespace(), from_checkpoint=False) == installed_ramps
    for args, honoured in ((older, True), (newer, False)):
        config = run_config(args, data_parallel_size=2, checkpoint=None, rampup_honoured=honoured)
        sizes = [config.schedule.batch(k).size for k in range(1, config.schedule.train_iters + 1)]
        assert sizes == (RAMPED if honoured else [16] * 5)
        assert any("0.17, which ramps" in n if honoured else "ignored" in n for n in config.notes)
    with pytest.raises(ConfigError, match="iteration-based"):
        run_config(
            megatron_namespace(
                [*flags.split(), "--train-iters", "9", "--train-samples", "0"], None
            ),
            data_parallel_size=2,
            checkpoint=None,
            rampup_honoured=True,
        )


def test_skips_phases_and_anchors() -> None:
    schedule = Schedule(
        2, 2, 8, train_iters=30, iterations_to_skip=frozenset({13, 14}), anchor=Anchor(10, 80)
    )
    assert [schedule.batch(k).skipped for k in (12, 13, 14, 15)] == [False, True, True, False]
    assert schedule.batch(15).consumed_before == 14 * 8  # skipped batches are still consumed
    phased = Schedule(2, 2, 8, train_iters=30, phase_transitions=(10, 25))
    assert [(phased.batch(k).phase, phased.batch(k).stream_start) for k in (10, 11, 26)] == [
        (0, 72),
        (1, 0),
        (2, 0),
    ]
    assert phased.locate(np.array([0, 15]), 1)[0].tolist() == [11, 12]
    with pytest.raises(ConfigError, match="phase"):
        Schedule(2, 2, 6, phase_transitions=(5,), step_schedule=((0, 4), (40, 8)))
    resized = Schedule(2, 2, 8, train_iters=30, anchor=Anchor(10, 120))  # GBS changed at resume
    assert not resized.history_known and resized.batch(11).consumed_before == 120
    with pytest.raises(PositionError, match="precedes checkpoint iteration 10"):
        resized.batch(3)
    # positions after the anchor are placed by walking from it (--consumed-samples, inverse)
    assert resized.batch_at_consumed(128).iteration == 12
    assert resized.locate(np.array([120, 135]), 0)[0].tolist() == [11, 12]
    with pytest.raises(PositionError, match="sample position 40 precedes checkpoint"):
        resized.batch_at_consumed(40)
    with pytest.raises(PositionError, match="beyond --train-iters"):
        schedule.batch(31)


def test_cyclic_order_equals_megatrons_random_sampler() -> None:
    for total, mbs, dp, sharding in ((103, 2, 3, True), (96, 3, 2, False), (50, 1, 4, True)):
        order = CyclicOrder(total, mbs, dp, sharding)
        for rank in range(dp):
            sampler = MegatronPretrainingRandomSampler(None, total, 0, mbs, rank, dp, sharding)
            drawn = [batch for _ in range(3) for batch in sampler]  # cyclic_iter: 3 epochs
            positions = [
                np.arange(n * mbs * dp + rank * mbs, n * mbs * dp + (rank + 1) * mbs)
                for n in range(len(drawn))
            ]
            assert [order.dataset_indices(p).tolist() for p in positions] == drawn
            found, origin = order.positions_of(np.array(drawn[5]), epochs=3)
            for i, position in enumerate(positions[5].tolist()):
                assert position in found[origin == i].tolist()
    with pytest.raises(ConfigError, match="disagree"):
        CyclicOrder(10, 1, 4, False)


def test_reader_ranks_follow_megatrons_rank_generator() -> None:
    for tp, cp, dp, pp, order in ((2, 2, 3, 2, "tp-cp-ep-dp-pp"), (2, 1, 2, 3, "tp-cp-ep-pp-dp")):
        generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        topology = Topology(dp, tp, pp, cp, tp_pp_dp_mapping=order.endswith("dp"))
        for group in generator.get_ranks("dp"):
            for dp_rank, rank in enumerate(group):
                tp_rank = next(g.index(rank) for g in generator.get_ranks("tp") if rank in g)
                pp_rank = next(g.index(rank) for g in generator.get_ranks("pp") if rank in g)
                cp_rank = next(g.index(rank) for g in generator.get_ranks("cp") if rank in g)
                assert topology.rank(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank) == rank
        assert len(topology.readers(1)) == cp * len({0, pp - 1})
