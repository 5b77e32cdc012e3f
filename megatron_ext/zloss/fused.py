"""The output layer's matmul, the vocab-parallel cross entropy and the z-loss in one pass.

The last pipeline stage normally materialises ``[s·b, V/tp]`` logits, and the cross entropy
saves an fp32 softmax of the same size for backward: 6 GiB at s=8192, V=128k in bf16. Here
the tokens are taken ``chunk_tokens`` at a time: per chunk, local logits ``h Wᵀ``, the
TP-reduced max and sum of exponentials, the target logit (from the rank that owns it), the
per-token CE and log²Z, and the gradient contributions. Nothing logits-sized outlives a chunk.

Design: gradients are computed in the forward (Liger-Kernel style), not by recomputing the
logits in backward (Cut Cross-Entropy style). Both keep O(chunk · V/tp) for the loss; the
recompute costs a fourth matmul of the head's size (the head's forward again), which is
~1.3x the head's time, while computing them in forward costs the three matmuls the unfused
path does. The price is an assumption about the incoming gradient: the weight gradient
``Σ_t g_t · dloss_t/dW`` needs ``g_t`` inside the sum, so the forward takes per-token weights
``w`` (the loss mask) and the backward requires ``g = s · w`` for one scalar ``s``, which is
what Megatron's loss (``Σ loss · mask``, scaled by the schedule) always sends. The backward
checks it (without a host sync on GPU) and fails loudly otherwise. In evaluation (no grad)
only the loss is computed: one matmul.

Gradients are returned as Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``
delivers them: the input gradient all-reduced over the TP group (or left to the caller's
sequence-parallel reduce-scatter); the weight gradient as ``.grad`` (Megatron DDP's hook adds
it to ``main_grad``) or, with gradient-accumulation fusion, added to ``weight.main_grad``
directly with ``grad_added_to_main_grad`` set. When the caller also knows the scalar ``s`` in
forward (``grad_scale``: under Megatron DDP it is the schedule's loss scale / micro-batches /
tokens), the weight gradient goes into ``main_grad`` chunk by chunk during the forward, so no
weight-sized buffer (an fp32 ``V/tp × h``: 512 MiB at 32k × 4096) waits for the backward; the
backward then checks that ``s`` was right, and a wrong one fails loudly, since ``main_grad``
already holds the update. This module imports no Megatron.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["OutputLossTerms", "default_chunk_tokens", "fused_output_loss"]

# Auto chunk: this many fp32 logits per chunk (128 MiB), clamped to [64, 4096] tokens.
CHUNK_ELEMENTS = 2**25


class OutputLossTerms(NamedTuple):
    """Per-token float32 terms, shaped like the labels.

    ``loss`` (differentiable w.r.t. hidden states and weight) is ``cross_entropy + coeff ·
    z_loss``; ``cross_entropy``, ``z_loss`` (= log²Z, unscaled) and ``log_z`` are detached,
    for logging.
    """

    loss: torch.Tensor
    cross_entropy: torch.Tensor
    z_loss: torch.Tensor
    log_z: torch.Tensor


def default_chunk_tokens(vocab_per_rank: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits are ~128 MiB: large enough for
    efficient matmuls, small next to the unfused ``[s·b, V/tp]`` buffers."""
    tokens = 1 << max(0, (CHUNK_ELEMENTS // max(1, vocab_per_rank)).bit_length() - 1)
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
    predicted, sum_exp = stats[0], stats[1]
    log_sum_exp = torch.log(sum_exp)
    cross_entropy = log_sum_exp - predicted
    log_z = log_sum_exp + logits_max
    z_loss = log_z * log_z
    loss = cross_entropy + coeff * z_loss if coeff != 0.0 else cross_entropy.clone()
    return work, local, outside, sum_exp, log_z, cross_entropy, z_loss, loss


# Rows of the vocabulary per weight-gradient product when it is not accumulated in place
# (bf16 products added to an fp32 buffer): the product's transient stays ~1/8 of the weight.
PRODUCT_SLICES = 8


def _add_weight_gradient(
    grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor
) -> None:
    """``grad_weight += grad_logitsᵀ · hidden``: in place where the dtypes agree (one addmm),
    else a vocabulary slice at a time (a bf16 product into an fp32 accumulator), so that no
    weight-sized product is ever allocated."""
    if grad_weight.dtype == grad_logits.dtype == hidden.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden)
        return
    rows = -(-grad_weight.size(0) // PRODUCT_SLICES)
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
        if grads:
            # The backward checks the incoming gradient against the scale used here (given) or
            # applies it (read there); only the deferred weight gradient is kept for it.
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
    """What the weight's gradient slot gets once its gradient is in ``main_grad``. Under
    Megatron DDP: the ``grad_added_to_main_grad`` mark (DDP's hook then adds nothing twice)
    and, where DDP's hook must run to mark the weight ready for an overlapped all-reduce, a
    dummy .grad, as Megatron's fused linear returns (a weight-sized transient). No dummy for a
    weight shared with an embedding on this stage (``zero_out_wgrad``): the embedding's own
    gradient runs the hook, which adds it to main_grad."""
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
) -> OutputLossTerms:
    r"""Per-token ``CE + c·log²Z`` of ``logits = logit_scale · hidden · weightᵀ``, chunked.

    Args:
        hidden: ``[s, b, h]`` or ``[tokens, h]`` output-layer input (the full sequence on
            every TP rank: gather a sequence-parallel input first).
        weight: ``[V/tp, h]``: rank ``r`` of ``tp_group`` holds vocabulary ids
            ``[r·V/tp, (r+1)·V/tp)`` (``ColumnParallelLinear``; tied or not).
        labels: ``[s, b]`` or ``[tokens]`` global target ids, the same on every TP rank.
        token_weights: same shape as ``labels``: the loss mask. The backward requires the
            gradient of the returned loss to be ``token_weights`` times one scalar.
        z_loss_coeff: ``c``; 0 gives plain cross entropy.
        tp_group: the group the vocabulary is split over (``None``: unsharded).
        chunk_tokens: tokens per chunk (``None``: :func:`default_chunk_tokens`).
        logit_scale: multiplier of the logits (MuP's output multiplier).
        reduce_grad_input: all-reduce the input gradient over ``tp_group`` (what
            ``ColumnParallelLinear`` does without sequence parallelism).
        accumulate_into_main_grad: add the weight gradient to ``weight.main_grad`` instead of
            returning it (Megatron's gradient-accumulation fusion).
        grad_scale: with ``accumulate_into_main_grad``, the scalar ``s`` the backward will
            send (``g = s · token_weights``), known in forward: the weight gradient is then
            added to ``main_grad`` chunk by chunk in the forward, and no weight-sized buffer is
            held until the backward, which checks that ``g`` is what was expected.
        dummy_wgrad: once the weight gradient is in ``main_grad``, still return a dummy
            ``.grad`` (Megatron DDP's hook marks the weight ready for an overlapped all-reduce
            only when it gets one: ``--overlap-grad-reduce``).

    Returns:
        :class:`OutputLossTerms`, each float32 and shaped like ``labels``.
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
    return OutputLossTerms(*(term.view(labels.shape) for term in terms))
