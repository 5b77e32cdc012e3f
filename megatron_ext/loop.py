"""Where Megatron's training loop meets the features: flags, installation and the four hooks.

The feature list is :func:`all_features` (order matters: it is the hook order, e.g.
telemetry fills the step record before the spike detector reads it). The hook wrappers below
are the ``wrap`` functions of the ``hook-*`` patches in :mod:`megatron_ext.registry`; a hook
patch is applied only when an installed feature overrides that hook, so a run without
megatron-ext flags keeps Megatron's functions untouched.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

from megatron_ext import registry
from megatron_ext.features import ACTIVE, Feature, StepRecord


def all_features() -> list[Feature]:
    """One instance of every feature, in hook order."""
    from megatron_ext.data.adapter import DataCheckFeature
    from megatron_ext.runlock.adapter import RunLockFeature
    from megatron_ext.sample_log.adapter import SampleLogFeature
    from megatron_ext.spikes.adapter import DrillFeature, SkipListFeature, SpikeFeature
    from megatron_ext.telemetry.adapter import TelemetryFeature
    from megatron_ext.weight_decay.adapter import WeightDecayFeature
    from megatron_ext.zloss.adapter import ZLossFeature

    # The run lock comes first: rank 0 holds --save before any feature writes there. The
    # spike detector comes last: on a rollback decision it ends the process in after_step,
    # once the others have written this iteration's records.
    return [
        RunLockFeature(),
        DataCheckFeature(),
        DrillFeature(),
        ZLossFeature(),
        WeightDecayFeature(),
        TelemetryFeature(),
        SampleLogFeature(),
        SkipListFeature(),
        SpikeFeature(),
    ]


def add_megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for Megatron's parser: every feature's flags, one group."""
    group = parser.add_argument_group(title="megatron-ext")
    for feature in all_features():
        feature.add_args(group)
    return parser


def install(args: Any) -> None:
    """Validate and install the enabled features, then the hook patches they use."""
    ACTIVE.install(all_features(), args)
    for hook in registry.HOOKS:
        if ACTIVE.using(hook.hook or ""):
            hook.apply()


def attach(config: Any) -> None:
    """Register ``on_model_built`` in the run's config container: megatron-core's public
    ``pre_wrap_hooks`` run on the built model chunks before any wrapping (registry
    assumption ``model-pre-wrap-hooks``), so no Megatron function is replaced."""
    if ACTIVE.using("on_model_built"):
        config.model.pre_wrap_hooks.append(pre_wrap_hook)


def pre_wrap_hook(model: list[Any]) -> list[Any]:
    ACTIVE.on_model_built(model)
    return model


# -- hook wrappers (named by the registry's hook-* patches) --------------------------------


def wrap_setup(original: Callable[..., Any]) -> Callable[..., Any]:
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = original(*args, **kwargs)
        ACTIVE.on_setup(model, optimizer)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def wrap_get_grad_norm(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def get_grad_norm(self: Any) -> Any:
        ACTIVE.before_grad_norm(self)
        return original(self)

    return get_grad_norm


def wrap_training_log(original: Callable[..., Any]) -> Callable[..., Any]:
    # Megatron passes these positionally; the registry pins the signature they are bound by.
    signature = inspect.signature(original)

    def training_log(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        ACTIVE.after_step(
            StepRecord(
                iteration=a["iteration"],
                losses=dict(a["loss_dict"]),
                learning_rate=a["learning_rate"],
                loss_scale=float(a["loss_scale"]),
                skipped_iter=bool(a["skipped_iter"]),
                grad_norm=a["grad_norm"],
                params_norm=a["params_norm"],
                num_zeros=a["num_zeros_in_grad"],
                max_attention_logit=a["max_attention_logit"],
            )
        )
        return result

    return training_log


def wrap_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint_and_time(iteration: int, *args: Any, **kwargs: Any) -> Any:
        if not ACTIVE.on_checkpoint(iteration):
            return None
        return original(iteration, *args, **kwargs)

    return save_checkpoint_and_time
