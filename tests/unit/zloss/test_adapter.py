"""The z-loss feature on a real GPTModel, in process: once installed, the model's training loss
is ``CE + c·log²Z`` of its own logits, and the loss function's ``lm loss`` report is Megatron's
own cross entropy (the unpatched model's loss), ``z loss`` the core's log²Z."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.common.features import LM_LOSS_PER_TOKEN, LossInputs, MicroBatch
from megatron_ext.loop import install as loop
from megatron_ext.zloss.adapter import ZLossFeature
from megatron_ext.zloss.core import cross_entropy_and_z_loss
from tests.support import megatron_world as mw

COEFF = 1e-2  # large enough that the z term is far above float noise


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world(), mw.patches_undone():
        yield


def test_lm_loss_report_is_megatrons_cross_entropy(world) -> None:
    model = mw.tiny_gpt()
    micro = mw.batch(seed=3)
    inputs = (micro["tokens"], micro["position_ids"], None)
    with torch.no_grad():
        megatron_ce = model(*inputs, labels=micro["labels"])  # [b, s], Megatron's own loss
        logits = model(*inputs)  # [b, s, v]

    feature = ZLossFeature()
    feature.install(mw.args(z_loss_coeff=COEFF, **mw.PLAIN_OUTPUT_LOSS))
    loop.apply_patches_of(feature)
    with torch.no_grad():
        loss = model(*inputs, labels=micro["labels"])
    core = cross_entropy_and_z_loss(logits.transpose(0, 1).contiguous(), micro["labels"].T, COEFF)
    torch.testing.assert_close(loss, core.loss.T)
    torch.testing.assert_close(core.cross_entropy.T, megatron_ce)

    mask = micro["loss_mask"].reshape(-1)
    mask[5:9] = 0  # masked tokens count in neither term
    batch = MicroBatch(1, True, 0, True)
    report = feature.on_loss(
        LossInputs(batch, loss, mask, (loss.reshape(-1) * mask).sum(), mask.sum().int())
    )
    assert list(report) == ["lm loss", "z loss"]
    lm_sum, tokens = report["lm loss"]
    assert int(tokens) == int(mask.sum())
    torch.testing.assert_close(lm_sum, (megatron_ce.reshape(-1) * mask).sum())
    torch.testing.assert_close(report["z loss"][0], (core.z_loss.T.reshape(-1) * mask).sum())
    assert report["z loss"][0] > 0
    # The other features read the pure CE of this micro-batch, not the training loss.
    torch.testing.assert_close(batch.extras[LM_LOSS_PER_TOKEN], megatron_ce)
