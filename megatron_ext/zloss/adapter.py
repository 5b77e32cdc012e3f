"""The z-loss feature: ``--z-loss-coeff``, ``--log-output-z``, ``--fused-output-loss``
(docs/z-loss.md). Patch ``zloss-output-layer`` computes ``compute_language_model_loss`` by the
one-pass kernel; ``fused-output-loss`` makes :func:`fused_output_processor` GPTModel's output
processor. Each loss call keeps its per-token terms for ``on_loss``'s report."""

from __future__ import annotations

import argparse
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.fusions import fused_cross_entropy as megatron_fused
from megatron.core.inference import utils as inference_utils
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.utils import VocabUtility

from megatron_ext.common.features import (
    LM_LOSS_PER_TOKEN,
    Feature,
    FeatureError,
    LossInputs,
    print_rank_0,
)
from megatron_ext.zloss.core import ZLossTerms, cross_entropy_and_z_loss, fused_output_loss


class ZLossFeature(Feature):
    """The loss patches and the ``lm loss`` / ``z loss`` / ``log z`` report entries."""

    name = "zloss"

    def __init__(self) -> None:
        self.coeff = 0.0
        self.chunk_tokens: int | None = None  # --fused-output-loss-chunk-tokens (None: auto)
        self.dummy_wgrad = True  # as Megatron's fused linear, unless installed without overlap
        # (loss returned, per-token CE, log²Z, log Z) of the calls since the last loss
        # function; MTP heads' calls come first, the main head's last.
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.log_z = False  # --log-output-z

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--z-loss-coeff",
            type=float,
            default=0.0,
            help="Output-layer z-loss coefficient c: adds c·log²Z per token (Z: the softmax "
            "normaliser of the output logits) in one pass with the cross entropy (PaLM 1e-4, "
            "OLMo 2/3 1e-5). Applies to MTP heads too. 'lm loss' stays pure cross entropy; "
            "'z loss' logs the mean log²Z. 0 (default) is off.",
        )
        group.add_argument(
            "--fused-output-loss",
            action="store_true",
            help="Compute the output layer's matmul, the vocab-parallel cross entropy and the "
            "z-loss together over chunks of tokens, so that the [s*b, V/TP] logits and their "
            "softmax are never materialised (the last stage's largest buffers). Main head "
            "only; MTP heads, inference and evaluation without labels use the plain path.",
        )
        group.add_argument(
            "--fused-output-loss-chunk-tokens",
            type=int,
            default=0,
            help="Tokens per chunk of --fused-output-loss: memory O(chunk * V/TP). 0 (default) "
            "picks 2^25 / (V/TP) rounded down to a power of two, in [64, 4096] (~128 MiB of "
            "fp32 logits per chunk).",
        )
        group.add_argument(
            "--log-output-z",
            action="store_true",
            help="Log the mean log Z of the output softmax per training step (TensorBoard "
            "'log z', signals field log_z): an output-logit divergence drifts it away from 0 "
            "long before the loss blows up. Computed in the cross entropy's own pass (at "
            "--z-loss-coeff 0 the loss is Megatron's bit for bit).",
        )

    def enabled(self, args: Any) -> bool:
        return bool(
            args.z_loss_coeff != 0
            or args.fused_output_loss
            or args.log_output_z
            or args.fused_output_loss_chunk_tokens  # validated: it needs --fused-output-loss
        )

    def validate(self, args: Any) -> None:
        coeff = args.z_loss_coeff
        if not math.isfinite(coeff) or coeff < 0:
            raise FeatureError(f"--z-loss-coeff must be a finite number >= 0, got {coeff}.")
        if args.fused_output_loss_chunk_tokens and not args.fused_output_loss:
            raise FeatureError(
                "--fused-output-loss-chunk-tokens needs --fused-output-loss (it sizes its "
                "chunks); add --fused-output-loss or drop it."
            )
        if args.fused_output_loss and args.fused_output_loss_chunk_tokens < 0:
            raise FeatureError(
                "--fused-output-loss-chunk-tokens must be >= 1 (or 0 for the automatic size), "
                f"got {args.fused_output_loss_chunk_tokens}."
            )
        if args.fused_output_loss and getattr(args, "defer_embedding_wgrad_compute", False):
            raise FeatureError(
                "--fused-output-loss cannot be combined with --defer-embedding-wgrad-compute: it "
                "defers the output layer's weight-gradient GEMM, which the fused output loss "
                "computes during the forward: there is no deferred GEMM left to overlap. Drop "
                "--defer-embedding-wgrad-compute."
            )

    def install(self, args: Any) -> None:
        self.coeff = float(args.z_loss_coeff)
        self.chunk_tokens = args.fused_output_loss_chunk_tokens or None
        self.fused = bool(args.fused_output_loss)
        self.log_z = bool(args.log_output_z)
        # DDP marks a parameter ready for its bucket's all-reduce in its .grad hook, so with
        # overlapped reduction the weight needs a (dummy) .grad even when main_grad has it.
        self.dummy_wgrad = bool(getattr(args, "overlap_grad_reduce", False))
        impl = getattr(args, "cross_entropy_fusion_impl", "native")
        if self.fused and args.cross_entropy_loss_fusion:
            print_rank_0(
                "megatron-ext: --fused-output-loss computes the output layer and its cross "
                "entropy in one chunked pass, in place of Megatron's cross entropy: "
                f"--cross-entropy-loss-fusion ({impl}) does not run in this job."
            )
        elif self.tracks() and args.cross_entropy_loss_fusion and impl == "te":
            print_rank_0(
                "megatron-ext z-loss: --cross-entropy-fusion-impl te (Transformer Engine's fused "
                "cross entropy) gives no log Z, so the language-model loss runs the overlay's "
                "one-pass vocab-parallel CE + z kernel instead (docs/z-loss.md)."
            )

    def needs_patch(self, name: str) -> bool:
        return {"zloss-output-layer": self.tracks(), "fused-output-loss": self.fused}[name]

    def tracks(self) -> bool:
        """Whether the loss calls keep their per-token terms for :meth:`on_loss`."""
        return self.coeff != 0 or self.log_z

    def on_loss(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        """``lm loss`` (pure CE), ``z loss`` and ``log z`` as ``[masked sum, token count]``,
        averaged by Megatron exactly as the CE; the per-token CE goes on the micro-batch."""
        if not self.tracks():  # --fused-output-loss alone: the loss is the pure CE already
            return {}
        pending, self.pending = self.pending, []
        terms = [(ce, z, lz) for loss, ce, z, lz in pending if loss is inputs.per_token]
        if not terms:
            raise RuntimeError(
                "z-loss: the loss function got a tensor that compute_language_model_loss did "
                f"not return ({len(pending)} calls since the last micro-batch); Megatron's loss "
                "path changed, re-verify megatron_ext.zloss.adapter."
            )
        cross_entropy, z_loss, log_z = terms[-1]
        reported: list[tuple[str, torch.Tensor]] = []
        if self.coeff != 0:
            # The other features' lm-loss readers (worst DP rank, sample log) take the pure CE.
            inputs.micro_batch.extras[LM_LOSS_PER_TOKEN] = cross_entropy
            reported += [("lm loss", cross_entropy), ("z loss", z_loss)]
        if self.log_z and inputs.micro_batch.training:  # a signal, not an evaluation metric
            reported.append(("log z", log_z))
        return {
            name: torch.cat(
                [torch.sum(term.reshape(-1) * inputs.mask).view(1), inputs.num_tokens.view(1)]
            )
            for name, term in reported
        }


class _FusedCrossEntropyWithZ(torch.autograd.Function):
    """Megatron's ``fused_vocab_parallel_cross_entropy`` from its own fused pieces, also
    returning CE, log²Z and log Z: the z gradient ``2c·log Z·softmax`` is folded into the
    softmax's division, so the backward is Megatron's (bf16 gradient) and nothing is added."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, coeff: float, tp_group: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, logits_max = megatron_fused.calculate_logits_max(logits)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), tp_group.rank(), tp_group.size()
        )
        target_mask, masked_target_1d, stats, exp_logits = (
            megatron_fused.calculate_predicted_logits(
                logits, target, logits_max, vocab_start, vocab_end
            )
        )
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
        predicted, sum_exp = torch.split(stats, stats.size(0) // 2)
        log_sum_exp = torch.log(sum_exp)
        log_z = log_sum_exp + logits_max
        z_loss = log_z * log_z
        if coeff == 0.0:  # Megatron's loss and softmax, bit for bit
            softmax, loss = megatron_fused.calculate_cross_entropy_loss(exp_logits, stats)
            cross_entropy = loss.clone()
        else:  # softmax·(1 + 2c·log Z): divide by sum_exp / (1 + 2c·log Z)
            denominator = sum_exp / (1.0 + 2.0 * coeff * log_z)
            softmax, _ = megatron_fused.calculate_cross_entropy_loss(
                exp_logits, torch.cat((predicted, denominator))
            )
            cross_entropy = log_sum_exp - predicted
            loss = cross_entropy + coeff * z_loss
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        ctx.mark_non_differentiable(cross_entropy, z_loss, log_z)
        return loss, cross_entropy, z_loss, log_z

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: torch.Tensor, *_: Any
    ) -> tuple[torch.Tensor, None, None, None]:
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad = megatron_fused.calculate_gradients(softmax, grad_loss, target_mask, masked_target_1d)
        return grad, None, None, None


def fused_cross_entropy_and_z_loss(
    logits: torch.Tensor, target: torch.Tensor, z_loss_coeff: float, tp_group: Any
) -> ZLossTerms:
    """:func:`cross_entropy_and_z_loss`'s terms by Megatron's fused cross entropy
    (``--cross-entropy-loss-fusion``, native): fp32 logits are overwritten, as there."""
    return ZLossTerms(*_FusedCrossEntropyWithZ.apply(logits, target, float(z_loss_coeff), tp_group))


def with_z_loss(
    _megatron_loss: Callable[..., torch.Tensor], feature: ZLossFeature
) -> Callable[..., torch.Tensor]:
    """Wrapper of the ``zloss-output-layer`` patch, bound to the installed feature."""

    def compute_language_model_loss(
        self: Any, labels: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """Per-token ``CE + c·log²Z`` as ``[b, s]``; the logits are the working buffer. Megatron's
        native fused CE where configured, else (unfused, or TE's) the one-pass kernel."""
        target = labels.transpose(0, 1).contiguous()
        config = self.config
        if config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "native":
            terms = fused_cross_entropy_and_z_loss(logits, target, feature.coeff, self.tp_group)
        else:
            terms = cross_entropy_and_z_loss(
                logits, target, feature.coeff, self.tp_group, overwrite_logits=True
            )
        loss = terms.loss.transpose(0, 1).contiguous()
        feature.pending.append(_kept(loss, terms))
        return loss

    return compute_language_model_loss


def _kept(loss: torch.Tensor, terms: Any) -> tuple[torch.Tensor, ...]:
    """What a loss call leaves for ``on_loss``: ``[b, s]`` loss, CE, log²Z and log Z."""
    return (loss, *(t.transpose(0, 1) for t in (terms.cross_entropy, terms.z_loss, terms.log_z)))


def fused_output_processor(
    feature: ZLossFeature,
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    config: Any,
    **_: Any,
) -> torch.Tensor:
    """GPTModel's ``output_processor``: the main head's ``[b, s]`` per-token loss, fused (the
    weight gradient goes to ``main_grad`` in the forward under Megatron DDP)."""
    # The output layer's forward is not called: run its pre-hooks (--overlap-param-gather's
    # all-gather of this layer and the next bucket's; skipping them, the next gather asserts).
    for pre_hook in tuple(output_layer._forward_pre_hooks.values()):
        pre_hook(output_layer, (hidden_states,))
    weight = output_layer.weight if output_weight is None else output_weight
    tp_group = output_layer.tp_group
    if output_layer.sequence_parallel:  # as ColumnParallelLinear: gather, reduce-scatter
        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True, group=tp_group
        )
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    under_ddp = hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad")
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
        accumulate_into_main_grad=output_layer.gradient_accumulation_fusion or under_ddp,
        grad_scale=schedule_grad_scale(config, loss_mask) if under_ddp else None,
        dummy_wgrad=feature.dummy_wgrad,
    )
    loss = terms.loss.transpose(0, 1).contiguous()
    if feature.tracks():
        feature.pending.append(_kept(loss, terms))
    return loss


def schedule_grad_scale(config: Any, loss_mask: torch.Tensor) -> torch.Tensor:
    """The gradient Megatron's schedule will send each token's loss per unit of mask: loss
    scale / micro-batches / tokens, with megatron-core's operations in its order, so the same
    float (registry assumption ``schedule-loss-scaling``); the fused backward checks it."""
    scale = torch.ones((), device=loss_mask.device)
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale).reshape(())
    if not config.calculate_per_token_loss:
        tokens = torch.clamp(loss_mask.sum().to(torch.int), min=1)
        scale = scale / get_num_microbatches() / tokens
    return scale


def with_fused_output_loss(
    postprocess: Callable[..., Any], feature: ZLossFeature
) -> Callable[..., Any]:
    """Wrapper of the ``fused-output-loss`` patch on ``GPTModel._postprocess``."""
    processor = functools.partial(fused_output_processor, feature)
    signature = inspect.signature(postprocess)

    def _postprocess(*args: Any, **kwargs: Any) -> Any:
        """Megatron's, with the fused processor when a loss is computed (labels, not
        inference, no other processor)."""
        call = signature.bind(*args, **kwargs)
        given = call.arguments
        # Registry ``inference-mode``: none before megatron-core 0.18 (inference_context tells).
        mode = getattr(inference_utils, "InferenceMode", None)
        if (
            given.get("labels") is not None
            and given.get("output_processor") is None
            and given.get("inference_context") is None
            and not (mode is not None and mode.is_active())
        ):
            given["output_processor"] = processor
        return postprocess(*call.args, **call.kwargs)

    return _postprocess
