"""``--signals-attention-logit``: the max attention logit per step from the local attention
(Megatron's ``--log-max-attention-logit`` needs Transformer Engine): a forward pre-hook on each
softmax (registry ``local-attention-softmax``, ``-mask``) takes the max of its scaled, masked
scores, reduced over every rank into ``max_attention_logit``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.common.features import Feature, FeatureError, StepRecord, collective_device


class AttentionLogitFeature(Feature):
    """Hooks on the local attention's softmax, and the step's maximum on the step record."""

    name = "attention_logit"

    def __init__(self) -> None:
        self.step_max: torch.Tensor | None = None  # this rank's max since the last step

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--signals-attention-logit",
            action="store_true",
            help="Record the max attention logit (q.k scaled, over unmasked positions) of each "
            "training step in the signals log (max_attention_logit), from the local attention "
            "implementation; with Transformer Engine use Megatron's --log-max-attention-logit.",
        )

    def enabled(self, args: Any) -> bool:
        return bool(args.signals_attention_logit)

    def validate(self, args: Any) -> None:
        if not args.signals_dir:
            raise FeatureError(
                "--signals-attention-logit needs --signals-dir (it is a signals field)"
            )
        if args.transformer_impl != "local":
            raise FeatureError(
                "--signals-attention-logit reads the local attention implementation; with "
                f"--transformer-impl {args.transformer_impl} use Megatron's "
                "--log-max-attention-logit (TE >= 2.9) instead."
            )
        if args.log_max_attention_logit:
            raise FeatureError(
                "--signals-attention-logit and --log-max-attention-logit both fill "
                "max_attention_logit; keep one."
            )
        if getattr(args, "window_size", None) is not None:
            raise FeatureError(
                "--signals-attention-logit does not mask sliding-window attention "
                "(--window-size); drop one of the two."
            )

    def on_model_built(self, model: list[Any]) -> None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        attentions = [
            m for chunk in model for m in chunk.modules() if isinstance(m, DotProductAttention)
        ]
        for attention in attentions:
            attention.scale_mask_softmax.register_forward_pre_hook(self._scores)

    def _scores(self, softmax: Any, inputs: tuple[Any, ...]) -> None:
        """The softmax's input: ``[b, np, sq, sk]`` scores and the mask (True: masked)."""
        if not softmax.training:  # evaluation forwards are not part of the step's signal
            return
        scores, mask = inputs[0].detach(), inputs[1] if len(inputs) > 1 else None
        if softmax.scale is not None:
            scores = scores * softmax.scale
        sq, sk = scores.shape[-2:]
        causal = softmax.attn_mask_type.name == "causal"  # AttnMaskType, by name: no import
        if mask is None and causal and sq > 1:
            # Megatron's default causal mask (the future of each query), on the scores' device.
            mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
        if mask is not None:
            scores = scores.float().masked_fill(mask.to(scores.device), -torch.inf)
        peak = scores.amax().float().reshape(1)
        self.step_max = peak if self.step_max is None else torch.maximum(self.step_max, peak)

    def after_step(self, record: StepRecord) -> None:
        """Every rank: the max over every rank's layers and micro-batches."""
        local = self.step_max if self.step_max is not None else torch.full((1,), -torch.inf)
        local = local.to(collective_device())
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        self.step_max = None
        value = float(local.item())
        record.max_attention_logit = value if value != -float("inf") else None
