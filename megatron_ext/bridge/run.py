""":func:`pretrain`: Bridge's ``pretrain`` with every megatron-ext feature, in one call. It
starts and ends as ``pretrain_gpt_ext.py`` does (:mod:`megatron_ext.fork.start`), the skip
lists resolved into ``train.iterations_to_skip`` and Bridge's registry entries verified too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from megatron_ext.bridge import args as bridge_args
from megatron_ext.bridge import checkpoints, te_standin, wiring
from megatron_ext.common.features import FeatureSet


def final_save(features: FeatureSet, config: Any, manager: Any, context: Any) -> None:
    """``on_train_end``: the final checkpoint Bridge's ``train()`` skips when the last
    iteration was skipped at an interval multiple (``bridge-save-checkpoint-and-time``)."""
    ckpt = config.checkpoint
    step = context.state.train_state.step
    if (
        not ckpt.save
        or not ckpt.save_interval
        or step == 0
        or step % ckpt.save_interval
        or step not in set(config.train.iterations_to_skip or ())
        or (Path(ckpt.save) / f"iter_{step:07d}").is_dir()
    ):
        return
    from megatron.bridge.training.train import save_checkpoint_and_time

    from megatron_ext.fork.start import rank

    if rank() == 0:
        print(f"megatron-ext: saving the final checkpoint {step} (its iteration was skipped)")
    save_checkpoint_and_time(
        context.state,
        context.model,
        context.optimizer,
        context.scheduler,
        context.state.train_state.floating_point_operations_so_far,
        checkpoints.VetoingCheckpointManager(ckpt),
        callback_manager=manager,
    )


def apply_launcher_flags(config: Any, flags: list[str]) -> None:
    """The launchers' ``--save``, ``--load`` and ``--exit-signal-handler`` win over Bridge's
    config, so the supervisor relaunches a Bridge job as it does ``pretrain_gpt_ext.py``."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--exit-signal-handler", action="store_true")
    given, _ = parser.parse_known_args(flags)
    if given.save:
        config.checkpoint.save = given.save
    if given.load:
        config.checkpoint.load = given.load
    if given.exit_signal_handler:
        config.train.exit_signal_handler = True


def _start(config: Any, flags: list[str]) -> Any:
    """Verify, fix, refuse, resolve the skip lists; the features' Megatron-style args."""
    from megatron_ext.fork import start
    from megatron_ext.registry import patching

    patching.check_version()
    te_standin.install()
    from megatron_ext.bridge import table as bridge_table
    from megatron_ext.registry import table as registry

    registry.verify_all()
    bridge_table.verify_all()
    for fix in (*registry.BUGFIXES, *bridge_table.BUGFIXES):
        fix.apply()
    bridge_args.refuse_unsupported(config)
    apply_launcher_flags(config, flags)
    load = config.checkpoint.load
    # The loop's own skip-list resolution, on Bridge's load directory.
    argv = start.prepare_skips([*(["--load", load] if load else []), *flags])
    args = bridge_args.megatron_args(config, argv)
    config.train.iterations_to_skip = args.iterations_to_skip
    return args


def pretrain(
    config: Any,
    flags: list[str] | None = None,
    forward_step_func: Callable[..., Any] | None = None,
    callbacks: Any = None,
) -> None:
    """Train ``config`` with Bridge's ``pretrain`` and the features ``flags`` ask for.
    ``forward_step_func``: Bridge's GPT step (default) or one of its form, whose loss partial's
    first argument is the loss mask; ``callbacks``: run before the features' (docs/bridge.md)."""
    from megatron_ext.common.errors import exit_on_error
    from megatron_ext.common.process_exit import ending_children_on_failure

    run = partial(_pretrain, config, list(flags or []), forward_step_func, callbacks)
    ending_children_on_failure(lambda: exit_on_error(run))


def _pretrain(
    config: Any, flags: list[str], forward_step_func: Callable[..., Any] | None, callbacks: Any
) -> None:
    from megatron_ext.common import attempt_end
    from megatron_ext.fork.start import rank
    from megatron_ext.loop import install as loop
    from megatron_ext.registry import hooks

    args = _start(config, flags)
    features = loop.install(args)

    from megatron.bridge.training.callbacks import CallbackManager, normalize_callbacks
    from megatron.bridge.training.gpt_step import forward_step as gpt_forward_step
    from megatron.bridge.training.pretrain import pretrain as bridge_pretrain
    from megatron.bridge.training.utils.train_utils import needs_global_state_injection
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    from megatron_ext.bridge import table as bridge_table
    from megatron_ext.weight_decay.adapter import WeightDecayFeature

    config.model.register_pre_wrap_hook(hooks.pre_wrap_hook(features))
    for feature in features.features:
        if isinstance(feature, WeightDecayFeature) and feature.needs_patch(""):
            wiring.with_weight_decay(config.optimizer_config_override_provider, feature.policy)
        loop.apply_patches_of(feature, bridge_table.FEATURE_PATCHES)
    register_allowed_target_prefix("megatron_ext.bridge.")
    config.checkpoint.custom_manager_class = checkpoints.CLASS_PATH
    for patch in bridge_table.PATCHES:
        patch.apply(features)
    manager = normalize_callbacks(callbacks) or CallbackManager()
    wiring.register_callbacks(manager, features, partial(final_save, features, config, manager))
    user_step = forward_step_func or gpt_forward_step
    wants_state = needs_global_state_injection(user_step)  # Bridge's own rule, decided once
    step = partial(wiring.forward_step, features, user_step, wants_state)
    bridge_pretrain(config, step, manager)
    if rank() == 0:
        attempt_end.record(True, "pretrain returned: the training is complete")
    sys.stdout.flush()
