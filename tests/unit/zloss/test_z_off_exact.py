"""z-loss off is Megatron's cross entropy, exactly, on a real GPTModel (issue #31, item 4).

OLMo-core shipped a fused path that added the z-loss while it was off (OLMo-core PR #702). Here
"off" is ``--z-loss-coeff 0``, and two overlay paths still run then:

- ``--log-output-z`` patches the loss method with the overlay's one-pass kernel at ``c = 0``
  (to read log Z): loss and every gradient must equal Megatron's bit for bit;
- ``--fused-output-loss`` replaces the output layer + cross entropy: equal to Megatron's up to
  the fp32 round-off of chunked matmuls, which this model's log Z makes far smaller than any
  z term a leaked coefficient (OLMo 2's 1e-5 or more) would add, so a leak fails the test.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.common.features import LossInputs, MicroBatch
from megatron_ext.registry.table import patch
from megatron_ext.zloss.adapter import ZLossFeature
from tests.support import megatron_world as mw

SMALLEST_COEFF = 1e-5  # OLMo 2/3's z-loss coefficient: the smallest one in use
FUSED_RTOL = 1e-6  # chunked vs whole fp32 matmuls


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world(), mw.patches_undone():
        yield


def _step(model: torch.nn.Module, micro: dict, feature: ZLossFeature | None) -> tuple:
    """Per-token loss, grads by name and (with a feature) its report of the micro-batch."""
    model.zero_grad(set_to_none=True)
    loss = model(
        micro["tokens"],
        micro["position_ids"],
        None,
        labels=micro["labels"],
        loss_mask=micro["loss_mask"],
    )
    mask = micro["loss_mask"].reshape(-1)
    total = torch.sum(loss.reshape(-1).float() * mask)
    report = {}
    if feature is not None:
        report = feature.on_loss(
            LossInputs(MicroBatch(1, True, 0), loss, mask, total, mask.sum().to(torch.int))
        )
    total.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, report


def _feature(**flags: object) -> ZLossFeature:
    feature = ZLossFeature()
    values = {**mw.PLAIN_OUTPUT_LOSS, "z_loss_coeff": 0.0, **flags}
    args = mw.args(overlap_grad_reduce=False, **values)
    assert feature.enabled(args)
    feature.validate(args)
    feature.install(args)
    return feature


def _log_z(model: torch.nn.Module, micro: dict) -> torch.Tensor:
    """Per-token log Z of the model's own logits (Megatron's output path, no labels)."""
    with torch.no_grad():
        logits = model(micro["tokens"], micro["position_ids"], None)
    return torch.logsumexp(logits.float(), dim=-1)


def test_the_log_z_signal_at_c0_is_megatrons_cross_entropy_bit_for_bit(world) -> None:
    model, micro = mw.tiny_gpt(), mw.batch(seed=5)
    megatron_loss, megatron_grads, _ = _step(model, micro, None)
    feature = _feature(log_output_z=True)
    applied = patch("zloss-output-layer")
    applied.apply(feature)
    try:
        loss, grads, report = _step(model, micro, feature)
    finally:
        applied.remove()
    assert torch.equal(loss, megatron_loss)
    assert grads.keys() == megatron_grads.keys()
    assert all(torch.equal(grads[n], megatron_grads[n]) for n in grads)
    # lm loss stays Megatron's own report; the signal is the signed mean log Z.
    assert list(report) == ["log z"]
    total, tokens = report["log z"]
    torch.testing.assert_close(total / tokens, _log_z(model, micro).mean(), rtol=1e-5, atol=0)


def test_evaluation_reports_no_log_z(world) -> None:
    """A signal of training steps: an evaluation entry would make Megatron print its PPL."""
    model, micro = mw.tiny_gpt(), mw.batch(seed=6)
    feature = _feature(log_output_z=True)
    applied = patch("zloss-output-layer")
    applied.apply(feature)
    try:
        with torch.no_grad():
            loss = model(micro["tokens"], micro["position_ids"], None, labels=micro["labels"])
    finally:
        applied.remove()
    mask = micro["loss_mask"].reshape(-1)
    evaluation = LossInputs(MicroBatch(1, False, 0), loss, mask, loss.sum(), mask.sum().int())
    assert feature.on_loss(evaluation) == {}
    assert feature.pending == []  # nothing kept across micro-batches


@pytest.mark.parametrize("log_z", [False, True])
def test_the_fused_path_at_c0_adds_no_z_term(world, log_z: bool) -> None:
    model, micro = mw.tiny_gpt(), mw.batch(seed=7)
    megatron_loss, megatron_grads, _ = _step(model, micro, None)
    feature = _feature(fused_output_loss=True, log_output_z=log_z)
    feature.chunk_tokens = 5  # several chunks, a ragged last one
    fused = patch("fused-output-loss")
    fused.apply(feature)
    try:
        loss, grads, report = _step(model, micro, feature)
    finally:
        fused.remove()
    # The smallest z term in use would move the loss by far more than the tolerance allows.
    leak = SMALLEST_COEFF * _log_z(model, micro).square()
    assert leak.min().item() > 20 * FUSED_RTOL * megatron_loss.abs().max().item()
    torch.testing.assert_close(loss, megatron_loss, rtol=FUSED_RTOL, atol=0)
    for name, grad in grads.items():
        scale = megatron_grads[name].abs().max().item()
        torch.testing.assert_close(grad, megatron_grads[name], rtol=1e-5, atol=1e-6 * scale)
    assert list(report) == (["log z"] if log_z else [])
