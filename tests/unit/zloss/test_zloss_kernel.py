"""The z-loss kernel: values and gradients against a float64 full-vocabulary reference (TP=1
and TP=2 over gloo), bit-equality with Megatron's cross entropy at c=0, input logits
untouched, bf16 inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ext.zloss import cross_entropy_and_z_loss, vocab_parallel_cross_entropy_with_z_loss

COEFFS = (0.0, 1e-4, 1e-2)
SEQ, BATCH, VOCAB = 8, 3, 96
RTOL = 1e-5


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-vocabulary fp32 logits (offset so log Z is large and the z term matters), targets
    and per-token weights that include a loss mask (a third of the tokens masked out)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=gen) * 3 + 20
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    mask = (torch.rand(SEQ, BATCH, generator=gen) > 0.33).float()
    weights = mask * torch.rand(SEQ, BATCH, generator=gen)
    return logits, target, weights


def _reference(
    logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, coeff: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token CE + c·log²Z, log²Z and d(Σ weights·loss)/dlogits, in float64."""
    x = logits.double().requires_grad_()
    log_z = torch.logsumexp(x, dim=-1)
    z = log_z**2
    loss = log_z - x.gather(-1, target.unsqueeze(-1)).squeeze(-1) + coeff * z
    (loss * weights.double()).sum().backward()
    return loss.detach(), z.detach(), x.grad


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=RTOL, atol=1e-9)


@pytest.mark.parametrize("coeff", COEFFS)
def test_tp1_value_and_gradient_match_the_fp64_reference(coeff: float) -> None:
    logits, target, weights = _problem()
    expected_loss, expected_z, expected_grad = _reference(logits, target, weights, coeff)
    x = logits.clone().requires_grad_()
    loss, z = vocab_parallel_cross_entropy_with_z_loss(x, target, coeff)
    (loss * weights).sum().backward()
    _close(loss, expected_loss)
    _close(z, expected_z)
    _close(x.grad, expected_grad)
    assert torch.equal(x.grad[weights == 0], torch.zeros_like(x.grad[weights == 0]))
    assert not z.requires_grad and loss.dtype == z.dtype == torch.float32


def test_input_logits_are_not_modified() -> None:
    logits, target, weights = _problem()
    x = logits.clone().requires_grad_()
    loss, _ = vocab_parallel_cross_entropy_with_z_loss(x, target, 1e-4)
    (loss * weights).sum().backward()
    assert torch.equal(x.detach(), logits)


def test_bf16_logits_are_computed_in_fp32() -> None:
    logits, target, weights = _problem()
    low = logits.bfloat16().requires_grad_()
    upcast = low.detach().float().requires_grad_()
    loss_low, z_low = vocab_parallel_cross_entropy_with_z_loss(low, target, 1e-2)
    loss_up, z_up = vocab_parallel_cross_entropy_with_z_loss(upcast, target, 1e-2)
    (loss_low * weights).sum().backward()
    (loss_up * weights).sum().backward()
    assert loss_low.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    assert torch.equal(loss_low, loss_up) and torch.equal(z_low, z_up)
    assert torch.equal(low.grad, upcast.grad.bfloat16())
    _close(loss_low, _reference(upcast.detach(), target, weights, 1e-2)[0])


def test_label_smoothing_is_refused() -> None:
    logits, target, _ = _problem()
    with pytest.raises(ValueError, match="does not support label smoothing"):
        vocab_parallel_cross_entropy_with_z_loss(logits, target, 1e-4, label_smoothing=0.1)


def _megatron_equality_at_tp1(group: dist.ProcessGroup) -> None:
    """c = 0 equals Megatron's cross entropy bit for bit, values and gradients, fp32 and bf16."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, target, weights = _problem()
    for dtype in (torch.float32, torch.bfloat16):
        a = logits.to(dtype).clone().requires_grad_()
        b = logits.to(dtype).clone().requires_grad_()
        megatron_loss = vocab_parallel_cross_entropy(a * 1, target, tp_group=group)
        (megatron_loss * weights).sum().backward()
        terms = cross_entropy_and_z_loss(b, target, 0.0, group)
        (terms.loss * weights).sum().backward()
        assert torch.equal(terms.loss, megatron_loss), dtype
        assert torch.equal(terms.cross_entropy, megatron_loss), dtype
        assert torch.equal(b.grad, a.grad), dtype


def _tp2_worker(rank: int, init_file: str) -> None:
    """One of two TP ranks: its vocabulary half, checked against the full reference."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    singletons = [dist.new_group([0]), dist.new_group([1])]
    _megatron_equality_at_tp1(singletons[rank])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    logits, target, weights = _problem(seed=1)
    half = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
    for coeff in COEFFS:
        expected_loss, expected_z, expected_grad = _reference(logits, target, weights, coeff)
        shard = logits[..., half].clone()
        x = shard.clone().requires_grad_()
        loss, z = vocab_parallel_cross_entropy_with_z_loss(x, target, coeff, group)
        (loss * weights).sum().backward()
        _close(loss, expected_loss)
        _close(z, expected_z)
        _close(x.grad, expected_grad[..., half])
        assert torch.equal(x.detach(), shard)
        # tp_group=None means Megatron's tensor-parallel group once parallel_state is set up.
        y = shard.clone().requires_grad_()
        default_loss, _ = vocab_parallel_cross_entropy_with_z_loss(y, target, coeff)
        (default_loss * weights).sum().backward()
        assert torch.equal(default_loss, loss) and torch.equal(y.grad, x.grad)
        if coeff == 0.0:
            m = shard.clone().requires_grad_()
            megatron_loss = vocab_parallel_cross_entropy(m * 1.0, target, tp_group=group)
            (megatron_loss * weights).sum().backward()
            assert torch.equal(loss, megatron_loss) and torch.equal(x.grad, m.grad)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_tp2_over_gloo_matches_the_reference_and_megatron_at_c0(tmp_path: Path) -> None:
    """Two gloo processes; each also checks TP=1 bit-equality with Megatron on its own."""
    mp.spawn(_tp2_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)


def test_overwriting_mode_gives_the_same_results() -> None:
    """The training path lets fp32 logits be the working buffer, like Megatron's CE."""
    logits, target, weights = _problem()
    kept, scratch = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    terms = cross_entropy_and_z_loss(kept, target, 1e-4)
    fast = cross_entropy_and_z_loss(scratch * 1.0, target, 1e-4, overwrite_logits=True)
    (terms.loss * weights).sum().backward()
    (fast.loss * weights).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(terms, fast))
    assert torch.equal(kept.grad, scratch.grad)
