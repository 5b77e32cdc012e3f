"""Every touch of Megatron-Bridge internals (public mechanisms too, so a renamed one is a
start-up refusal), as the registry's entries verified on megatron-core 0.19.2, Bridge 0.6.2.
:func:`verify_all` refuses an unverified Bridge or a moved target.
"""

from __future__ import annotations

import importlib.metadata
from functools import partial

from megatron_ext.bridge import wiring
from megatron_ext.common.errors import StartupError
from megatron_ext.common.versions import V19
from megatron_ext.registry import fixes
from megatron_ext.registry.patching import Assumption, Patch
from megatron_ext.weight_decay.adapter import WeightDecayFeature, with_param_map

BRIDGE_VERIFIED: tuple[str, ...] = ("0.6.2",)
_TRAINING = "megatron.bridge.training"
_patch = partial(Patch, verified_on=V19)
_assume = partial(Assumption, verified_on=V19)


class UnsupportedBridge(StartupError):
    """The installed Megatron-Bridge is not a version the integration was verified on."""


BUGFIXES: tuple[Patch, ...] = (
    _patch(
        name="bridge-prebuilt-dataset-helpers",
        kind="bugfix",
        target=f"{_TRAINING}.initialize:compile_helpers",
        signature="()",
        wrap=fixes.skip_make_when_prebuilt,
        reason="The registry's prebuilt-dataset-helpers fix on Bridge's own reference: its "
        "initialize_megatron runs `make` in megatron-core's wheel, which has no Makefile.",
    ),
)

PATCHES: tuple[Patch, ...] = (
    _patch(
        name="bridge-dataset-provider",
        kind="hook",
        target=f"{_TRAINING}.pretrain:get_dataset_provider",
        signature="(dataset_config: megatron.core.datasets.blended_megatron_dataset_config."
        "BlendedMegatronDatasetConfig | megatron.bridge.data.builders.gpt_sft."
        "GPTSFTDatasetConfig | megatron.bridge.data.builders.direct_hf_sft."
        "DirectHFSFTDatasetConfig | megatron.bridge.data.builders.energon.EnergonDatasetConfig "
        "| megatron.bridge.data.builders.mock_vlm_sft.MockVLMSFTDatasetConfig | "
        "megatron.bridge.data.base.DatasetProvider) -> Callable[..., Any]",
        wrap=wiring.with_train_dataset_hook,
        reason="on_train_dataset: Bridge has no public hook on the built train dataset; the "
        "provider it picks is wrapped so the train dataset goes through the features.",
    ),
)

CPU_RUNNER: tuple[Patch, ...] = (
    _patch(
        name="bridge-cpu-initialize-without-cuda",
        kind="cpu",
        target=f"{_TRAINING}.initialize:initialize_megatron",
        also_bound_in=(f"{_TRAINING}.setup",),
        signature="(cfg: megatron.bridge.training.config.ConfigContainer, allow_no_cuda: bool "
        "= False, skip_mpu_initialization: bool = False, get_embedding_ranks: Optional["
        "Callable[[list[int], Optional[int]], list[int]]] = None, get_position_embedding_ranks"
        ": Optional[Callable[[list[int], Optional[int]], list[int]]] = None, restart_store: "
        "Optional[torch.distributed.distributed_c10d.Store] = None) -> Union[Callable[[], "
        "NoneType], megatron.core.process_groups_config.ProcessGroupCollection, NoneType]",
        wrap=fixes.allows_no_cuda,
        reason="Applied by the CPU runner alone (--bridge-script): Bridge's initialize_megatron "
        "asserts CUDA unless allow_no_cuda, which its pretrain never passes; passed (counted).",
    ),
)

FEATURE_PATCHES: tuple[Patch, ...] = (  # applied bound to their installed feature
    _patch(
        name="bridge-weight-decay-map",
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
        reason="The registry's weight-decay-map on Bridge's own reference to "
        "get_megatron_optimizer: the per-parameter wd_mult map, and unmatched GLOBs refused.",
    ),
)

ASSUMPTIONS: tuple[Assumption, ...] = (
    _assume(
        name="bridge-te-import",
        target="megatron.bridge.peft.lora_layers",
        names=("LoRALinear",),
        used_by="megatron_ext.bridge.te_standin",
        reason="peft/lora_layers.py imports transformer_engine unguarded; te_standin shows it "
        "alone a stand-in, so Bridge imports without Transformer Engine.",
    ),
    _assume(
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
        reason="The one call the integration makes in place of the user's.",
    ),
    _assume(
        name="bridge-gpt-forward-step",
        target=f"{_TRAINING}.gpt_step:forward_step",
        signature="(state: megatron.bridge.training.state.GlobalState, data_iterator: "
        "Iterable, model: megatron.core.models.gpt.gpt_model.GPTModel, return_schedule_plan: "
        "bool = False) -> tuple[torch.Tensor, functools.partial]",
        used_by="megatron_ext.bridge.wiring",
        reason="Bridge's GPT step reads through the features' batch reader (its get_batch "
        "drops dataset_id); its loss partial's first argument is the loss mask.",
    ),
    _assume(
        name="bridge-callbacks",
        target=f"{_TRAINING}.callbacks",
        names=("CallbackManager", "Callback", "CallbackContext", "VALID_EVENTS"),
        used_by="megatron_ext.bridge.wiring",
        reason="on_setup (on_train_start), the per-step StepRecord and after_step "
        "(on_train_step_start / on_train_step_end), the skipped-end save (on_train_end).",
    ),
    _assume(
        name="bridge-eval-callbacks",
        target=f"{_TRAINING}.eval:evaluate",
        assigned=("on_eval_start", "on_eval_end", "on_test_start", "on_test_end"),
        used_by="megatron_ext.bridge.wiring",
        reason="Per-dataset validation: Bridge's evaluate fires on_eval_start / on_test_start "
        "before its forwards and on_eval_end / on_test_end with the averaged total_loss_dict, "
        "where the members' sums start and are reduced and checked against it.",
    ),
    _assume(
        name="bridge-checkpoint-manager",
        target=f"{_TRAINING}.checkpointing:DefaultCheckpointManager",
        assigned=("checkpoint_config", "_context"),
        used_by="megatron_ext.bridge.checkpoints",
        reason="custom_manager_class names the overlay's manager, which delegates to Bridge's "
        "default one after the features' on_checkpoint (the save veto).",
    ),
    _assume(
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
        reason="train() skips the interval save of a skipped iteration and saves at the end "
        "only off an interval multiple: a skipped last iteration leaves no final checkpoint, "
        "which on_train_end saves.",
    ),
    _assume(
        name="bridge-optimizer-overrides",
        target=f"{_TRAINING}.config:OptimizerConfigOverrideProvider",
        used_by="megatron_ext.bridge.wiring",
        reason="Weight-decay overrides: build_config_overrides' result gets the wd_mult keys.",
    ),
    _assume(
        name="bridge-writers",
        target=f"{_TRAINING}.state:GlobalState",
        assigned=("_tensorboard_logger", "_wandb_logger"),
        used_by="megatron_ext.bridge.wiring.share_writers",
        reason="Bridge keeps its TensorBoard / W&B writers on its GlobalState, not in "
        "Megatron's globals where the features look; they are shared into those.",
    ),
    _assume(
        name="megatron-bridge-global-writers",
        target="megatron.training.global_vars",
        names=("_GLOBAL_TENSORBOARD_WRITER", "_GLOBAL_WANDB_WRITER"),
        used_by="megatron_ext.bridge.wiring.share_writers",
        reason="Megatron's global writers, set to Bridge's (bridge-writers).",
    ),
    _assume(
        name="bridge-target-allowlist",
        target="megatron.bridge.utils.instantiate_utils",
        names=("register_allowed_target_prefix",),
        used_by="megatron_ext.bridge.run",
        reason="Bridge instantiates custom_manager_class only under an allowed prefix; the "
        "integration registers megatron_ext.bridge.",
    ),
    _assume(
        name="bridge-train-state-files",
        target=f"{_TRAINING}.utils.checkpoint_utils",
        names=("TRAIN_STATE_FILE", "TRACKER_PREFIX", "CONFIG_FILE"),
        used_by="megatron_ext.common.files (BRIDGE_*), incidents, lookup",
        reason="Bridge resumes from latest_train_state.pt (the rollback rewrites it) and keeps "
        "run_config.yaml, not Megatron's args, in each checkpoint (the lookup reads it).",
    ),
)


def _imports(module: str, names: tuple[str, ...]) -> Assumption:
    return _assume(
        name=f"imports:{module}",
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
    _imports(f"{_TRAINING}.utils.train_utils", ("needs_global_state_injection",)),
    _imports("megatron.bridge.utils.instantiate_utils", ("register_allowed_target_prefix",)),
)

ENTRIES = (*BUGFIXES, *PATCHES, *FEATURE_PATCHES, *CPU_RUNNER, *ASSUMPTIONS, *IMPORTS)


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
