"""Every touch of Megatron-Bridge internals, in one table, with the Bridge version verified.

The megatron-core registry (:mod:`megatron_ext.registry.table`) declares what the overlay
touches in megatron-core, by megatron-core version; Bridge is a second upstream with its own
versions, so its entries live here and each says which Bridge release it was verified on
(:data:`BRIDGE_VERIFIED`). They use the registry's own :class:`Patch` / :class:`Assumption`
mechanism unchanged (exact signatures, idempotent apply, a readable refusal when a target
moved); ``verified_on`` is the megatron-core line they were verified with (0.19.2: the one
Bridge 0.6.2 runs on). :func:`verify_all` refuses, at start-up, a Bridge other than a verified
one and any entry whose target changed.

Only the touches that are not Bridge's public API are here. The public mechanisms the
integration uses (``ConfigContainer``, ``Callback`` events through ``CallbackManager.register``,
``model.register_pre_wrap_hook``, ``CheckpointConfig.custom_manager_class``,
``OptimizerConfigOverrideProvider``, ``train.iterations_to_skip``, ``gpt_step.forward_step``)
are verified too, as assumptions, so a renamed one is a start-up refusal and not an
AttributeError mid-run.
"""

from __future__ import annotations

import importlib.metadata

from megatron_ext.bridge import wiring
from megatron_ext.common.errors import StartupError
from megatron_ext.common.versions import V19
from megatron_ext.registry import fixes
from megatron_ext.registry.patching import Assumption, Entry, Patch
from megatron_ext.weight_decay.adapter import WeightDecayFeature, with_param_map

BRIDGE_VERIFIED: tuple[str, ...] = ("0.6.2",)
_TRAINING = "megatron.bridge.training"


class UnsupportedBridge(StartupError):
    """The installed Megatron-Bridge is not a version the integration was verified on."""


BUGFIXES: tuple[Patch, ...] = (
    Patch(
        name="bridge-prebuilt-dataset-helpers",
        verified_on=V19,
        kind="bugfix",
        target=f"{_TRAINING}.initialize:compile_helpers",
        signature="()",
        wrap=fixes.skip_make_when_prebuilt,
        reason="The registry's prebuilt-dataset-helpers fix, where Bridge holds its own "
        "reference (`from megatron.core.datasets.utils import compile_helpers`): Bridge's "
        "initialize_megatron runs `make` in the installed megatron-core, whose wheel ships the "
        "prebuilt helpers_cpp and no Makefile, so every start-up exits 1.",
    ),
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="bridge-dataset-provider",
        verified_on=V19,
        kind="hook",
        target=f"{_TRAINING}.pretrain:get_dataset_provider",
        signature="(dataset_config: megatron.core.datasets.blended_megatron_dataset_config."
        "BlendedMegatronDatasetConfig | megatron.bridge.data.builders.gpt_sft."
        "GPTSFTDatasetConfig | megatron.bridge.data.builders.direct_hf_sft."
        "DirectHFSFTDatasetConfig | megatron.bridge.data.builders.energon.EnergonDatasetConfig "
        "| megatron.bridge.data.builders.mock_vlm_sft.MockVLMSFTDatasetConfig | "
        "megatron.bridge.data.base.DatasetProvider) -> Callable[..., Any]",
        wrap=wiring.with_train_dataset_hook,
        reason="on_train_dataset: Bridge picks the dataset provider from the dataset config's "
        "type inside _pretrain, and has no public hook on the built train dataset (the sample "
        "log adds each sample's global index there). The provider it picks is wrapped so the "
        "train dataset goes through the features' on_train_dataset.",
    ),
)

FEATURE_PATCHES: tuple[Patch, ...] = (  # applied bound to their installed feature
    Patch(
        name="bridge-weight-decay-map",
        verified_on=V19,
        target=f"{_TRAINING}.optim:get_megatron_optimizer",
        signature="(config: megatron.core.optimizer.optimizer_config.OptimizerConfig, "
        "model_chunks: List[megatron.core.transformer.module.MegatronModule], "
        "config_overrides: Optional[Dict[megatron.core.optimizer.optimizer_config."
        "ParamKey, megatron.core.optimizer_param_scheduler.ParamGroupOverride]] = None, "
        "use_gloo_process_groups: bool = True, pg_collection: Optional[megatron.core."
        "process_groups_config.ProcessGroupCollection] = None, "
        "dump_param_to_param_group_map: Optional[str] = None) -> "
        "megatron.core.optimizer.optimizer.MegatronOptimizer",
        wrap=with_param_map,
        feature=WeightDecayFeature,
        reason="The registry's weight-decay-map where Bridge's setup_optimizer holds its own "
        "reference to megatron-core's get_megatron_optimizer: with a weight-decay flag set, "
        "print every parameter's wd_mult and the rule that decided it once the param groups "
        "exist (proof the OptimizerConfigOverrideProvider's overrides took), and fail on a "
        "GLOB matching nothing.",
    ),
)

ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption(
        name="bridge-te-import",
        target="megatron.bridge.peft.lora_layers",
        names=("LoRALinear",),
        used_by="megatron_ext.bridge.te_standin",
        verified_on=V19,
        reason="Every `import megatron.bridge` reaches peft/lora_layers.py, which imports "
        "transformer_engine.pytorch unguarded; te_standin shows that module alone an import "
        "stand-in, so Bridge imports without Transformer Engine.",
    ),
    Assumption(
        name="bridge-pretrain",
        target=f"{_TRAINING}.pretrain:pretrain",
        signature="(config: megatron.bridge.training.config.ConfigContainer, "
        "forward_step_func: megatron.bridge.training.forward_step_func_types.TwoArgForwardStep "
        "| megatron.bridge.training.forward_step_func_types.ThreeArgStateForwardStep | "
        "megatron.bridge.training.forward_step_func_types.ThreeArgForwardStep | "
        "megatron.bridge.training.forward_step_func_types.FourArgForwardStep | "
        "megatron.bridge.training.forward_step_func_types.ForwardStepFunctor, callbacks: "
        "list[megatron.bridge.training.callbacks.Callback] | "
        "megatron.bridge.training.callbacks.CallbackManager | None = None) -> None",
        used_by="megatron_ext.bridge.run",
        verified_on=V19,
        reason="The one call the integration makes in place of the user's.",
    ),
    Assumption(
        name="bridge-gpt-forward-step",
        target=f"{_TRAINING}.gpt_step:forward_step",
        signature="(state: megatron.bridge.training.state.GlobalState, data_iterator: "
        "Iterable, model: megatron.core.models.gpt.gpt_model.GPTModel, return_schedule_plan: "
        "bool = False) -> tuple[torch.Tensor, functools.partial]",
        used_by="megatron_ext.bridge.wiring",
        verified_on=V19,
        reason="The overlay's forward step is Bridge's own GPT step with the features' batch "
        "reader as its data iterator (Bridge's get_batch drops dataset_id) and its loss "
        "function observed: that partial's first argument is the loss mask, which Bridge does "
        "not otherwise pass on.",
    ),
    Assumption(
        name="bridge-callbacks",
        target=f"{_TRAINING}.callbacks",
        names=("CallbackManager", "Callback", "CallbackContext", "VALID_EVENTS"),
        used_by="megatron_ext.bridge.wiring",
        verified_on=V19,
        reason="on_setup (on_train_start), the per-step StepRecord and after_step "
        "(on_train_step_start / on_train_step_end), the skipped-end save (on_train_end).",
    ),
    Assumption(
        name="bridge-checkpoint-manager",
        target=f"{_TRAINING}.checkpointing:DefaultCheckpointManager",
        assigned=("checkpoint_config", "_context"),
        used_by="megatron_ext.bridge.checkpoints",
        verified_on=V19,
        reason="CheckpointConfig.custom_manager_class names the overlay's manager, which "
        "delegates to Bridge's default one after the features' on_checkpoint (the save veto "
        "during a spike).",
    ),
    Assumption(
        name="bridge-save-checkpoint-and-time",
        target=f"{_TRAINING}.train:save_checkpoint_and_time",
        signature="(state: megatron.bridge.training.state.GlobalState, model: "
        "list[megatron.core.transformer.module.MegatronModule], optimizer: "
        "megatron.core.optimizer.optimizer.MegatronOptimizer, opt_param_scheduler: "
        "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler, "
        "num_floating_point_operations_so_far: float, checkpoint_manager: "
        "megatron.bridge.training.checkpointing.CheckpointManager, non_persistent_ckpt: bool "
        "= False, train_data_iterator: Union[megatron.core.rerun_state_machine."
        "RerunDataIterator, list[megatron.core.rerun_state_machine.RerunDataIterator], "
        "NoneType] = None, pg_collection: Optional[megatron.core.process_groups_config."
        "ProcessGroupCollection] = None, callback_manager: Optional[megatron.bridge.training."
        "callbacks.CallbackManager] = None, module_name: str | None = None) -> None",
        used_by="megatron_ext.bridge.wiring",
        verified_on=V19,
        reason="Bridge's train() `continue`s past its interval save on a skipped iteration and "
        "saves at the end only when the last step is not an interval multiple, so a skip list "
        "covering the last iteration leaves no final checkpoint (as in Megatron, registry "
        "skip-list-final-checkpoint). on_train_end saves it, as train() would have.",
    ),
    Assumption(
        name="bridge-optimizer-overrides",
        target=f"{_TRAINING}.config:OptimizerConfigOverrideProvider",
        used_by="megatron_ext.bridge.wiring",
        verified_on=V19,
        reason="Weight-decay overrides: the provider's build_config_overrides result gets the "
        "feature's wd_mult ParamKeys (megatron_ext.weight_decay.adapter.extend_overrides).",
    ),
    Assumption(
        name="bridge-writers",
        target=f"{_TRAINING}.state:GlobalState",
        assigned=("_tensorboard_logger", "_wandb_logger"),
        used_by="megatron_ext.bridge.wiring.share_writers",
        verified_on=V19,
        reason="Bridge keeps its TensorBoard / W&B writers on its GlobalState (lazy properties "
        "tensorboard_logger, wandb_logger, on the last rank), not in Megatron's globals, "
        "where the features look for them; they are shared into Megatron's "
        "megatron.training.global_vars _GLOBAL_TENSORBOARD_WRITER / _GLOBAL_WANDB_WRITER "
        "(module attributes, checked by megatron-bridge-global-writers).",
    ),
    Assumption(
        name="megatron-bridge-global-writers",
        target="megatron.training.global_vars",
        names=("_GLOBAL_TENSORBOARD_WRITER", "_GLOBAL_WANDB_WRITER"),
        used_by="megatron_ext.bridge.wiring.share_writers",
        verified_on=V19,
        reason="Megatron's global writers, set to Bridge's (bridge-writers).",
    ),
    Assumption(
        name="bridge-target-allowlist",
        target="megatron.bridge.utils.instantiate_utils",
        names=("register_allowed_target_prefix",),
        used_by="megatron_ext.bridge.run",
        verified_on=V19,
        reason="Bridge instantiates custom_manager_class only under an allowed prefix; the "
        "integration registers megatron_ext.bridge.",
    ),
    Assumption(
        name="bridge-train-state-files",
        target=f"{_TRAINING}.utils.checkpoint_utils",
        names=("TRAIN_STATE_FILE", "TRACKER_PREFIX", "CONFIG_FILE"),
        used_by="megatron_ext.common.files (BRIDGE_*), incidents, lookup",
        verified_on=V19,
        reason="Bridge resumes from latest_train_state.pt before Megatron's tracker file, and "
        "keeps run_config.yaml, not Megatron's args, in each checkpoint: the rollback "
        "rewrites the first, the lookup reads the second.",
    ),
)


def _imports(module: str, names: tuple[str, ...]) -> Assumption:
    return Assumption(
        name=f"imports:{module}",
        verified_on=V19,
        target=module,
        names=names,
        used_by="megatron_ext.bridge (tests/unit/test_registry.py lists every import)",
        reason="Public names the Bridge integration imports from this module.",
    )


# Every megatron.bridge name the integration imports (the registry's IMPORTS, for Bridge).
IMPORTS: tuple[Assumption, ...] = (
    _imports(f"{_TRAINING}.callbacks", ("CallbackManager", "normalize_callbacks")),
    _imports(f"{_TRAINING}.checkpointing", ("DefaultCheckpointManager",)),
    _imports(f"{_TRAINING}.gpt_step", ("forward_step",)),
    _imports(f"{_TRAINING}.pretrain", ("pretrain",)),
    _imports(f"{_TRAINING}.train", ("save_checkpoint_and_time",)),
    _imports("megatron.bridge.utils.instantiate_utils", ("register_allowed_target_prefix",)),
)

ENTRIES: tuple[Entry, ...] = (*BUGFIXES, *PATCHES, *FEATURE_PATCHES, *ASSUMPTIONS, *IMPORTS)


def installed_bridge() -> str | None:
    """The installed megatron-bridge's version (None: not installed)."""
    try:
        return importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(found: str | None = None) -> str:
    """Refuse a Megatron-Bridge the integration was not verified on."""
    found = installed_bridge() if found is None else found
    if found not in BRIDGE_VERIFIED:
        raise UnsupportedBridge(
            f"megatron-bridge {found or 'is not installed'}: megatron-ext's Bridge integration "
            f"is verified on megatron-bridge {', '.join(BRIDGE_VERIFIED)} (with megatron-core "
            "0.19.2); install that (tools/bridge_venv.sh) or re-verify megatron_ext/bridge/"
            "table.py against yours"
        )
    return found


def verify_all() -> None:
    """Start-up: a verified Bridge, and every entry's target as declared."""
    check_version()
    for entry in ENTRIES:
        entry.verify()
