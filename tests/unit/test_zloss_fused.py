"""The fused output layer + CE + z-loss (``--fused-output-loss``): loss, input gradient and
weight gradient against the unfused path (Megatron's ``ColumnParallelLinear`` output layer +
the overlay's CE + z-loss) at TP=1 and TP=2 over gloo, fp32 and bf16, tied and untied, and
against a float64 reference; chunking, evaluation, ``main_grad`` and the gradient check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ext.zloss import cross_entropy_and_z_loss
from megatron_ext.zloss.fused import default_chunk_tokens, fused_output_loss

SEQ, BATCH, HIDDEN, VOCAB = 12, 2, 16, 96
COEFFS = (0.0, 1e-4, 1e-2)
FP32_RTOL = 1e-5  # fp32 round-off: chunked vs whole matmuls, one all-reduce vs two
BF16_RTOL = 2.0**-7  # two bf16 unit roundoffs: bf16 logits and bf16 gradients round alike
# (gradients: atol relative to the largest entry, as bf16 rounds each entry to 8 bits)


def _problem(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Hidden states [s, b, h], a full-vocabulary weight [V, h] (scaled so log Z is large and
    the z term matters), labels and loss mask [b, s] as GPTModel hands them (a third masked),
    and the schedule's loss scale."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5 + 0.3
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.33).float()
    return hidden, weight, labels, mask, torch.tensor(0.375)


def _fused(hidden, weight, labels, mask, scale, coeff, group=None, **kwargs):
    """Per-token [b, s] loss as the adapter computes it, Megatron's loss on top, backward."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    terms = fused_output_loss(
        h, w, labels.T.contiguous(), mask.T.contiguous(), z_loss_coeff=coeff, tp_group=group,
        **kwargs,
    )
    loss = terms.loss.T.contiguous()
    (torch.sum(loss.view(-1).float() * mask.view(-1)) * scale).backward()
    return loss.detach(), terms.z_loss.T, h.grad, w.grad


def _unfused(hidden, weight, labels, mask, scale, coeff, group, tied):
    """Megatron's output layer (tied: the weight passed in, as GPTModel does) + the z-loss."""
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=dist.get_world_size(group),
        use_cpu_initialization=True,
        params_dtype=weight.dtype,
    )
    layer = ColumnParallelLinear(
        HIDDEN, VOCAB, config=config,
        init_method=torch.nn.init.zeros_, bias=False, skip_weight_param_allocation=tied,
        tp_group=group,
    )
    w = weight.clone().requires_grad_()
    if not tied:
        with torch.no_grad():
            layer.weight.copy_(weight)
        w = layer.weight
    h = hidden.clone().requires_grad_()
    logits, _ = layer(h, weight=w if tied else None)
    terms = cross_entropy_and_z_loss(
        logits, labels.T.contiguous(), coeff, group, overwrite_logits=True
    )
    loss = terms.loss.T.contiguous()
    (torch.sum(loss.view(-1).float() * mask.view(-1)) * scale).backward()
    return loss.detach(), terms.z_loss.T, h.grad, w.grad


def _reference(hidden, weight, labels, mask, scale, coeff):
    """Float64, full vocabulary: loss, log²Z, d/dhidden, d/dweight."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logits = (h @ w.T).transpose(0, 1)  # [b, s, V]
    log_z = torch.logsumexp(logits, dim=-1)
    loss = log_z - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) + coeff * log_z**2
    (torch.sum(loss * mask.double()) * scale.double()).backward()
    return loss.detach(), (log_z**2).detach(), h.grad, w.grad


def _assert_close(actual, expected, rtol: float) -> None:
    for a, e in zip(actual, expected, strict=True):
        a, e = a.double(), e.double()
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * e.abs().max().item())


@pytest.mark.parametrize("coeff", COEFFS)
def test_fp64_reference(coeff: float) -> None:
    problem = _problem()
    _assert_close(_fused(*problem, coeff, chunk_tokens=5), _reference(*problem, coeff), FP32_RTOL)


def test_chunk_size_changes_nothing_but_round_off() -> None:
    problem = _problem()
    whole = _fused(*problem, 1e-4, chunk_tokens=SEQ * BATCH)
    for chunk in (1, 7, None):
        _assert_close(_fused(*problem, 1e-4, chunk_tokens=chunk), whole, FP32_RTOL)
    assert default_chunk_tokens(32768) == 1024 and default_chunk_tokens(131072) == 256
    assert default_chunk_tokens(10**9) == 64 and default_chunk_tokens(1000) == 4096


def test_evaluation_computes_the_loss_only() -> None:
    hidden, weight, labels, mask, _ = _problem()
    with torch.no_grad():
        terms = fused_output_loss(hidden, weight, labels.T, mask.T, z_loss_coeff=1e-4)
    expected = _reference(hidden, weight, labels, mask, torch.tensor(1.0), 1e-4)
    _assert_close((terms.loss.T, terms.z_loss.T), expected[:2], FP32_RTOL)
    assert not terms.loss.requires_grad


def test_a_gradient_that_is_not_mask_times_a_scalar_is_refused() -> None:
    hidden, weight, labels, mask, _ = _problem()
    h = hidden.clone().requires_grad_()
    loss = fused_output_loss(h, weight, labels.T, mask.T, z_loss_coeff=1e-4).loss
    with pytest.raises(RuntimeError, match="not the loss mask times one scalar"):
        (loss * torch.rand(loss.shape)).sum().backward()


def test_gradient_accumulation_fusion_adds_to_main_grad() -> None:
    """As Megatron's linear does with fusion: wgrad into main_grad, a dummy .grad."""
    hidden, weight, labels, mask, scale = _problem()
    expected = _fused(hidden, weight, labels, mask, scale, 1e-4)[3]
    w = weight.clone().requires_grad_()
    w.main_grad = torch.ones_like(w)
    w.grad_added_to_main_grad = False
    loss = fused_output_loss(
        hidden.requires_grad_(), w, labels.T, mask.T, z_loss_coeff=1e-4,
        accumulate_into_main_grad=True,
    ).loss.T
    (torch.sum(loss.reshape(-1) * mask.view(-1)) * scale).backward()
    torch.testing.assert_close(w.main_grad, expected + 1, rtol=FP32_RTOL, atol=0)
    assert w.grad_added_to_main_grad


def test_mismatched_shapes_are_refused() -> None:
    hidden, weight, labels, mask, _ = _problem()
    with pytest.raises(ValueError, match="do not describe the same tokens"):
        fused_output_loss(hidden, weight, labels[:, 1:], mask[:, 1:])


def _check_against_unfused(group: dist.ProcessGroup, rank: int, world: int) -> None:
    """Every case on this TP group: this rank's vocabulary shard of the same problem."""
    hidden, weight, labels, mask, scale = _problem(seed=1)
    shard = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
    expected = _reference(hidden, weight, labels, mask, scale, 1e-4)
    expected = (*expected[:3], expected[3][shard])
    for dtype, rtol in ((torch.float32, FP32_RTOL), (torch.bfloat16, BF16_RTOL)):
        h, w = hidden.to(dtype), weight[shard].contiguous().to(dtype)
        for tied in (False, True):
            for coeff in COEFFS:
                unfused = _unfused(h, w, labels, mask, scale, coeff, group, tied)
                fused = _fused(h, w, labels, mask, scale, coeff, group, chunk_tokens=5)
                _assert_close(fused, unfused, rtol)
                assert fused[2].dtype == fused[3].dtype == dtype
        if dtype == torch.float32:
            fused = _fused(h, w, labels, mask, scale, 1e-4, group, chunk_tokens=5)
            _assert_close(fused, expected, FP32_RTOL)


def _tp_worker(rank: int, init_file: str) -> None:
    """One of two TP ranks; rank 0 also checks TP=1 on a group of its own."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        singletons = [dist.new_group([0]), dist.new_group([1])]
        if rank == 0:
            _check_against_unfused(singletons[0], 0, 1)
        _check_against_unfused(dist.group.WORLD, rank, 2)
    finally:
        dist.destroy_process_group()


def test_equals_megatrons_output_layer_and_the_z_loss_at_tp1_and_tp2(tmp_path: Path) -> None:
    """Two gloo processes: fp32 to round-off, bf16 to two bf16 units; tied and untied."""
    mp.spawn(_tp_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)
