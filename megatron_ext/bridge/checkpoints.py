"""The checkpoint manager Bridge builds from ``CheckpointConfig.custom_manager_class``: Bridge's
default manager behind the features' ``on_checkpoint`` (the save veto; Bridge's
``on_checkpoint_save`` fires after the save, too late). Registry ``bridge-checkpoint-manager``.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.common.errors import StartupError
from megatron_ext.common.features import Feature
from megatron_ext.weight_decay.core import WEIGHT_DECAY_ARGS

FEATURES_KEY = "megatron_ext_features"
# What CheckpointConfig.custom_manager_class names (Bridge imports it by this name).
CLASS_PATH = "megatron_ext.bridge.checkpoints.VetoingCheckpointManager"
# The overlay's args a resume compares with the checkpoint's (the weight-decay resume check).
SAVED_ARGS = (*WEIGHT_DECAY_ARGS, "untie_embeddings_and_output_weights")


def write_layout(save: str, iteration: int, args: Any) -> None:
    """Rank 0: the world and DP sizes and the overlay's flags a resume is checked against, which
    Bridge's run_config.yaml lacks (:mod:`megatron_ext.common.bridge_state` reads them)."""
    import torch

    from megatron_ext.common.files import BRIDGE_LAYOUT_FILE, checkpoint_dir
    from megatron_ext.common.io import atomic_write_json

    if torch.distributed.get_rank() == 0:
        layout = {
            "world_size": args.world_size,
            "data_parallel_size": args.data_parallel_size,
            "args": {name: getattr(args, name, None) for name in SAVED_ARGS},
        }
        atomic_write_json(checkpoint_dir(save, iteration) / BRIDGE_LAYOUT_FILE, layout)


class VetoingCheckpointManager:
    """Bridge's ``DefaultCheckpointManager``, with every save asked of the features first."""

    def __init__(self, checkpoint_config: Any) -> None:
        from megatron.bridge.training.checkpointing import DefaultCheckpointManager

        self.default = DefaultCheckpointManager(checkpoint_config)

    def save(self, ctx: Any, callback_manager: Any) -> None:
        """Save unless a feature vetoes it (every feature hears about it, as in Megatron)."""
        features = (
            None if callback_manager is None else callback_manager.user_state.get(FEATURES_KEY)
        )
        if features is None:
            raise StartupError(
                f"{CLASS_PATH} saved without megatron-ext's features on the callback manager: "
                "start training with megatron_ext.bridge.pretrain, not Bridge's pretrain"
            )
        iteration = ctx.state.train_state.step
        users = features.using(Feature.on_checkpoint)
        if all([feature.on_checkpoint(iteration) for feature in users]):
            self.default.save(ctx, callback_manager)
            write_layout(self.default.checkpoint_config.save, iteration, features.args)

    def load(self, ctx: Any) -> tuple[int, int]:
        return self.default.load(ctx)

    def finalize_async_saves(
        self, state: Any, blocking: bool = False, terminate: bool = False
    ) -> None:
        self.default.finalize_async_saves(state, blocking=blocking, terminate=terminate)

    def __getattr__(self, name: str) -> Any:
        if name == "default":
            raise AttributeError(name)
        return getattr(self.default, name)
