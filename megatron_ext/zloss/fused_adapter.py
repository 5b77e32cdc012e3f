"""``--fused-output-loss`` in Megatron: the main head's logits are never materialised.

Patch point. megatron-core 0.19.2's ``GPTModel._postprocess`` computes
``logits = output_layer(hidden, weight=...)`` and then ``compute_language_model_loss(labels,
logits)``; the logits exist before any loss method is called, so patching the loss method
(as the z-loss does) is too late, and replacing ``ColumnParallelLinear.forward`` would touch
every column-parallel layer. ``_postprocess`` has a public hook instead: an
``output_processor`` keyword that, when given, is handed the hidden states, the output layer,
the output weight (the embedding when tied, also at PP>1), the labels and the loss mask, and
whose return value is the model's output, in place of the output layer and the loss. The
``fused-output-loss`` patch only fills that keyword (when labels are given, outside
inference, and nobody else passed one) with :func:`fused_output_processor`; everything else in
``_postprocess`` (MTP, the schedule, the pre/post-process split) is Megatron's.

What stays on the plain path: inference and evaluation without labels (logits are the
output), and MTP heads (Megatron's ``process_mtp_loss`` computes their logits itself and also
takes their argmax for its acceptance counts). They run before the main head and are
unchanged; the main head's ``[s·b, V/tp]`` logits, the dominant buffer, are fused away.

Gradients reach the weight as the output layer's own linear function delivers them: the
input gradient all-reduced over TP (or, with sequence parallelism, the hidden states are
gathered with Megatron's ``gather_from_sequence_parallel_region`` whose backward
reduce-scatters), the weight gradient as ``.grad`` for Megatron DDP's hook to add to
``main_grad`` (or into ``main_grad`` directly with gradient-accumulation fusion).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.inference.utils import InferenceMode
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_ext.zloss import adapter
from megatron_ext.zloss.fused import fused_output_loss


def fused_output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    config: Any,
    **_: Any,
) -> torch.Tensor:
    """GPTModel's ``output_processor``: the main head's ``[b, s]`` per-token loss, fused.

    Returns what ``compute_language_model_loss`` would (``CE + c·log²Z`` per token) and,
    with a z-loss, leaves its CE and log²Z for the z-loss feature's report, like the patched
    loss method does.
    """
    feature = adapter._FEATURE
    assert feature is not None, "fused-output-loss applied without the z-loss feature"
    weight = output_layer.weight if output_weight is None else output_weight
    tp_group = output_layer.tp_group
    if output_layer.sequence_parallel:  # as ColumnParallelLinear: gather, reduce-scatter
        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True, group=tp_group
        )
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    terms = fused_output_loss(
        hidden_states,
        weight,
        labels.transpose(0, 1).contiguous(),  # [b, s] -> [s, b], the hidden states' order
        loss_mask.transpose(0, 1).contiguous(),
        z_loss_coeff=feature.coeff,
        tp_group=tp_group,
        chunk_tokens=feature.chunk_tokens,
        logit_scale=config.mup_output_mult if config.use_mup else 1.0,
        reduce_grad_input=not output_layer.sequence_parallel,
        accumulate_into_main_grad=output_layer.gradient_accumulation_fusion,
    )
    loss = terms.loss.transpose(0, 1).contiguous()
    if feature.coeff != 0.0:
        feature.pending.append(
            (loss, terms.cross_entropy.transpose(0, 1), terms.z_loss.transpose(0, 1))
        )
    return loss


def with_fused_output_loss(postprocess: Callable[..., Any]) -> Callable[..., Any]:
    """Wrapper of the ``fused-output-loss`` patch on ``GPTModel._postprocess``."""
    signature = inspect.signature(postprocess)

    def _postprocess(*args: Any, **kwargs: Any) -> Any:
        """Megatron's, with :func:`fused_output_processor` as its output processor when a
        loss is computed (labels given, not inference, no other processor)."""
        call = signature.bind(*args, **kwargs)
        given = call.arguments
        if (
            given.get("labels") is not None
            and given.get("output_processor") is None
            and given.get("inference_context") is None
            and not InferenceMode.is_active()
        ):
            given["output_processor"] = fused_output_processor
        return postprocess(*call.args, **call.kwargs)

    return _postprocess
