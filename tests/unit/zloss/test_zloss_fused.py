"""The fused output layer + CE + z-loss (``--fused-output-loss``): loss, input gradient and
weight gradient against the unfused path (Megatron's ``ColumnParallelLinear`` output layer +
the overlay's CE + z-loss) at TP=1 and TP=2 over gloo, fp32 and bf16, tied and untied, and
against a float64 reference; chunking, evaluation, ``main_grad`` and the gradient check."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_ext.common.features import FeatureError, LossInputs, MicroBatch
from megatron_ext.registry.table import patch
from megatron_ext.zloss import cross_entropy_and_z_loss
from megatron_ext.zloss.adapter import ZLossFeature
from megatron_ext.zloss.core import default_chunk_tokens, fused_output_loss

SEQ, BATCH, HIDDEN, VOCAB = 12, 2, 16, 96
COEFFS = (0.0, 1e-4, 1e-2)
COEFF = 1e-4  # the GPTModel checks
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
        h,
        w,
        labels.T.contiguous(),
        mask.T.contiguous(),
        z_loss_coeff=coeff,
        tp_group=group,
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
        HIDDEN,
        VOCAB,
        config=config,
        init_method=torch.nn.init.zeros_,
        bias=False,
        skip_weight_param_allocation=tied,
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
        hidden.requires_grad_(),
        w,
        labels.T,
        mask.T,
        z_loss_coeff=1e-4,
        accumulate_into_main_grad=True,
    ).loss.T
    (torch.sum(loss.reshape(-1) * mask.view(-1)) * scale).backward()
    torch.testing.assert_close(w.main_grad, expected + 1, rtol=FP32_RTOL, atol=0)
    assert w.grad_added_to_main_grad


class _Allocations(TorchDispatchMode):
    """The largest new storage any op creates under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {  # views and in-place results are not new storages
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            new = isinstance(tensor, torch.Tensor) and (
                tensor.untyped_storage().data_ptr() not in given
            )
            if new:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


def _under_ddp(weight: torch.Tensor, main_grad_dtype: torch.dtype) -> torch.Tensor:
    """A weight as Megatron DDP leaves it: main_grad (holding an earlier micro-batch's) and the
    mark DDP resets each step."""
    w = weight.clone().requires_grad_()
    w.main_grad = torch.full(w.shape, 0.5, dtype=main_grad_dtype)
    w.grad_added_to_main_grad = False
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_known_scale_puts_the_weight_gradient_in_main_grad_during_the_forward(dtype) -> None:
    """Under Megatron DDP: main_grad gets the weight gradient in the forward, scaled by what
    the backward then sends; nothing weight-sized is allocated; no dummy .grad unless asked."""
    hidden, weight, labels, mask, scale = _problem()
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    expected = _fused(hidden, weight, labels, mask, scale, 1e-4)
    w = _under_ddp(weight, torch.float32)
    h = hidden.clone().requires_grad_()
    with _Allocations() as allocations:
        loss = fused_output_loss(
            h,
            w,
            labels.T,
            mask.T,
            z_loss_coeff=1e-4,
            chunk_tokens=5,
            accumulate_into_main_grad=True,
            grad_scale=scale,
            dummy_wgrad=False,
        ).loss.T
    in_forward = w.main_grad.clone()
    with allocations:
        (torch.sum(loss.reshape(-1) * mask.view(-1)) * scale).backward()
    assert allocations.largest < w.numel() * 2  # below one bf16 weight: no weight-sized buffer
    rtol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    gradient = expected[3].float()
    atol = rtol * gradient.abs().max().item()
    torch.testing.assert_close(in_forward, gradient + 0.5, rtol=rtol, atol=atol)
    torch.testing.assert_close(w.main_grad, in_forward, rtol=0, atol=0)
    torch.testing.assert_close(h.grad.float(), expected[2].float(), rtol=rtol, atol=atol)
    assert w.grad_added_to_main_grad and w.grad is None


def test_with_overlapped_reduction_the_weight_gets_a_dummy_grad_unless_an_embedding_sends_one():
    hidden, weight, labels, mask, scale = _problem()
    for shared, dummy in ((False, True), (True, False)):
        w = _under_ddp(weight, torch.float32)
        if shared:
            w.zero_out_wgrad = True
        loss = fused_output_loss(
            hidden, w, labels.T, mask.T, accumulate_into_main_grad=True, grad_scale=scale
        ).loss.T
        (torch.sum(loss.reshape(-1) * mask.view(-1)) * scale).backward()
        assert (w.grad is not None) == dummy and w.grad_added_to_main_grad


def test_a_mispredicted_scale_is_refused_in_the_backward() -> None:
    hidden, weight, labels, mask, scale = _problem()
    w = _under_ddp(weight, torch.float32)
    loss = fused_output_loss(
        hidden.requires_grad_(),
        w,
        labels.T,
        mask.T,
        accumulate_into_main_grad=True,
        grad_scale=scale * 2,
    ).loss.T
    with pytest.raises(RuntimeError, match="times the scale the forward expected"):
        (torch.sum(loss.reshape(-1) * mask.view(-1)) * scale).backward()


def test_mismatched_shapes_are_refused() -> None:
    hidden, weight, labels, mask, _ = _problem()
    with pytest.raises(ValueError, match="do not describe the same tokens"):
        fused_output_loss(hidden, weight, labels[:, 1:], mask[:, 1:])


def _in_main_grad(hidden, weight, labels, mask, scale, coeff, group):
    """:func:`_fused` under Megatron DDP: the weight gradient read from main_grad."""
    h, w = hidden.clone().requires_grad_(), _under_ddp(weight, torch.float32)
    w.main_grad.zero_()
    terms = fused_output_loss(
        h,
        w,
        labels.T.contiguous(),
        mask.T.contiguous(),
        z_loss_coeff=coeff,
        tp_group=group,
        chunk_tokens=5,
        accumulate_into_main_grad=True,
        grad_scale=scale,
    )
    loss = terms.loss.T.contiguous()
    (torch.sum(loss.view(-1).float() * mask.view(-1)) * scale).backward()
    return loss.detach(), terms.z_loss.T, h.grad, w.main_grad


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
                if not tied:  # the weight gradient put in main_grad during the forward
                    in_main = _in_main_grad(h, w, labels, mask, scale, coeff, group)
                    _assert_close(in_main, (*unfused[:3], unfused[3].float()), rtol)
        if dtype == torch.float32:
            fused = _fused(h, w, labels, mask, scale, 1e-4, group, chunk_tokens=5)
            _assert_close(fused, expected, FP32_RTOL)


def _model(tied: bool, mtp: bool) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=1 if mtp else None,
    )
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(0)
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=tied,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        if mtp
        else None,
    )


def _step(model: torch.nn.Module, batch: dict, feature: ZLossFeature) -> tuple:
    """Forward with labels, Megatron's masked loss sum (scaled), backward: the per-token
    loss, the grads by name and the z-loss feature's report of the micro-batch."""
    model.zero_grad(set_to_none=True)
    feature.pending.clear()
    loss = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    mask = batch["loss_mask"].view(-1)
    total = torch.sum(loss.view(-1).float() * mask)
    report = feature.on_loss(
        LossInputs(MicroBatch(1, True, 0), loss, mask, total, mask.sum().to(torch.int))
    )
    (total * 0.25).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, report


def _check_gpt_model() -> None:
    """A real GPTModel at TP=2: the patched _postprocess against Megatron's own path."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)  # the tracker attention forks (a no-op RNG on CPU)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    batch = {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": (torch.rand(BATCH, SEQ, generator=gen) > 0.25).float(),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
    }
    feature = ZLossFeature()
    feature.coeff, feature.chunk_tokens = COEFF, 5
    patch("zloss-output-layer").apply(feature)  # both arms: MTP heads' loss, the plain main head
    fused = patch("fused-output-loss")
    for tied, mtp in ((True, False), (False, False), (True, True)):
        model = _model(tied, mtp)
        plain_loss, plain_grads, plain_report = _step(model, batch, feature)
        fused.apply(feature)
        try:
            loss, grads, report = _step(model, batch, feature)
            with torch.no_grad():  # no labels: the logits, from Megatron's own path
                logits = model(batch["tokens"], batch["position_ids"], None)
            assert logits.shape == (BATCH, SEQ, VOCAB // 2)
        finally:
            fused.remove()
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
        assert list(report) == ["lm loss", "z loss"]
        for key, value in report.items():
            torch.testing.assert_close(value, plain_report[key], rtol=1e-5, atol=0)
        assert plain_grads.keys() == grads.keys()
        for name, grad in grads.items():
            scale = plain_grads[name].abs().max().item()
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5 * scale)
        if tied:
            assert "output_layer.weight" not in grads, "tied: the embedding gets the head's grad"
    parallel_state.destroy_model_parallel()


def _tp_worker(rank: int, init_file: str) -> None:
    """One of two TP ranks; rank 0 also checks TP=1 on a group of its own."""
    from megatron_ext.cpu import shims  # GPTModel's forward on CPU

    shims.install()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        singletons = [dist.new_group([0]), dist.new_group([1])]
        if rank == 0:
            _check_against_unfused(singletons[0], 0, 1)
        _check_against_unfused(dist.group.WORLD, rank, 2)
        _check_gpt_model()
    finally:
        dist.destroy_process_group()


def test_equals_megatrons_output_layer_and_the_z_loss_at_tp1_and_tp2(tmp_path: Path) -> None:
    """Two gloo processes. The function: fp32 to round-off, bf16 to two bf16 units, tied and
    untied. A GPTModel (TP=2; tied, untied, tied with an MTP head): the same per-token loss,
    every parameter's gradient and the z-loss report as Megatron's output layer + z-loss."""
    mp.spawn(_tp_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)


def _args(**overrides: object) -> SimpleNamespace:
    return SimpleNamespace(
        **{
            "z_loss_coeff": 0.0,
            "cross_entropy_loss_fusion": False,
            "fused_output_loss": True,
            "fused_output_loss_chunk_tokens": 0,
            "defer_embedding_wgrad_compute": False,
            "log_output_z": False,
            **overrides,
        }
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"defer_embedding_wgrad_compute": True}, "no deferred GEMM left to overlap"),
        ({"fused_output_loss_chunk_tokens": -1}, "must be >= 1"),
    ],
)
def test_what_cannot_work_is_refused_at_start_up(overrides: dict, message: str) -> None:
    feature = ZLossFeature()
    assert feature.enabled(_args())
    with pytest.raises(FeatureError, match=message):
        feature.validate(_args(**overrides))


def test_the_fused_cross_entropy_is_replaced_and_said_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Bridge's recipes turn the CE fusion on: the fused output loss takes its place, saying
    so at start-up instead of refusing."""
    feature = ZLossFeature()
    args = _args(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    feature.validate(args)
    feature.install(args)
    out = capsys.readouterr().out
    assert "--cross-entropy-loss-fusion (te) does not run in this job" in out
    assert "one-pass vocab-parallel CE + z kernel" not in out


def test_the_flag_alone_reports_nothing_extra() -> None:
    """Without a z-loss the fused loss is the pure CE: Megatron's lm loss is the report."""
    feature = ZLossFeature()
    feature.validate(_args())
    assert feature.on_loss(LossInputs(MicroBatch(1, True, 0), None, None, None, None)) == {}
