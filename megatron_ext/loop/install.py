"""Where Megatron's training loop meets the features: their flags, and :func:`install`, which
installs the enabled ones into one FeatureSet and applies, bound to it, the registry's patches
they use (a feature's own, bound to the feature; the ``hook-*`` ones whose hook an installed
feature overrides, bound to the set). A run without megatron-ext flags leaves Megatron as it is.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_ext.common.features import Feature, FeatureError, FeatureSet
from megatron_ext.data.adapter import DataCheckFeature
from megatron_ext.fsdp.adapter import TorchFsdpFeature
from megatron_ext.hang.adapter import FLAGS as HANG_FLAGS
from megatron_ext.hang.adapter import HangFeature
from megatron_ext.recovery.adapter import RecoveryFeature
from megatron_ext.registry import hooks
from megatron_ext.registry import table as registry
from megatron_ext.runlock.adapter import RunLockFeature
from megatron_ext.sample_log.adapter import SampleLogFeature
from megatron_ext.spikes.adapter import DrillFeature, SkipListFeature, SpikeFeature
from megatron_ext.spikes.update_skip import UpdateSkipFeature
from megatron_ext.telemetry.adapter import TelemetryFeature
from megatron_ext.telemetry.attention_logit import AttentionLogitFeature
from megatron_ext.telemetry.validation import ValidationFeature
from megatron_ext.weight_decay.adapter import WeightDecayFeature
from megatron_ext.zloss.adapter import ZLossFeature


def all_features() -> list[Feature]:
    """One instance of every feature, in hook order (e.g. telemetry fills the step record
    before the spike detector reads it)."""
    # The run lock first: rank 0 holds --save before any feature writes there. The spike
    # detector last: a rollback ends the process in after_step, once the others have written.
    return [
        RunLockFeature(),
        HangFeature(),
        TorchFsdpFeature(),
        DataCheckFeature(),
        DrillFeature(),
        ZLossFeature(),
        WeightDecayFeature(),
        # Before telemetry: they fill the step record's withheld update and attention logit,
        # and recovery its lr (scaled before telemetry reads it) and its window.
        RecoveryFeature(),
        UpdateSkipFeature(),
        AttentionLogitFeature(),
        TelemetryFeature(),
        ValidationFeature(),  # after z-loss: reads its pure-CE lm loss
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


# Flags verified to be independent of the data-parallel wrapper: the run lock and the skip
# lists (Megatron's own --iterations-to-skip, resolved before it parses), the hang watchdog.
WRAPPER_FREE = frozenset(
    {
        "force_run_lock",
        "iterations_to_skip_file",
        "skip_sample_windows",
        "skip_windows_global_batch",
        *HANG_FLAGS,
    }
)


def used_flags(args: Any, exempt: frozenset[str] = frozenset()) -> list[str]:
    """The megatron-ext flags ``args`` sets to other than their defaults, as typed."""
    defaults = vars(add_megatron_ext_args(argparse.ArgumentParser()).parse_args([]))
    return [
        "--" + dest.replace("_", "-")
        for dest, default in defaults.items()
        if dest not in exempt and getattr(args, dest, default) != default
    ]


def refuse_under_megatron_fsdp(args: Any) -> None:
    """Refuse the megatron-ext flags set in ``args`` when Megatron-FSDP wraps the model (not
    verified there: the message says why)."""
    if getattr(args, "use_megatron_fsdp", False) and (used := used_flags(args, WRAPPER_FREE)):
        raise FeatureError(
            f"{', '.join(used)} with --use-megatron-fsdp: megatron-ext's features are not "
            "verified under Megatron-FSDP (telemetry needs Megatron's ChainedOptimizer and DDP "
            "buckets, z-loss its unchanged loss tensor; Megatron-FSDP does not run on the CPU "
            "runner). Drop them, or train with --use-torch-fsdp2 (checked by the layout "
            "matrix) or --use-distributed-optimizer."
        )


def refuse_inprocess_restart(args: Any) -> None:
    """Refuse Megatron's ``--inprocess-restart`` with megatron-ext's features (not verified)."""
    if getattr(args, "inprocess_restart", False) and (used := used_flags(args)):
        raise FeatureError(
            f"{', '.join(used)} with --inprocess-restart: not verified (a second pass through "
            "pretrain keeps megatron-ext's feature state, and an in-process retry of the spike "
            "detector's exit replays the spike instead of rolling back). Drop "
            "--inprocess-restart and restart jobs from the last checkpoint: "
            "launch/run_single_node.sh or launch/pretrain_gpt_ext.sbatch (rollbacks and hangs "
            "handled), or nvidia-resiliency-ext's ft_launcher (in-job restarts; a pending "
            "rollback is applied when the training restarts)."
        )


def install(args: Any, features: list[Feature] | None = None) -> FeatureSet:
    """Validate and install the enabled features (``all_features()`` unless given), then
    apply the patches they use, each bound to what its wrapper reads."""
    refuse_under_megatron_fsdp(args)
    refuse_inprocess_restart(args)
    installed = FeatureSet.install(all_features() if features is None else features, args)
    for feature in installed.features:
        apply_patches_of(feature)
    for patch in registry.HOOKS:
        if patch.hook is not None and installed.using(patch.hook):
            patch.apply(installed)
    return installed


def apply_patches_of(feature: Feature, patches: tuple = registry.FEATURE_PATCHES) -> None:
    """Apply the ``patches`` (the registry's; Bridge's table) of an installed ``feature`` that
    it asks for, bound to it."""
    for patch in patches:
        if type(feature) is patch.feature and feature.needs_patch(patch.name):
            patch.apply(feature)


def attach(config: Any, features: FeatureSet) -> None:
    """Register ``on_model_built`` in the config container's public ``pre_wrap_hooks``
    (registry ``model-pre-wrap-hooks``): no Megatron function is replaced."""
    if features.using(Feature.on_model_built):
        config.model.pre_wrap_hooks.append(hooks.pre_wrap_hook(features))
