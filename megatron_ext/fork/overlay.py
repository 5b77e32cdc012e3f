"""The overlay in a pretrain script of the user's own: :class:`Overlay` and :class:`Forward`.
The features are installed inside :meth:`Overlay.pretrain` and reached through its handle,
never a module global; every hook goes through :mod:`megatron_ext.registry.hooks`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from megatron_ext.common.errors import StartupError
from megatron_ext.common.features import FeatureSet, LossInputs, MicroBatch
from megatron_ext.fork import start
from megatron_ext.loop.step import Step
from megatron_ext.registry import hooks


class ScriptError(StartupError):
    """The script calls the overlay out of order or against its contract (exit 1); the
    message says which call to change."""


def check_script(args: Any) -> None:
    """Refuse, before distributed init, the data modes whose batch is not the standard GPT batch
    the features read, and the layouts :func:`~megatron_ext.loop.gpt_step.check_layout` refuses."""
    from megatron_ext.loop import gpt_step

    if used := gpt_step.flags_set(args, gpt_step.BATCH_MODES):
        raise ScriptError(
            f"{', '.join(used)}: megatron-ext's features read the standard GPT pretraining "
            "batch ([micro-batch, sequence] tokens, labels and loss mask), which these modes "
            "replace; train them with your script without megatron_ext.fork, or drop the flags."
        )
    gpt_step.check_layout(args)


@dataclass(frozen=True)
class Forward:
    """One micro-batch's forward as the features see it (:meth:`Overlay.forward`)."""

    features: FeatureSet
    micro_batch: MicroBatch

    def read(self, data_iterator: Iterator[dict[str, Any]]) -> dict[str, Any]:
        """``next(data_iterator)`` for the script's ``get_batch`` on TP rank 0 of a data-reading
        stage, before the TP broadcast: ``on_batch`` sees the batch with its ``dataset_id``."""
        return hooks.read_batch(self.features, data_iterator, self.micro_batch)

    def loss(
        self, loss_func: Callable[[Any], tuple[Any, Any, dict[str, Any]]], loss_mask: Any
    ) -> Callable[[Any], tuple[Any, Any, dict[str, Any]]]:
        """What the forward step returns instead of ``loss_func``: ``loss_func``, then
        ``on_loss`` (:func:`observed_loss`)."""
        return partial(observed_loss, self.features, self.micro_batch, loss_func, loss_mask)


def observed_loss(
    features: FeatureSet,
    micro_batch: MicroBatch,
    loss_func: Callable[[Any], tuple[Any, ...]],
    loss_mask: Any,
    output_tensor: Any,
) -> tuple[Any, Any, dict[str, Any]]:
    """``loss_func``'s ``(loss, token count, report)``, the features' ``on_loss`` entries
    joined (a script's :meth:`Forward.loss` and the Bridge forward step's loss partial)."""
    outputs = loss_func(output_tensor)
    if len(outputs) != 3:
        raise ScriptError(
            f"the forward step's loss function returned {len(outputs)} values; it must "
            "return (token-summed loss, token count, report), as Megatron-LM's pretrain_gpt.py "
            "loss_func does: the features read the loss and its token count"
        )
    loss, num_tokens, report = outputs
    inputs = LossInputs(micro_batch, output_tensor, loss_mask.view(-1).float(), loss, num_tokens)
    return loss, num_tokens, hooks.loss_report(features, inputs, dict(report))


class Overlay:
    """megatron-ext for one run of the script: :meth:`pretrain` instead of Megatron's
    ``pretrain``, :meth:`forward` at the top of the forward step."""

    def __init__(self) -> None:
        self._features: FeatureSet | None = None

    @property
    def features(self) -> FeatureSet:
        """The features installed for this run (by :meth:`pretrain`, once it parsed the args)."""
        if self._features is None:
            raise ScriptError(
                "the features are not installed yet: call overlay.pretrain(...) instead of "
                "Megatron's pretrain, and overlay.forward(model) only inside the forward step "
                "it calls"
            )
        return self._features

    def forward(self, model: Any) -> Forward:
        """The micro-batch ``model`` is about to run: call it first in the forward step."""
        features = self.features
        from megatron_ext.loop import gpt_step

        return Forward(features, gpt_step.micro_batch_of(features, model))

    def pretrain(
        self,
        train_valid_test_datasets_provider: Callable[..., tuple[Any, Any, Any]],
        model_provider: Callable[..., Any] | None,
        model_type: Any,
        forward_step_func: Callable[..., Any],
        *,
        extra_args_provider: Callable[[Any], Any] | None = None,
        args_defaults: dict[str, Any] | None = None,
        get_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
        program_start: float | None = None,
        argv: list[str] | None = None,
    ) -> None:
        """Train with the script's functions, as Megatron's classic ``pretrain`` takes them
        (``model_provider`` None: the standard GPT model; ``argv`` None: the command line).
        Returns when training is complete; every other end ends the process (:mod:`.start`)."""
        observed = (
            None
            if model_provider is None
            else partial(hooks.observed_model_provider, model_provider)
        )
        step = Step(
            bind=partial(self._bind, forward_step_func, train_valid_test_datasets_provider),
            check=check_script,
            model_type=model_type,
            model_provider=observed,
            get_embedding_ranks=get_embedding_ranks,
            extra_args_provider=extra_args_provider,
            args_defaults=dict(args_defaults or {}),
        )
        start.main(sys.argv[1:] if argv is None else argv, step, program_start)

    def _bind(
        self,
        forward_step: Callable[..., Any],
        provider: Callable[..., tuple[Any, Any, Any]],
        features: FeatureSet,
        broadcast: Callable[..., dict[str, Any]],
    ) -> tuple[Callable[..., Any], Any]:
        """The Step's ``bind``: keep the features for :meth:`forward`; the script's forward step
        goes to Megatron as it is, its dataset provider through ``on_train_dataset``."""
        self._features = features
        datasets = partial(hooks.datasets, features, provider)
        datasets.is_distributed = getattr(provider, "is_distributed", False)  # type: ignore[attr-defined]
        return forward_step, datasets
