"""The wrappers of the registry's four ``hook-*`` patches: where Megatron's loop calls the
installed features.

Each wrapper is applied with the run's :class:`~megatron_ext.common.features.FeatureSet` and picks,
once, the features overriding its hook; the replacement then calls them in hook order, around
Megatron's own function. Reading one top to bottom is the whole path from Megatron's call to
the feature (``megatron_ext.registry.table`` names which Megatron function each one replaces).
``pre_wrap_hook`` is the same for ``on_model_built``, which needs no patch: Megatron's public
``pre_wrap_hooks`` list calls it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from megatron_ext.common.features import Feature, FeatureSet, StepRecord


def pre_wrap_hook(features: FeatureSet) -> Callable[[list[Any]], list[Any]]:
    """The config container's ``pre_wrap_hooks`` entry: the built, unwrapped model chunks."""
    users = features.using(Feature.on_model_built)

    def on_model_built(model: list[Any]) -> list[Any]:
        for feature in users:
            feature.on_model_built(model)
        features.built.hook_ran = True
        return model

    return on_model_built


def wrap_setup(original: Callable[..., Any], features: FeatureSet) -> Callable[..., Any]:
    users = features.using(Feature.on_setup)

    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = original(*args, **kwargs)
        for feature in users:
            feature.on_setup(model, optimizer)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def wrap_get_grad_norm(
    original: Callable[[Any], Any], features: FeatureSet
) -> Callable[[Any], Any]:
    users = features.using(Feature.before_grad_norm)

    def get_grad_norm(self: Any) -> Any:
        for feature in users:
            feature.before_grad_norm(self)
        return original(self)

    return get_grad_norm


def wrap_training_log(original: Callable[..., Any], features: FeatureSet) -> Callable[..., Any]:
    users = features.using(Feature.after_step)
    # Megatron passes these positionally; the registry pins the signature they are bound by.
    signature = inspect.signature(original)

    def training_log(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        record = StepRecord(
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
        for feature in users:
            feature.after_step(record)
        return result

    return training_log


def wrap_save_checkpoint(original: Callable[..., Any], features: FeatureSet) -> Callable[..., Any]:
    users = features.using(Feature.on_checkpoint)

    def save_checkpoint_and_time(iteration: int, *args: Any, **kwargs: Any) -> Any:
        # Every feature hears about the save, even after one vetoed it.
        if not all([feature.on_checkpoint(iteration) for feature in users]):
            return None
        return original(iteration, *args, **kwargs)

    return save_checkpoint_and_time
