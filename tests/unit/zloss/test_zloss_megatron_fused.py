"""z-loss under ``--cross-entropy-loss-fusion`` (native): Megatron's fused cross entropy rebuilt
from its own pieces with log Z. Against the overlay's unfused kernel at TP=1 and TP=2 over gloo
(forward terms bit for bit, the gradient as Megatron's fused backward rounds it: bf16), against
Megatron's fused CE at c=0 bit for bit, and on a real GPTModel with the fusion on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ext.common.features import LossInputs, MicroBatch
from megatron_ext.registry.table import patch
from megatron_ext.zloss.adapter import ZLossFeature, fused_cross_entropy_and_z_loss
from megatron_ext.zloss.core import cross_entropy_and_z_loss
from tests.support import megatron_world as mw

COEFFS = (0.0, 1e-4, 1e-2)
SEQ, BATCH, VOCAB = 8, 3, 96


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-vocabulary logits (offset: log Z large, the z term matters), targets, weights
    with a third of the tokens masked."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=gen) * 3 + 20
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    weights = (torch.rand(SEQ, BATCH, generator=gen) > 0.33) * torch.rand(SEQ, BATCH, generator=gen)
    return logits, target, weights


def _backward(loss: torch.Tensor, weights: torch.Tensor) -> None:
    (loss * weights).sum().backward()


def _check(group: dist.ProcessGroup, part: slice) -> None:
    """This rank's vocabulary ``part`` of the problem, fp32 and bf16, every coefficient."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    logits, target, weights = _problem()
    for dtype in (torch.float32, torch.bfloat16):
        for coeff in COEFFS:
            shard = logits[..., part].to(dtype)
            x, y = shard.clone().requires_grad_(), shard.clone().requires_grad_()
            fused = fused_cross_entropy_and_z_loss(x * 1, target, coeff, group)  # x * 1: the
            plain = cross_entropy_and_z_loss(y, target, coeff, group)  # fp32 work buffer
            _backward(fused.loss, weights)
            _backward(plain.loss, weights)
            assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True)), coeff
            # Megatron's fused backward returns bf16: the unfused gradient, rounded so.
            assert torch.equal(x.grad, plain_grad := y.grad.to(torch.bfloat16).to(dtype)), coeff
            assert x.grad.dtype == dtype and plain_grad.abs().max() > 0
            if coeff == 0.0:
                m = shard.clone().requires_grad_()
                megatron = fused_vocab_parallel_cross_entropy(m * 1, target, group)
                _backward(megatron, weights)
                assert torch.equal(fused.loss, megatron) and torch.equal(x.grad, m.grad)
            else:  # the z term is in both the loss and the gradient
                assert torch.all(fused.loss > fused.cross_entropy)


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    singletons = [dist.new_group([0]), dist.new_group([1])]
    pair = dist.new_group([0, 1])
    with torch.compiler.set_stance("force_eager"):  # the pieces are torch.compile'd
        _check(singletons[rank], slice(None))  # TP=1: the whole vocabulary
        _check(pair, slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2))
    dist.destroy_process_group()


def test_composition_equals_the_unfused_z_loss_at_tp1_and_tp2(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)


# -- a real GPTModel with cross_entropy_loss_fusion=True ----------------------------------------


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world(), mw.patches_undone(), torch.compiler.set_stance("force_eager"):
        yield


def _step(model: torch.nn.Module, micro: dict, feature: ZLossFeature | None) -> tuple:
    """Per-token loss, grads by name and (with a feature) its report of the micro-batch."""
    model.zero_grad(set_to_none=True)
    loss = model(micro["tokens"], micro["position_ids"], None, labels=micro["labels"])
    mask = micro["loss_mask"].reshape(-1)
    total = torch.sum(loss.reshape(-1) * mask)
    report = {}
    if feature is not None:
        inputs = LossInputs(MicroBatch(1, True, 0), loss, mask, total, mask.sum().to(torch.int))
        report = feature.on_loss(inputs)
    total.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, report


def _patched_step(model: torch.nn.Module, micro: dict, **flags: object) -> tuple:
    feature = ZLossFeature()
    args = mw.args(**{**mw.PLAIN_OUTPUT_LOSS, "cross_entropy_loss_fusion": True, **flags})
    feature.validate(args)  # not refused
    feature.install(args)
    applied = patch("zloss-output-layer")
    applied.apply(feature)
    try:
        return _step(model, micro, feature)
    finally:
        applied.remove()


def test_log_z_at_c0_is_megatrons_fused_cross_entropy_bit_for_bit(world) -> None:
    model, micro = mw.tiny_gpt(cross_entropy_loss_fusion=True), mw.batch(seed=5)
    megatron_loss, megatron_grads, _ = _step(model, micro, None)
    loss, grads, report = _patched_step(model, micro, z_loss_coeff=0.0, log_output_z=True)
    assert torch.equal(loss, megatron_loss)
    assert all(torch.equal(grads[n], megatron_grads[n]) for n in megatron_grads)
    with torch.no_grad():
        log_z = torch.logsumexp(model(micro["tokens"], micro["position_ids"], None), dim=-1)
    assert list(report) == ["log z"]
    torch.testing.assert_close(report["log z"][0] / report["log z"][1], log_z.mean())


def test_z_loss_with_the_fusion_is_the_unfused_z_loss(world) -> None:
    """Same loss and reports as the overlay's kernel (the fusion off on the same model); the
    weights' gradients differ only by the bf16 rounding of Megatron's fused backward."""
    model, micro = mw.tiny_gpt(cross_entropy_loss_fusion=True), mw.batch(seed=6)
    megatron_ce, _, _ = _step(model, micro, None)
    flags = {"z_loss_coeff": 1e-2, "log_output_z": True}
    loss, grads, report = _patched_step(model, micro, **flags)
    model.config.cross_entropy_loss_fusion = False
    plain_loss, plain_grads, plain_report = _patched_step(model, micro, **flags)
    assert list(report) == ["lm loss", "z loss", "log z"]
    assert torch.equal(loss, plain_loss) and not torch.equal(loss, megatron_ce)
    assert all(torch.equal(report[k], plain_report[k]) for k in report)
    assert torch.equal(report["lm loss"][0], torch.sum(megatron_ce.reshape(-1)))
    assert any(not torch.equal(grads[n], plain_grads[n]) for n in grads), "not the fused path"
    for name, grad in grads.items():
        scale = plain_grads[name].abs().max().item()
        torch.testing.assert_close(grad, plain_grads[name], rtol=2**-7, atol=2**-7 * scale)
