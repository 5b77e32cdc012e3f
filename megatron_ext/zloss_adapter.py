"""Megatron adapter for the output z-loss (:mod:`megatron_ext.zloss`): ``--z-loss-coeff``.

With a coefficient ``c > 0`` the ``zloss-output-layer`` patch replaces
``LanguageModule.compute_language_model_loss`` (what ``GPTModel`` calls for the main head and
for every MTP head) by the one-pass ``CE + c·log²Z``. With ``c = 0`` (the default) nothing is
patched and the run is plain Megatron.

MTP heads: Megatron computes their losses through the same method, so each MTP head's loss is
also ``CE + c·log²Z`` per token (they share the output layer, and their normalisers drift the
same way), scaled by ``--mtp-loss-scaling-factor`` like their CE. Megatron's ``mtp_k loss``
logs therefore include the head's ``c·log²Z``; ``lm loss`` and ``z loss`` are the main head's.

Logging goes through a side channel: the patched method returns the training loss, but
``lm loss`` must stay pure cross entropy (comparable with runs without z-loss) and ``z loss``
must be logged, so each call leaves its detached per-token CE and log²Z in a per-process
stash. ``GPTModel._postprocess`` computes the MTP losses before the main head's, so when the
GPT loss function runs (right after the forward, on the last pipeline stage, where the loss is
computed) the stash holds the main head's terms; :func:`report_terms` consumes them once.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

import torch

from megatron_ext import patches
from megatron_ext.patches import Patch, register
from megatron_ext.zloss import cross_entropy_and_z_loss


def add_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--z-loss-coeff",
        type=float,
        default=0.0,
        help="Output-layer z-loss coefficient c: adds c·log²Z per token (Z: the softmax "
        "normaliser of the output logits) in one pass with the cross entropy (PaLM 1e-4, "
        "OLMo 2/3 1e-5). Applies to MTP heads too. 'lm loss' stays pure cross entropy; "
        "'z loss' logs the mean log²Z. 0 (default) is off.",
    )


class _State:
    """The active coefficient and the last loss call's detached per-token ``(CE, log²Z)``."""

    coeff = 0.0
    stash: tuple[torch.Tensor, torch.Tensor] | None = None


def _with_z_loss(_megatron_loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def compute_language_model_loss(
        self: Any, labels: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """Per-token ``CE + c·log²Z`` as ``[b, s]``; stashes the CE and log²Z for logging.

        Like Megatron's cross entropy this uses the logits as its working buffer: nothing
        reads them after the loss.
        """
        terms = cross_entropy_and_z_loss(
            logits, labels.transpose(0, 1).contiguous(), _State.coeff, self.tp_group,
            overwrite_logits=True,
        )
        _State.stash = (terms.cross_entropy.transpose(0, 1), terms.z_loss.transpose(0, 1))
        return terms.loss.transpose(0, 1).contiguous()

    return compute_language_model_loss


ZLOSS = register(
    Patch(
        name="zloss-output-layer",
        target=(
            "megatron.core.models.common.language_module.language_module:"
            "LanguageModule.compute_language_model_loss"
        ),
        reason=(
            "--z-loss-coeff: megatron-core has no output-layer z-loss. The language-model "
            "loss (main head and MTP heads) becomes CE + c·log²Z, computed in one pass over "
            "the vocab-parallel logits with the cross entropy's own all-reduces."
        ),
        signature="(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor",
        wrap=_with_z_loss,
    )
)


def install(args: Any) -> None:
    """Refuse unsupported combinations, then patch the loss when the coefficient is > 0."""
    coeff = args.z_loss_coeff
    if not math.isfinite(coeff) or coeff < 0:
        raise SystemExit(f"--z-loss-coeff must be a finite number >= 0, got {coeff}.")
    if coeff == 0:
        return
    if args.cross_entropy_loss_fusion:
        raise SystemExit(
            "--z-loss-coeff cannot be combined with --cross-entropy-loss-fusion: the z-loss "
            "replaces Megatron's cross entropy with its own one-pass CE + z kernel, so the "
            "fused cross entropy would be silently ignored. Drop --cross-entropy-loss-fusion."
        )
    _State.coeff = coeff
    patches.apply(ZLOSS.name)


def report_terms(mask: torch.Tensor, num_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """``lm loss`` (pure CE) and ``z loss`` (mean log²Z) report entries, or ``{}`` when off.

    Same ``[masked sum, token count]`` form as the loss function's own ``lm loss``, so
    Megatron averages them over micro-batches and data-parallel ranks exactly as the CE
    (and logs them to the console, TensorBoard and W&B). ``mask`` is the flattened float
    loss mask; the stash of the micro-batch's forward is consumed here.
    """
    if _State.coeff == 0:
        return {}
    if _State.stash is None:
        raise RuntimeError(
            "z-loss: no loss terms stashed for this micro-batch; compute_language_model_loss "
            "did not run before the loss function (Megatron's loss path changed?)."
        )
    (cross_entropy, z_loss), _State.stash = _State.stash, None
    return {
        name: torch.cat([torch.sum(term.reshape(-1) * mask).view(1), num_tokens.view(1)])
        for name, term in (("lm loss", cross_entropy), ("z loss", z_loss))
    }
