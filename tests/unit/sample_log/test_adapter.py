"""The sample-log feature's hooks in process, on a real GPTModel's per-token loss: the record it
writes holds the micro-batch's sample ids, token digests and losses as computed directly, one
line per micro-batch in order; evaluation batches are not logged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ext.common.features import LM_LOSS_PER_TOKEN, LossInputs, MicroBatch, StepRecord
from megatron_ext.common.files import sample_log_file
from megatron_ext.common.io import token_sha1
from megatron_ext.common.records.sample_log import read_records
from megatron_ext.sample_log.adapter import SAMPLE_ID_KEY, SampleLogFeature
from tests.support import megatron_world as mw


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world():
        yield


def _step(iteration: int) -> StepRecord:
    return StepRecord(iteration, {}, 1e-3, 1.0, False, 1.0, 1.0, None, None)


def test_records_hold_what_the_micro_batches_trained_on(world, tmp_path: Path) -> None:
    model = mw.tiny_gpt()
    feature = SampleLogFeature()
    feature.install(mw.args(sample_log_dir=str(tmp_path)))
    expected = []
    for index, (ids, lm_scale) in enumerate((([7, 3], None), ([40, 41], 0.5))):
        micro = {**mw.batch(seed=index), SAMPLE_ID_KEY: torch.tensor(ids)}
        batch = MicroBatch(4, True, 0, True)
        feature.on_batch(micro, batch)
        with torch.no_grad():
            per_token = model(micro["tokens"], micro["position_ids"], None, labels=micro["labels"])
        mask = micro["loss_mask"].clone()
        mask[1, 10:] = 0
        if lm_scale is not None:  # a z-loss run publishes the pure CE on the micro-batch
            batch.extras[LM_LOSS_PER_TOKEN] = per_token * lm_scale
        flat = mask.reshape(-1)
        loss = (per_token.reshape(-1) * flat).sum()
        feature.on_loss(LossInputs(batch, per_token, flat, loss, flat.sum().int()))
        evaluation = MicroBatch(4, False, 0, True)
        feature.on_batch(micro, evaluation)
        assert evaluation.extras == {}  # evaluation batches are not logged
        per_sample = ((per_token * mask).sum(1) / mask.sum(1)).tolist()
        lm = float(loss) * (lm_scale or 1.0)
        expected.append(
            (ids, [token_sha1(row) for row in micro["tokens"]], float(loss), lm, per_sample)
        )
    feature.after_step(_step(4))
    feature.after_step(_step(5))  # nothing trained since: nothing written

    records = list(read_records(sample_log_file(tmp_path, 0)))
    assert [(r.iteration, r.dp_rank, r.microbatch) for r in records] == [(4, 0, 0), (4, 0, 1)]
    for record, (ids, digests, loss, lm, per_sample) in zip(records, expected):
        assert record.sample_ids == ids and record.token_sha1 == digests
        assert record.num_tokens == 2 * mw.SEQ - 6
        assert record.loss_sum == pytest.approx(loss, rel=1e-6)
        assert record.lm_loss_sum == pytest.approx(lm, rel=1e-6)
        assert record.sample_losses == pytest.approx(per_sample, rel=1e-6)
