"""Output-layer z-loss kernels (PaLM, OLMo 2/3): per token ``CE + c·log²Z``; no Megatron
import at load time. :func:`cross_entropy_and_z_loss` is Megatron's vocab-parallel CE with the
z gradient folded into the saved softmax; :func:`fused_output_loss` also does the output
matmul chunk by chunk, gradients in the forward (docs/z-loss.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class ZLossTerms(NamedTuple):
    """Per-token float32 terms shaped like the target: ``loss = cross_entropy + coeff · z_loss``
    (differentiable); ``cross_entropy``, ``z_loss`` (log²Z) and the signed ``log_z`` are
    detached, for logging."""

    loss: torch.Tensor
    cross_entropy: torch.Tensor
    z_loss: torch.Tensor
    log_z: torch.Tensor


def _terms(
    predicted: torch.Tensor, sum_exp: torch.Tensor, logits_max: torch.Tensor, coeff: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(CE, log Z, log²Z, loss)`` from the reduced target logit, sum of exponentials and max."""
    log_sum_exp = torch.log(sum_exp)
    cross_entropy = log_sum_exp - predicted
    log_z = log_sum_exp + logits_max
    z_loss = log_z * log_z
    loss = cross_entropy + coeff * z_loss if coeff != 0.0 else cross_entropy.clone()
    return cross_entropy, log_z, z_loss, loss


class _CrossEntropyWithZLoss(torch.autograd.Function):
    """Forward: per-token CE and log²Z in one pass. Backward: the folded, scaled softmax."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        coeff: float,
        tp_group: dist.ProcessGroup | None,
        overwrite_logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rank = 0 if tp_group is None else dist.get_rank(tp_group)
        world = 1 if tp_group is None else dist.get_world_size(tp_group)

        # The fp32 buffer that becomes exp(logits - max), then the scaled softmax.
        if logits.dtype != torch.float32:
            work = logits.to(torch.float32, memory_format=torch.contiguous_format)
            in_place = True
        else:
            work, in_place = logits, overwrite_logits and logits.is_contiguous()
        logits_max = torch.max(work, dim=-1)[0]
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        if in_place:
            shifted = work.sub_(logits_max.unsqueeze(-1))
        else:
            shifted = torch.empty(work.shape, dtype=torch.float32, device=work.device)
            torch.sub(work, logits_max.unsqueeze(-1), out=shifted)

        partition_vocab = shifted.size(-1)
        vocab_start = rank * partition_vocab
        target_mask = (target < vocab_start) | (target >= vocab_start + partition_vocab)
        masked_target_1d = torch.where(target_mask, 0, target - vocab_start).reshape(-1)
        shifted_2d = shifted.view(-1, partition_vocab)
        predicted = shifted_2d.gather(1, masked_target_1d.unsqueeze(-1)).view_as(target)
        predicted = predicted.masked_fill(target_mask, 0.0)

        torch.exp(shifted, out=shifted)
        sum_exp = shifted.sum(dim=-1)
        if world > 1:
            dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=tp_group)
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)

        cross_entropy, log_z, z_loss, loss = _terms(predicted, sum_exp, logits_max, coeff)
        # d(c·log²Z)/dlogits = 2c·log Z·softmax: scale the softmax by (1 + 2c·log Z) here, so
        # backward is Megatron's (softmax - onehot) * grad, unchanged.
        if coeff != 0.0:
            sum_exp = sum_exp / (1.0 + 2.0 * coeff * log_z)
        shifted.div_(sum_exp.unsqueeze(-1))

        ctx.save_for_backward(shifted, target_mask, masked_target_1d)
        ctx.mark_non_differentiable(cross_entropy, z_loss, log_z)
        return loss, cross_entropy, z_loss, log_z

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: torch.Tensor, *_: Any
    ) -> tuple[torch.Tensor, None, None, None, None]:
        scaled_softmax, target_mask, masked_target_1d = ctx.saved_tensors
        # In place on the saved buffer, as Megatron does: backward runs once per graph.
        grad_2d = scaled_softmax.view(-1, scaled_softmax.size(-1))
        rows = torch.arange(grad_2d.size(0), device=grad_2d.device)
        grad_2d[rows, masked_target_1d] -= 1.0 - target_mask.reshape(-1).float()
        scaled_softmax.mul_(grad_loss.unsqueeze(-1))
        return scaled_softmax, None, None, None, None


def cross_entropy_and_z_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    z_loss_coeff: float,
    tp_group: dist.ProcessGroup | None = None,
    *,
    overwrite_logits: bool = False,
) -> ZLossTerms:
    """All three per-token terms (:func:`vocab_parallel_cross_entropy_with_z_loss`).
    ``overwrite_logits=True`` uses fp32 logits as the working buffer, as Megatron's CE does.
    ``tp_group`` None: Megatron's TP group if it set one up, else the full vocabulary."""
    if tp_group is None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            tp_group = parallel_state.get_tensor_model_parallel_group()
    return ZLossTerms(
        *_CrossEntropyWithZLoss.apply(
            logits, target, float(z_loss_coeff), tp_group, overwrite_logits
        )
    )


def vocab_parallel_cross_entropy_with_z_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    z_loss_coeff: float,
    tp_group: dist.ProcessGroup | None = None,
    *,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(CE + c·log²Z, log²Z)`` of ``[s, b, V/tp]`` vocab-parallel logits (rank
    ``r`` holds ids ``[r·V/tp, (r+1)·V/tp)``) and ``[s, b]`` global targets; every rank of
    ``tp_group`` calls together. ``logits`` is kept; the graph backpropagates once.
    Gradient: ``softmax·(1 + 2c·log Z) - onehot``. Label smoothing is refused."""
    if label_smoothing != 0.0:
        raise ValueError(
            "vocab_parallel_cross_entropy_with_z_loss does not support label smoothing: "
            "Megatron's smoothing term is a mean over each rank's vocabulary shard, and a "
            "correct full-vocabulary mean would need another all-reduce. Use "
            "megatron.core.tensor_parallel.vocab_parallel_cross_entropy for label smoothing."
        )
    terms = cross_entropy_and_z_loss(logits, target, z_loss_coeff, tp_group)
    return terms.loss, terms.z_loss


def default_chunk_tokens(vocab_per_rank: int) -> int:
    """Tokens per chunk (a power of two in [64, 4096]) for ~2^25 fp32 logits (128 MiB) a
    chunk: large enough for efficient matmuls, small next to the unfused ``[s·b, V/tp]``."""
    tokens = 1 << max(0, (2**25 // max(1, vocab_per_rank)).bit_length() - 1)
    return min(4096, max(64, tokens))


def _chunk_terms(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    coeff: float,
    logit_scale: float,
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, ...]:
    """One chunk: ``(work, local target, outside, sum_exp, log Z, CE, log²Z, loss)``; ``work``
    holds ``exp(logits - max)`` in fp32 (the caller turns it into the gradient)."""
    logits = torch.matmul(hidden, weight.t())
    if logit_scale != 1.0:  # MuP output multiplier, applied as Megatron applies it
        logits = logits * logit_scale
    work = logits.float() if logits.dtype != torch.float32 else logits
    del logits
    logits_max = torch.max(work, dim=-1)[0]
    if tp_group is not None:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
    work.sub_(logits_max.unsqueeze(-1))
    outside = (labels < vocab_start) | (labels >= vocab_start + work.size(-1))
    local = torch.where(outside, 0, labels - vocab_start)
    predicted = work.gather(1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    work.exp_()
    stats = torch.stack([predicted, work.sum(dim=-1)])
    if tp_group is not None:  # target logit and sum of exponentials in one all-reduce
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
    cross_entropy, log_z, z_loss, loss = _terms(stats[0], stats[1], logits_max, coeff)
    return work, local, outside, stats[1], log_z, cross_entropy, z_loss, loss


def _add_weight_gradient(
    grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor
) -> None:
    """``grad_weight += grad_logitsᵀ · hidden``: one addmm where the dtypes agree, else an
    eighth of the vocabulary at a time (bf16 products into fp32): no weight-sized product."""
    if grad_weight.dtype == grad_logits.dtype == hidden.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden)
        return
    rows = -(-grad_weight.size(0) // 8)
    for first in range(0, grad_weight.size(0), rows):
        last = min(grad_weight.size(0), first + rows)
        grad_weight[first:last].add_(torch.matmul(grad_logits[:, first:last].t(), hidden))


class _FusedOutputLoss(torch.autograd.Function):
    """Forward: per-chunk loss and (when grads are needed) both gradients: unscaled, or, with
    ``grad_scale``, already scaled and the weight's in ``main_grad``. Backward: check the
    incoming per-token gradient against the scale (read from it, or the given one), and apply
    it where the forward could not."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        token_weights: torch.Tensor,
        options: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        group = options["tp_group"]
        world = 1 if group is None else dist.get_world_size(group)
        reduce_group = group if world > 1 else None
        vocab_start = (0 if group is None else dist.get_rank(group)) * weight.size(0)
        coeff, scale, chunk = options["coeff"], options["logit_scale"], options["chunk_tokens"]
        tokens = hidden.size(0)
        loss, cross_entropy, z_loss, log_zs = (
            torch.empty(tokens, dtype=torch.float32, device=hidden.device) for _ in range(4)
        )
        grads = options["needs_grad"]
        # Megatron's scale known in forward: the weight gradient goes to main_grad chunk by
        # chunk, and no weight-sized buffer waits for the backward.
        into_main_grad = grads and options["grad_scale"] is not None
        if grads:
            grad_hidden = torch.empty_like(hidden)
            grad_weight = (
                weight.main_grad
                if into_main_grad
                else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            )
            per_token = token_weights * scale  # the logit multiplier is in every logit's grad
            if into_main_grad:
                per_token = per_token * options["grad_scale"]
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            h = hidden[start:end]
            work, local, outside, sum_exp, log_z, ce, z, chunk_loss = _chunk_terms(
                h, weight, labels[start:end], vocab_start, coeff, scale, reduce_group
            )
            loss[start:end], cross_entropy[start:end], z_loss[start:end] = chunk_loss, ce, z
            log_zs[start:end] = log_z
            if not grads:
                del work  # before the next chunk's logits exist: one chunk buffer at a time
                continue
            # dloss/dlogits = softmax·(1 + 2c·log Z) - onehot, weighted per token (the mask).
            factor = 1.0 if coeff == 0.0 else 1.0 + 2.0 * coeff * log_z
            weights = per_token[start:end]
            work.mul_((weights * factor / sum_exp).unsqueeze(-1))  # one pass: softmax, weighted
            rows = torch.arange(end - start, device=work.device)
            work[rows, local] -= torch.where(outside, 0.0, weights)
            grad_logits = work.to(hidden.dtype) if hidden.dtype != torch.float32 else work
            del work
            torch.matmul(grad_logits, weight, out=grad_hidden[start:end])
            _add_weight_gradient(grad_weight, grad_logits, h)
            del grad_logits
        if grads:  # the backward checks (given) or applies the scale; keep the deferred wgrad
            expected = options["grad_scale"] if into_main_grad else None
            ctx.save_for_backward(
                grad_hidden, token_weights, expected, None if into_main_grad else grad_weight
            )
            ctx.weight = weight
            ctx.options = options
        ctx.mark_non_differentiable(cross_entropy, z_loss, log_zs)
        return loss, cross_entropy, z_loss, log_zs

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: torch.Tensor, *_: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        grad_hidden, token_weights, given, grad_weight = ctx.saved_tensors
        options, weight = ctx.options, ctx.weight
        grad_loss = grad_loss.reshape(-1)
        if given is None:  # g = s·w: s read at the heaviest-weighted token (0: all weights 0)
            heaviest = torch.argmax(token_weights.abs()).view(1)  # index_select: no host sync
            weight_there = token_weights.index_select(0, heaviest)
            scale = torch.where(
                weight_there != 0, grad_loss.index_select(0, heaviest) / weight_there, 0.0
            )
        else:  # the scale the forward already applied
            scale = given.reshape(1)
        expected = token_weights * scale
        if grad_loss.device.type != "meta":  # meta: shapes only (the benchmark's bytes)
            torch._assert_async(
                torch.all((grad_loss - expected).abs() <= 1e-6 * expected.abs()),
                _MISMATCH if given is None else _MISPREDICTED,
            )
        group = options["tp_group"]
        if given is None:
            grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if options["reduce_grad_input"] and group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(grad_hidden, group=group)
        if given is None:
            grad_weight.mul_(scale)
            if not options["accumulate_into_main_grad"]:
                return grad_hidden, grad_weight.to(weight.dtype), None, None, None
            # Megatron's gradient-accumulation fusion: wgrad goes to main_grad directly.
            weight.main_grad.add_(grad_weight)
        # The weight gradient is in main_grad (added in the forward, or just now).
        wgrad = _added_to_main_grad(weight, options["dummy_wgrad"])
        return grad_hidden, wgrad, None, None, None


_MISMATCH = (
    "--fused-output-loss: the incoming gradient of the per-token loss is not the loss mask "
    "times one scalar, which the fused output layer requires (Megatron's loss sums loss * "
    "mask); use the plain output layer for this loss."
)
_MISPREDICTED = (
    "--fused-output-loss: the incoming gradient of the per-token loss is not the loss mask "
    "times the scale the forward expected (Megatron's loss scale / (micro-batches x tokens)), "
    "and the weight gradient was already added to main_grad with that scale; megatron-core's "
    "schedule scales the loss differently from what the overlay verified (see `megatron-ext "
    "patches`, assumption schedule-loss-scaling)."
)


def _added_to_main_grad(weight: torch.Tensor, dummy: bool) -> torch.Tensor | None:
    """The weight's ``.grad`` once its gradient is in ``main_grad``, as Megatron's fused linear
    does: the ``grad_added_to_main_grad`` mark, and a dummy ``.grad`` where DDP's hook must mark
    the weight ready (not for one shared with this stage's embedding, whose gradient runs it)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if not dummy or getattr(weight, "zero_out_wgrad", False):
        return None
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def fused_output_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor,
    *,
    z_loss_coeff: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_tokens: int | None = None,
    logit_scale: float = 1.0,
    reduce_grad_input: bool = True,
    accumulate_into_main_grad: bool = False,
    grad_scale: torch.Tensor | None = None,
    dummy_wgrad: bool = True,
) -> ZLossTerms:
    """Per-token ``CE + c·log²Z`` of ``logits = logit_scale · hidden · weightᵀ``, chunked.

    ``hidden`` ``[s, b, h]`` or ``[tokens, h]`` (full sequence on every TP rank), ``weight``
    ``[V/tp, h]``, ``labels`` (global ids) and ``token_weights`` (the loss mask) shaped alike;
    the incoming gradient must be ``token_weights`` times one scalar. ``reduce_grad_input``:
    all-reduce the input gradient over TP. ``accumulate_into_main_grad``: the weight gradient
    goes to ``weight.main_grad`` (in the forward when ``grad_scale``, the scalar the backward
    will send, is given); ``dummy_wgrad``: then still return a dummy ``.grad`` for DDP's hook.
    """
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    if labels.numel() != flat_hidden.size(0) or token_weights.shape != labels.shape:
        raise ValueError(
            f"fused_output_loss: hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)} "
            f"and token_weights {tuple(token_weights.shape)} do not describe the same tokens"
        )
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.size(0))
    if chunk_tokens < 1:
        raise ValueError(f"fused_output_loss: chunk_tokens must be >= 1, got {chunk_tokens}")
    options = {
        "tp_group": tp_group,
        "coeff": float(z_loss_coeff),
        "logit_scale": float(logit_scale),
        "chunk_tokens": int(chunk_tokens),
        "needs_grad": torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad),
        "reduce_grad_input": reduce_grad_input,
        "accumulate_into_main_grad": accumulate_into_main_grad,
        "dummy_wgrad": dummy_wgrad,
        "grad_scale": (
            grad_scale.reshape(()).float()
            if grad_scale is not None and accumulate_into_main_grad
            else None
        ),
    }
    terms = _FusedOutputLoss.apply(
        flat_hidden,
        weight,
        labels.reshape(-1),
        token_weights.reshape(-1).float(),
        options,
    )
    return ZLossTerms(*(term.view(labels.shape) for term in terms))
