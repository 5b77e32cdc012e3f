"""Output-layer z-loss fused into a vocab-parallel cross entropy (PaLM, OLMo 2/3).

The z-loss adds ``c * log(Z)**2`` per token, ``Z = sum_j exp(logit_j)`` being the softmax
normaliser of the output logits, so that ``log Z`` stays near 0 and the logits cannot drift
upwards (bf16 softmax precision loss, loss spikes). Computing it next to Megatron's cross
entropy costs a second pass over the logits, a second logits-sized saved buffer and, under
tensor parallelism, extra collectives; and because Megatron's cross entropy overwrites its
input logits, a z term computed after it silently reads garbage.

Here both terms come out of one pass: the cross entropy already all-reduces the per-token max
and sum of exponentials over the tensor-parallel group, and ``log Z = log(sum_exp) + max``.
The z gradient ``2c * log Z * softmax`` is folded into the softmax the cross entropy saves for
backward, so the saved tensors are exactly the cross entropy's. The arithmetic reproduces
Megatron's ``_VocabParallelCrossEntropy`` operation by operation, so with ``c = 0`` values and
gradients equal Megatron's bit for bit. This module imports no Megatron at load time; it looks
up Megatron's tensor-parallel group, when Megatron is there, if the caller passes none.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["ZLossTerms", "cross_entropy_and_z_loss", "vocab_parallel_cross_entropy_with_z_loss"]


class ZLossTerms(NamedTuple):
    """Per-token ``[s, b]`` float32 terms of one call.

    ``loss`` (differentiable) is ``cross_entropy + coeff * z_loss``; ``cross_entropy``,
    ``z_loss`` (= log²Z, unscaled) and ``log_z`` (signed: an output-logit divergence drifts
    it away from 0, which log²Z cannot tell from noise around 0) are detached, for logging.
    """

    loss: torch.Tensor
    cross_entropy: torch.Tensor
    z_loss: torch.Tensor
    log_z: torch.Tensor


def _default_tp_group() -> dist.ProcessGroup | None:
    """Megatron's tensor-parallel group when Megatron set one up, else none (full vocabulary).

    Matches the default of Megatron's ``vocab_parallel_cross_entropy`` inside Megatron
    programs, and lets the function run standalone on unsharded logits.
    """
    try:
        from megatron.core import parallel_state
    except ImportError:  # the core is usable without Megatron, on unsharded logits
        return None
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


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

        # The fp32 buffer that becomes exp(logits - max), then the scaled softmax: a copy for
        # bf16/fp16 logits (as in Megatron's CE); fp32 logits are used in place only when the
        # caller allows it, since the public function must keep its input.
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

        log_sum_exp = torch.log(sum_exp)
        cross_entropy = log_sum_exp - predicted
        log_z = log_sum_exp + logits_max
        z_loss = log_z * log_z
        if coeff == 0.0:
            loss = cross_entropy.clone()
            denominator = sum_exp
        else:
            loss = cross_entropy + coeff * z_loss
            # d(c·log²Z)/dlogits = 2c·log Z·softmax: scale the softmax by (1 + 2c·log Z)
            # here, so backward is Megatron's (softmax - onehot) * grad, unchanged.
            denominator = sum_exp / (1.0 + 2.0 * coeff * log_z)
        shifted.div_(denominator.unsqueeze(-1))

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
    """All three per-token terms; see :func:`vocab_parallel_cross_entropy_with_z_loss`.

    ``overwrite_logits=True`` lets fp32 logits be used as the working buffer, as Megatron's
    cross entropy does (the training path owns its logits, so this saves one logits-sized
    buffer); the logits are garbage afterwards.
    """
    if tp_group is None:
        tp_group = _default_tp_group()
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
    r"""Per-token cross entropy plus output z-loss on vocab-parallel logits, in one pass.

    Maths, per token with logits :math:`x` over the full vocabulary, target :math:`t`,
    :math:`\log Z = \log \sum_j e^{x_j}` and :math:`p = \mathrm{softmax}(x)`:

    .. math::
        \mathrm{loss} = (\log Z - x_t) + c\,(\log Z)^2, \qquad
        \frac{\partial\,\mathrm{loss}}{\partial x} = p\,(1 + 2c \log Z) - \mathrm{onehot}(t).

    Computed stably as :math:`\log Z = \log \sum_j e^{x_j - m} + m` with :math:`m = \max_j x_j`,
    in float32 whatever the logits' dtype (as Megatron's cross entropy).

    Tensor-parallel contract: ``logits`` is ``[s, b, V/tp]``, rank ``r`` of ``tp_group``
    holding vocabulary ids ``[r·V/tp, (r+1)·V/tp)`` (Megatron's ``ColumnParallelLinear``
    output layer); ``target`` is ``[s, b]`` global vocabulary ids, the same on every rank.
    Every rank of ``tp_group`` must call together; the results are identical on all of them.
    The collectives are Megatron cross entropy's own three all-reduces (MAX of the max, SUM
    of the target logit, SUM of the exponentials), none added. ``tp_group=None`` means
    Megatron's tensor-parallel group when Megatron's parallel state is initialised, otherwise
    unsharded logits (no communication).

    With ``z_loss_coeff=0`` the loss and its gradient equal Megatron's
    ``vocab_parallel_cross_entropy`` bit for bit. Unlike it, ``logits`` is never modified.
    Backward saves one float32 logits-sized buffer plus O(tokens), like Megatron's, and
    consumes it: the graph can be backpropagated once.

    Args:
        logits: ``[s, b, V/tp]`` logits (fp32, bf16 or fp16).
        target: ``[s, b]`` integer target ids.
        z_loss_coeff: ``c`` (PaLM 1e-4, OLMo 2/3 1e-5); 0 gives plain cross entropy.
        tp_group: the tensor-parallel group the vocabulary is split over.
        label_smoothing: not supported; any value but 0 raises :class:`ValueError`.

    Returns:
        ``(loss, z_loss)``, both ``[s, b]`` float32: ``loss`` = CE + c·log²Z (differentiable),
        ``z_loss`` = log²Z (detached, for logging). Mask and average them as the CE.
    """
    if label_smoothing != 0.0:
        raise ValueError(
            "vocab_parallel_cross_entropy_with_z_loss does not support label smoothing: "
            "Megatron's smoothing term is a mean over each rank's vocabulary shard, and a "
            "correct full-vocabulary mean would need another all-reduce. Use "
            "megatron.core.tensor_parallel.vocab_parallel_cross_entropy for label smoothing."
        )
    terms = cross_entropy_and_z_loss(logits, target, z_loss_coeff, tp_group)
    return terms.loss, terms.z_loss
