"""Where Megatron's training loop meets the features: flags, installation and binding.

The feature list is :func:`all_features` (order matters: it is the hook order, e.g.
telemetry fills the step record before the spike detector reads it). :func:`install`
validates and installs the enabled features into one :class:`FeatureSet`, then applies,
bound to it, the registry's patches they use: a feature's own patches (bound to that
feature) and the ``hook-*`` patches whose hook an installed feature overrides (bound to the
set; their wrappers are in :mod:`megatron_ext.hooks`). A run without megatron-ext flags
keeps Megatron's functions untouched. The entry point hands the same set to its own hook
callers (:func:`attach`, :mod:`megatron_ext.gpt_step`).
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_ext import hooks, registry
from megatron_ext.data.adapter import DataCheckFeature
from megatron_ext.features import Feature, FeatureSet
from megatron_ext.runlock.adapter import RunLockFeature
from megatron_ext.sample_log.adapter import SampleLogFeature
from megatron_ext.spikes.adapter import DrillFeature, SpikeFeature
from megatron_ext.spikes.skip_list import SkipListFeature
from megatron_ext.telemetry.adapter import TelemetryFeature
from megatron_ext.weight_decay.adapter import WeightDecayFeature
from megatron_ext.zloss.adapter import ZLossFeature


def all_features() -> list[Feature]:
    """One instance of every feature, in hook order."""
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


def install(args: Any, features: list[Feature] | None = None) -> FeatureSet:
    """Validate and install the enabled features (``all_features()`` unless given), then
    apply the patches they use, each bound to what its wrapper reads."""
    installed = FeatureSet.install(all_features() if features is None else features, args)
    for feature in installed.features:
        apply_patches_of(feature)
    for patch in registry.HOOKS:
        if patch.hook is not None and installed.using(patch.hook):
            patch.apply(installed)
    return installed


def apply_patches_of(feature: Feature) -> None:
    """Apply the registry's patches of an installed ``feature`` that it asks for, bound to
    it."""
    for patch in registry.FEATURE_PATCHES:
        if type(feature) is patch.feature and feature.needs_patch(patch.name):
            patch.apply(feature)


def attach(config: Any, features: FeatureSet) -> None:
    """Register ``on_model_built`` in the run's config container: megatron-core's public
    ``pre_wrap_hooks`` run on the built model chunks before any wrapping (registry
    assumption ``model-pre-wrap-hooks``), so no Megatron function is replaced."""
    if features.using(Feature.on_model_built):
        config.model.pre_wrap_hooks.append(hooks.pre_wrap_hook(features))
