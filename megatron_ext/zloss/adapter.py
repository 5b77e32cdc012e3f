"""The z-loss feature (:mod:`megatron_ext.zloss.core`) in Megatron: ``--z-loss-coeff``, and
the fused output layer + loss (:mod:`megatron_ext.zloss.fused`; the part at the end):
``--fused-output-loss``.

With a coefficient ``c > 0`` the ``zloss-output-layer`` patch replaces
``LanguageModule.compute_language_model_loss`` (what ``GPTModel`` calls for the main head and
for every MTP head) by the one-pass ``CE + c·log²Z``. With ``c = 0`` (the default) nothing is
patched and the run is plain Megatron.

MTP heads: Megatron computes their losses through the same method, so each MTP head's loss is
also ``CE + c·log²Z`` per token (they share the output layer, and their normalisers drift the
same way), scaled by ``--mtp-loss-scaling-factor`` like their CE. Megatron's ``mtp_k loss``
logs therefore include the head's ``c·log²Z``; ``lm loss`` and ``z loss`` are the main head's.

Logging: the patched method returns the training loss, but ``lm loss`` must stay pure cross
entropy (comparable with runs without z-loss) and ``z loss`` must be logged. Every call keeps
its detached per-token CE and log²Z next to the loss tensor it returned; the loss function
(``on_loss``) picks the terms of the tensor it was handed, which is the main head's, and fails
loudly if it was handed a tensor this method did not return. It also puts that per-token CE
on the micro-batch, so that the worst-DP-rank loss and the sample log measure what ``lm loss``
measures, not the training loss.

``--log-output-z`` (a signal, any coefficient): the same one-pass kernel also gives the signed
mean ``log Z`` per step (``log z`` in Megatron's log and TensorBoard, ``log_z`` in the signals
log), the precursor of an output-logit divergence (Wortsman et al. 2023): at ``c = 0`` the
patched method's loss and gradient are Megatron's cross entropy bit for bit
(tests/unit/zloss/test_z_off_exact.py), so turning the signal on changes no number.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.inference import utils as inference_utils
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_ext.common.features import LM_LOSS_PER_TOKEN, Feature, FeatureError, LossInputs
from megatron_ext.zloss.core import cross_entropy_and_z_loss
from megatron_ext.zloss.fused import fused_output_loss


class ZLossFeature(Feature):
    """``--z-loss-coeff``: the loss patch and the ``lm loss`` / ``z loss`` report entries."""

    name = "zloss"

    def __init__(self) -> None:
        self.coeff = 0.0
        self.chunk_tokens: int | None = None  # --fused-output-loss-chunk-tokens (None: auto)
        self.dummy_wgrad = True  # as Megatron's fused linear, unless installed without overlap
        # (training loss returned, per-token CE, per-token log²Z) of the calls since the last
        # loss function; MTP heads' calls come first, the main head's last.
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
        return args.z_loss_coeff != 0 or args.fused_output_loss or args.log_output_z

    def validate(self, args: Any) -> None:
        coeff = args.z_loss_coeff
        if not math.isfinite(coeff) or coeff < 0:
            raise FeatureError(f"--z-loss-coeff must be a finite number >= 0, got {coeff}.")
        if args.fused_output_loss:
            _validate_fused(args)
        if (coeff != 0 or args.log_output_z) and args.cross_entropy_loss_fusion:
            raise FeatureError(
                "--z-loss-coeff and --log-output-z cannot be combined with "
                "--cross-entropy-loss-fusion: they replace Megatron's cross entropy with the "
                "overlay's one-pass CE + z kernel, so the fused cross entropy would be silently "
                "ignored. Drop --cross-entropy-loss-fusion."
            )

    def install(self, args: Any) -> None:
        """Keep the coefficient; the installer then applies ``zloss-output-layer`` bound to
        this instance."""
        self.coeff = float(args.z_loss_coeff)
        self.chunk_tokens = args.fused_output_loss_chunk_tokens or None
        self.fused = bool(args.fused_output_loss)
        self.log_z = bool(args.log_output_z)
        # DDP marks a parameter ready for its bucket's all-reduce in its .grad hook, so with
        # overlapped reduction the weight needs a (dummy) .grad even when main_grad has it.
        self.dummy_wgrad = bool(getattr(args, "overlap_grad_reduce", False))

    def needs_patch(self, name: str) -> bool:
        """``zloss-output-layer`` with a coefficient or ``--log-output-z`` (the MTP heads'
        loss, and the main head's without fusion); ``fused-output-loss`` with its flag."""
        return {"zloss-output-layer": self.tracks(), "fused-output-loss": self.fused}[name]

    def tracks(self) -> bool:
        """Whether the loss calls keep their per-token terms for :meth:`on_loss`."""
        return self.coeff != 0 or self.log_z

    def on_loss(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        """``lm loss`` (pure CE) and ``z loss`` (mean log²Z) report entries; the per-token CE
        goes on the micro-batch (:data:`LM_LOSS_PER_TOKEN`).

        Same ``[masked sum, token count]`` form as the loss function's own ``lm loss``, so
        Megatron averages them over micro-batches and data-parallel ranks exactly as the CE.
        """
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


def _validate_fused(args: Any) -> None:
    """Refuse what cannot work with ``--fused-output-loss``, saying why."""
    if args.fused_output_loss_chunk_tokens < 0:
        raise FeatureError(
            "--fused-output-loss-chunk-tokens must be >= 1 (or 0 for the automatic size), got "
            f"{args.fused_output_loss_chunk_tokens}."
        )
    refused = {
        "cross_entropy_loss_fusion": (
            "--cross-entropy-loss-fusion",
            "the fused output loss replaces Megatron's cross entropy, fused or not, so it "
            "would be silently ignored",
        ),
        "defer_embedding_wgrad_compute": (
            "--defer-embedding-wgrad-compute",
            "it defers the output layer's weight-gradient GEMM, which the fused output loss "
            "computes during the forward: there is no deferred GEMM left to overlap",
        ),
    }
    for attr, (flag, why) in refused.items():
        if getattr(args, attr, False):
            raise FeatureError(
                f"--fused-output-loss cannot be combined with {flag}: {why}. Drop {flag}."
            )


def with_z_loss(
    _megatron_loss: Callable[..., torch.Tensor], feature: ZLossFeature
) -> Callable[..., torch.Tensor]:
    """Wrapper of the ``zloss-output-layer`` patch, bound to the installed feature."""

    def compute_language_model_loss(
        self: Any, labels: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """Per-token ``CE + c·log²Z`` as ``[b, s]``, remembering its CE and log²Z.

        Like Megatron's cross entropy this uses the logits as its working buffer: nothing
        reads them after the loss.
        """
        terms = cross_entropy_and_z_loss(
            logits,
            labels.transpose(0, 1).contiguous(),
            feature.coeff,
            self.tp_group,
            overwrite_logits=True,
        )
        loss = terms.loss.transpose(0, 1).contiguous()
        feature.pending.append(_kept(loss, terms))
        return loss

    return compute_language_model_loss


def _kept(loss: torch.Tensor, terms: Any) -> tuple[torch.Tensor, ...]:
    """What a loss call leaves for :meth:`ZLossFeature.on_loss`: the ``[b, s]`` loss it
    returned and its per-token CE, log²Z and log Z, ``[b, s]`` too."""
    return (loss, *(t.transpose(0, 1) for t in (terms.cross_entropy, terms.z_loss, terms.log_z)))


# -- --fused-output-loss ----------------------------------------------------------------------
# ``--fused-output-loss`` in Megatron: the main head's logits are never materialised.
#
# Patch point. megatron-core 0.19.2's ``GPTModel._postprocess`` computes
# ``logits = output_layer(hidden, weight=...)`` and then ``compute_language_model_loss(labels,
# logits)``; the logits exist before any loss method is called, so patching the loss method
# (as the z-loss does) is too late, and replacing ``ColumnParallelLinear.forward`` would touch
# every column-parallel layer. ``_postprocess`` has a public hook instead: an
# ``output_processor`` keyword that, when given, is handed the hidden states, the output layer,
# the output weight (the embedding when tied, also at PP>1), the labels and the loss mask, and
# whose return value is the model's output, in place of the output layer and the loss. The
# ``fused-output-loss`` patch only fills that keyword (when labels are given, outside
# inference, and nobody else passed one) with :func:`fused_output_processor`; everything else in
# ``_postprocess`` (MTP, the schedule, the pre/post-process split) is Megatron's.
#
# What stays on the plain path: inference and evaluation without labels (logits are the
# output), and MTP heads (Megatron's ``process_mtp_loss`` computes their logits itself and also
# takes their argmax for its acceptance counts). They run before the main head and are
# unchanged; the main head's ``[s·b, V/tp]`` logits, the dominant buffer, are fused away.
#
# Gradients reach the weight as the output layer's own linear function delivers them: the
# input gradient all-reduced over TP (or, with sequence parallelism, the hidden states are
# gathered with Megatron's ``gather_from_sequence_parallel_region`` whose backward
# reduce-scatters). Under Megatron DDP the weight gradient goes into ``main_grad`` during the
# forward, chunk by chunk, scaled by what the schedule will send (:func:`schedule_grad_scale`),
# with the ``grad_added_to_main_grad`` mark of Megatron's fused linear (and its dummy ``.grad``
# only with --overlap-grad-reduce); so no weight-sized gradient buffer waits for the backward
# (at V/tp 32k, hidden 4096, fp32: 512 MiB). Without DDP (a bare module) it is returned as
# ``.grad``.


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
    """GPTModel's ``output_processor``: the main head's ``[b, s]`` per-token loss, fused.

    Returns what ``compute_language_model_loss`` would (``CE + c·log²Z`` per token) and,
    with a z-loss, leaves its CE and log²Z for the z-loss feature's report, like the patched
    loss method does.
    """
    # The output layer's forward is not called, so run its forward pre-hooks as the call
    # would: with --overlap-param-gather, Megatron DDP's hook finishes this layer's param
    # all-gather there and starts the next bucket's (skipped, the next gather asserts).
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
    """The gradient Megatron's schedule will send each token's loss, per unit of its mask:
    the entry point's loss function returns ``(Σ loss · mask, token count, report)``, and
    megatron-core's ``forward_step_calc_loss`` divides that sum by the token count (at least 1)
    and by the micro-batch count unless ``calculate_per_token_loss``; ``backward_step`` then
    multiplies it by ``grad_scale_func``'s loss scale (registry assumption
    ``schedule-loss-scaling``). The same operations in the same order, so the same float; the
    fused backward checks the gradient it receives against it."""
    scale = torch.ones((), device=loss_mask.device)
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale).reshape(())
    if not config.calculate_per_token_loss:
        tokens = torch.clamp(loss_mask.sum().to(torch.int), min=1)
        scale = scale / get_num_microbatches() / tokens
    return scale


def _inference_mode_active() -> bool:
    """Megatron's process-wide inference mode (registry ``inference-mode``): megatron-core
    0.18 added ``InferenceMode``; on 0.17 an inference call is told by its
    ``inference_context`` alone."""
    mode = getattr(inference_utils, "InferenceMode", None)
    return bool(mode is not None and mode.is_active())


def with_fused_output_loss(
    postprocess: Callable[..., Any], feature: ZLossFeature
) -> Callable[..., Any]:
    """Wrapper of the ``fused-output-loss`` patch on ``GPTModel._postprocess``, bound to the
    installed z-loss feature."""
    processor = functools.partial(fused_output_processor, feature)
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
            and not _inference_mode_active()
        ):
            given["output_processor"] = processor
        return postprocess(*call.args, **call.kwargs)

    return _postprocess
