"""Every touch of Megatron internals, in one table: what, where, why, verified on which version.

- **bugfix** patches fix upstream megatron-core bugs and apply whenever the entry point runs;
- **hook** patches are the four places where :mod:`megatron_ext.loop.install` calls the installed
  features' hooks (applied only when an installed feature uses the hook);
- **feature** patches change Megatron's behaviour for one feature's flag;
- **assumptions** are private names read without being replaced;
- the **entry point**'s runner per version, its batch helpers and every megatron name the
  training side imports (:mod:`megatron_ext.registry.entry`).

Wrappers live next to the feature or fix they belong to and are named here as the imported
functions (go to definition follows them); :func:`megatron_ext.loop.install.install` applies a
feature patch bound to its installed feature and a hook patch bound to the installed feature
set. Megatron's targets stay ``module:qualname`` strings, resolved only when verified or
applied, so that a target upstream moved is a readable start-up refusal (``megatron-ext
patches`` lists it as changed) instead of an ImportError while this table is imported.
:data:`ENTRY_POINT_HOOKS` lists the hooks the training script's side calls (no patch): the
functions of :mod:`megatron_ext.loop.hooks` that the overlay's GPT step and a script of the
user's own (:mod:`megatron_ext.fork`) both call.
``megatron-ext patches`` prints this table and verifies every entry; the entry point
verifies all of them at start-up and refuses to run if any target changed.
"""

from __future__ import annotations

from megatron_ext.common.features import Feature
from megatron_ext.common.versions import ALL, V17, V18, V19
from megatron_ext.loop import hooks
from megatron_ext.registry import copy_check as copies
from megatron_ext.registry import fixes
from megatron_ext.registry.assumptions import ASSUMPTIONS
from megatron_ext.registry.copies import COPIES
from megatron_ext.registry.entry import CLASSIC_INIT, ENTRY_POINT, IMPORTS
from megatron_ext.registry.fsdp import FSDP_PATCHES
from megatron_ext.registry.patching import Assumption, Entry, HookCall, Patch, Variant
from megatron_ext.spikes.adapter import SpikeFeature
from megatron_ext.spikes.rerun import nonfinite_goes_to_the_detector, reproducible_result_rolls_back
from megatron_ext.spikes.skip_list import SkipListFeature, save_after_a_skipped_end
from megatron_ext.weight_decay.adapter import WeightDecayFeature, with_overrides, with_param_map
from megatron_ext.zloss.adapter import ZLossFeature, with_fused_output_loss, with_z_loss

_TRAINING = "megatron.training.training"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_BUFFER = "megatron.core.distributed.param_and_grad_buffer"

BUGFIXES: tuple[Patch, ...] = (
    Patch(
        name="prebuilt-dataset-helpers",
        verified_on=ALL,
        kind="bugfix",
        target="megatron.core.datasets.utils:compile_helpers",
        signature="()",
        wrap=fixes.skip_make_when_prebuilt,
        reason="initialize_megatron runs `make` in the installed package, but the pip wheel "
        "ships a prebuilt helpers_cpp and no Makefile, so every wheel user's start-up exits(1). "
        "Skip the build when the prebuilt extension imports.",
    ),
    Patch(
        name="distopt-fresh-state-dict",
        verified_on=ALL,
        kind="bugfix",
        target=f"{_DISTOPT}.state_dict",
        signature="(self)",
        wrap=fixes.state_dict_tolerates_fresh_state,
        reason="Without Apex/TE, DistributedOptimizer.state_dict asserts exactly one distinct "
        "Adam step, but loading a checkpoint calls it on a fresh optimizer with no state yet, "
        "so every distributed-optimizer resume crashes. A fresh optimizer reports step 0; the "
        "checkpoint's real step is loaded right after.",
    ),
    Patch(
        name="distopt-unshared-adam-step",
        verified_on=ALL,
        kind="bugfix",
        target=f"{_DISTOPT}.load_state_dict",
        signature="(self, state_dict)",
        wrap=fixes.load_state_dict_unshares_step,
        reason="Without Apex/TE, DistributedOptimizer.load_state_dict assigns ONE step tensor "
        "to every parameter; torch Adam increments it in place once per parameter, so after a "
        "resume the bias correction runs N_params steps per iteration (silent drift). Each "
        "parameter gets its own copy.",
    ),
    Patch(
        name="distopt-state-copy",
        verified_on=ALL,
        kind="bugfix",
        target=f"{_DISTOPT}._set_main_param_and_optimizer_states",
        signature="(self, model_param, tensors)",
        wrap=fixes.copy_state_safely,
        reason="Two resume bugs without Apex/TE. (1) load_parameter_state_from_dp_reshardable "
        "copies checkpoint values into views of leaf parameters that require grad outside "
        "no_grad, so fp32 resumes raise; the copy runs under torch.no_grad(). (2) The per-param "
        "Adam `step` in the loaded param state is the non-persistent load template (0), and "
        "copying it resets the step restored from param_groups to 0 (bias correction restarts "
        "silently); `step` is left to param_groups, as the save path intends.",
    ),
    Patch(
        name="ckpt-results-queue-survives-sigterm",
        verified_on=ALL,
        kind="bugfix",
        target="megatron.core.dist_checkpointing.strategies.filesystem_async:"
        "FileSystemWriterAsync.prepare_write_data",
        signature="(self, plan: torch.distributed.checkpoint.planner.SavePlan, "
        "planner: torch.distributed.checkpoint.planner.SavePlanner) -> None",
        wrap=fixes.results_queue_survives_stop_signals,
        reason="torch_dist saves hand their write results through a multiprocessing Manager "
        "queue started at the first save, in the rank's process group. Slurm signals every "
        "process of a step and torchrun forwards SIGTERM with killpg, so a preemption or "
        "scancel SIGTERM kills that Manager and the --exit-signal-handler save fails with "
        "BrokenPipeError. The queue is created first, by a Manager that ignores SIGTERM/SIGINT.",
    ),
    Patch(
        name="help-percent-in-docstrings",
        verified_on=ALL,
        kind="bugfix",
        target="megatron.training.argument_utils:"
        "ArgumentGroupFactory._build_argparse_kwargs_from_field",
        signature="(self, attribute: dataclasses.Field) -> dict[str, typing.Any]",
        wrap=fixes.docstring_help_is_text,
        reason="ArgumentGroupFactory turns config dataclass field docstrings into argparse "
        "help, and argparse expands help as a %-format. TransformerConfig's docstring for "
        "moe_paged_stash_buffer_size_factor_cuda ends in a bare '10%)', so `--help` of every "
        "script on Megatron's parser dies with ValueError: unsupported format character. "
        "Docstring help gets its '%' doubled; help written in field metadata is left alone.",
    ),
)

HOOKS: tuple[Patch, ...] = (  # applied bound to the installed FeatureSet
    Patch(
        name="hook-on-setup",
        verified_on=V19,
        kind="hook",
        hook=Feature.on_setup,
        target=f"{_TRAINING}:setup_model_and_optimizer",
        signature="(model_type, model_provider_func=None, checkpointing_context=None, *, "
        "cfg_container: megatron.training.config.container.PretrainConfigContainer | None = "
        "None, pg_collection: megatron.core.process_groups_config.ProcessGroupCollection | "
        "megatron.core.process_groups_config.MultiModuleProcessGroupCollection | None = None)",
        wrap=hooks.wrap_setup,
        reason="The DDP model chunks and the optimizer exist here and nowhere else in the "
        "public loop: features lay out bucket views and open their logs.",
        variants=(
            Variant(
                V17 + V18,
                "Classic signature (the model provider first, no config container); the "
                "wrapper passes every argument through.",
                signature="(model_provider_func, model_type, checkpointing_context=None)",
            ),
        ),
    ),
    Patch(
        name="hook-before-grad-norm",
        verified_on=ALL,
        kind="hook",
        hook=Feature.before_grad_norm,
        target="megatron.core.optimizer.optimizer:ChainedOptimizer.get_grad_norm",
        signature="(self)",
        wrap=hooks.wrap_get_grad_norm,
        reason="The one point where gradients are reduced but not yet clipped: bucket norms "
        "and the update-ratio snapshot are taken here (one all-reduce, no host sync).",
    ),
    Patch(
        name="hook-after-step",
        verified_on=(*V18, *V19),
        kind="hook",
        hook=Feature.after_step,
        target=f"{_TRAINING}:training_log",
        signature="(loss_dict, total_loss_dict, learning_rate: float | None, iteration, "
        "loss_scale, report_memory_flag, skipped_iter, grad_norm, params_norm, "
        "num_zeros_in_grad, max_attention_logit, pg_collection=None, is_first_iteration=False, "
        "seqlen_squared_sum_in_batch: float | None = None, "
        "total_real_tokens_in_batch: float | None = None)",
        wrap=hooks.wrap_training_log,
        reason="Called on every rank every iteration with Megatron's reduced losses, lr, loss "
        "scale, grad norm, params norm and zeros: the StepRecord the features share.",
        variants=(
            Variant(
                V17,
                "No seqlen_squared_sum_in_batch / total_real_tokens_in_batch; the wrapper binds "
                "the parameters it reads by name, all present.",
                signature="(loss_dict, total_loss_dict, learning_rate: float | None, iteration, "
                "loss_scale, report_memory_flag, skipped_iter, grad_norm, params_norm, "
                "num_zeros_in_grad, max_attention_logit, pg_collection=None, "
                "is_first_iteration=False)",
            ),
        ),
    ),
    Patch(
        name="hook-on-checkpoint",
        verified_on=ALL,
        kind="hook",
        hook=Feature.on_checkpoint,
        target=f"{_TRAINING}:save_checkpoint_and_time",
        signature="(iteration, model, optimizer, opt_param_scheduler, "
        "num_floating_point_operations_so_far, checkpointing_context, "
        "non_persistent_ckpt=False, train_data_iterator=None)",
        wrap=hooks.wrap_save_checkpoint,
        reason="Every checkpoint save goes through here: a feature may veto one (the spike "
        "detector keeps the last healthy checkpoint the rollback target).",
    ),
)

FEATURE_PATCHES: tuple[Patch, ...] = (  # applied bound to their installed feature
    Patch(
        name="skip-list-final-checkpoint",
        verified_on=V19,
        target=f"{_TRAINING}:train",
        signature="(forward_step_func, model, optimizer, opt_param_scheduler, "
        "train_data_iterator, valid_data_iterator, process_non_loss_data_func, config, "
        "checkpointing_context, non_loss_data_func, inference_model=None, p2p_communicator: "
        "Optional[megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator] = None, "
        "pg_collection: Union[megatron.core.process_groups_config.ProcessGroupCollection, "
        "megatron.core.process_groups_config.MultiModuleProcessGroupCollection, NoneType] = "
        "None)",
        wrap=save_after_a_skipped_end,
        feature=SkipListFeature,
        reason="A skipped iteration `continue`s past train()'s interval save, and pretrain's "
        "final save runs only when the last iteration is not a --save-interval multiple, so "
        "a skip list covering the last iteration left no final checkpoint (--train-iters 60, "
        "--save-interval 30, skip 60: rc 0, last checkpoint 30). When train() returns at a "
        "skipped interval multiple, the final checkpoint is saved as Megatron would have.",
        variants=(
            Variant(
                V17 + V18,
                "No p2p_communicator / pg_collection; the wrapper binds the parameters it reads "
                "by name, all present.",
                signature="(forward_step_func, model, optimizer, opt_param_scheduler, "
                "train_data_iterator, valid_data_iterator, process_non_loss_data_func, config, "
                "checkpointing_context, non_loss_data_func, inference_model=None)",
            ),
        ),
    ),
    Patch(
        name="spike-rerun-verdict",
        verified_on=ALL,
        target="megatron.core.rerun_state_machine:RerunStateMachine.should_checkpoint_and_exit",
        signature="(self) -> Tuple[bool, bool, int]",
        wrap=reproducible_result_rolls_back,
        feature=SpikeFeature,
        reason="Under --rerun-mode validate_results a NaN/Inf that its in-place rerun "
        "reproduces is saved and exits 16 to rerun on another GPU; resumed on the same one it "
        "exits 16 forever (Megatron-LM #5281). With --spike-detect that verdict "
        "(WILL_RERUN_FROM_CHECKPOINT, the same on every rank) becomes a rollback request: a "
        "divergence in the ledger and the spike exit code, no checkpoint. A transient "
        "(not reproduced) result still ends with Megatron's 17.",
    ),
    Patch(
        name="spike-rerun-disabled",
        verified_on=ALL,
        target="megatron.core.rerun_state_machine:RerunStateMachine.validate_result",
        signature="(self, result: Any, rejection_func: Callable[[Any], bool], message: str, "
        "comparison_func: Optional[Callable[[Any, Any], float]] = None, tolerance: float = 0.0, "
        "fatal: bool = True) -> None",
        wrap=nonfinite_goes_to_the_detector,
        feature=SpikeFeature,
        reason="Under --rerun-mode disabled a NaN/Inf loss or grad norm raises on the rank "
        "that saw it, so the detector never sees the divergence. With --spike-detect the "
        "isnan/isinf checks let it through: the reduced loss is non-finite on every rank and "
        "the detector rolls back after the step (no checkpoint of it is saved).",
    ),
    Patch(
        name="zloss-output-layer",
        verified_on=ALL,
        target="megatron.core.models.common.language_module.language_module:"
        "LanguageModule.compute_language_model_loss",
        signature="(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor",
        wrap=with_z_loss,
        feature=ZLossFeature,
        reason="--z-loss-coeff: megatron-core has no output-layer z-loss. The language-model "
        "loss (main head and MTP heads) becomes CE + c·log²Z, computed in one pass over the "
        "vocab-parallel logits with the cross entropy's own all-reduces.",
    ),
    Patch(
        name="fused-output-loss",
        verified_on=(*V18, *V19),
        target="megatron.core.models.gpt.gpt_model:GPTModel._postprocess",
        signature="(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, "
        "rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, "
        "decoder_input=None, attention_mask=None, padding_mask=None, inference_params=None, "
        "packed_seq_params=None, sequence_len_offset=None, runtime_gather_output=None, "
        "extra_block_kwargs=None, inference_context=None, output_processor=None, "
        "output_processor_context=None)",
        wrap=with_fused_output_loss,
        feature=ZLossFeature,
        reason="--fused-output-loss: the main head's logits are computed before any loss "
        "method runs, so the loss method is too late to avoid them. _postprocess's own "
        "output_processor hook (handed hidden states, output layer and weight, labels, loss "
        "mask) is filled with the chunked output layer + CE + z-loss when labels are given "
        "outside inference; MTP heads, inference and label-less calls stay Megatron's.",
        variants=(
            Variant(
                V17,
                "GPTModel._postprocess has no output_processor hook before megatron-core 0.18, "
                "so the logits cannot be skipped without replacing Megatron's whole "
                "postprocess; --fused-output-loss is refused (plain --z-loss-coeff works).",
                available=False,
            ),
        ),
    ),
    Patch(
        name="weight-decay-overrides",
        verified_on=ALL,
        target=f"{_TRAINING}:get_megatron_optimizer_config",
        signature="(args: Any) -> megatron.core.optimizer.optimizer_config.OptimizerConfig",
        wrap=with_overrides,
        feature=WeightDecayFeature,
        reason="--embedding-weight-decay-mult / --output-layer-weight-decay-mult / "
        "--weight-decay-override: add wd_mult ParamGroupOverrides to the config_overrides "
        "Megatron builds here (its 1-D/bias defaults kept).",
    ),
    Patch(
        name="weight-decay-map",
        verified_on=ALL,
        target=f"{_TRAINING}:get_megatron_optimizer",
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
        reason="With a weight-decay flag set: print every parameter's wd_mult and the rule "
        "that decided it once the param groups exist, and fail on a GLOB matching nothing.",
    ),
    *FSDP_PATCHES,
)


_READERS = "TP rank 0 of a data-reading stage"
ENTRY_POINT_HOOKS: tuple[HookCall, ...] = (
    HookCall(Feature.on_model_built, hooks.pre_wrap_hook, "the config container's pre_wrap_hooks"),
    HookCall(
        Feature.on_model_built,
        hooks.chunk_built,
        "0.17/0.18: megatron_ext.loop.gpt_model.model_provider; a script's own model provider",
    ),
    HookCall(Feature.on_train_dataset, hooks.datasets, _READERS),
    HookCall(Feature.on_batch, hooks.read_batch, _READERS),
    HookCall(Feature.on_loss, hooks.loss_report, "last pipeline stage"),
)

PATCHES: tuple[Patch, ...] = (*BUGFIXES, *HOOKS, *FEATURE_PATCHES, CLASSIC_INIT)
ENTRIES: tuple[Entry, ...] = (*PATCHES, *ASSUMPTIONS, *ENTRY_POINT, *IMPORTS)


def patch(name: str) -> Patch:
    """The registered patch called ``name``."""
    for entry in PATCHES:
        if entry.name == name:
            return entry
    raise KeyError(f"no megatron-ext patch named {name!r}")


def assumption(name: str) -> Assumption:
    """The registered assumption called ``name``."""
    for entry in (*ASSUMPTIONS, *ENTRY_POINT, *IMPORTS):
        if entry.name == name:
            return entry
    raise KeyError(f"no megatron-ext assumption named {name!r}")


def verify_all() -> None:
    """Verify every entry training relies on (start-up, before any patch is applied): a copy
    only the tools use (scope "tools") is theirs to check, and never blocks training."""
    for entry in ENTRIES:
        entry.verify()
    copies.verify(COPIES, scope="training")


def verify_tools() -> None:
    """Verify the copies the offline tools rely on (the lookup, when it runs)."""
    copies.verify(COPIES)


def applied() -> list[Patch]:
    """Patches installed in this process."""
    return [p for p in PATCHES if p.is_applied()]
