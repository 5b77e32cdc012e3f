"""Every touch of Megatron internals, one entry each: what, where, why, verified on which version.

Patches (:class:`~megatron_ext.registry.patching.Patch`): upstream bug fixes (always applied),
the loop hooks (applied bound to the installed FeatureSet when a feature uses the hook), the
feature patches (bound to their feature), the classic entry point's and the CPU runner's.
Assumptions: private names read, the entry point's forms per version and every megatron name
the training side imports. Copies: Megatron logic the tools re-implement
(:mod:`megatron_ext.registry.copies`). The entry point verifies every entry at start-up and
refuses to run if a target changed; ``megatron-ext patches`` prints and verifies the table.
"""

from __future__ import annotations

from megatron_ext.common.features import Feature
from megatron_ext.common.versions import ALL, V17, V18, V19
from megatron_ext.fsdp.adapter import (
    TorchFsdpFeature,
    optimizer_ids_of_shards,
    params_norm_over_shards,
    restores_adam_step,
)
from megatron_ext.registry import copies, fixes, hooks
from megatron_ext.registry.copies import COPIES
from megatron_ext.registry.patching import Assumption, Entry, HookCall, Patch, Variant
from megatron_ext.spikes.adapter import (
    SkipListFeature,
    SpikeFeature,
    nonfinite_goes_to_the_detector,
    reproducible_result_rolls_back,
    save_after_a_skipped_end,
)
from megatron_ext.telemetry.validation import (
    ValidationFeature,
    evaluating_by_dataset,
    summed_by_dataset,
)
from megatron_ext.weight_decay.adapter import WeightDecayFeature, with_overrides, with_param_map
from megatron_ext.zloss.adapter import ZLossFeature, with_fused_output_loss, with_z_loss

_TRAINING = "megatron.training.training"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_PG = "megatron.core.process_groups_config"
_OPT_PG = "Optional[torch.distributed.distributed_c10d.ProcessGroup] = None"
_LOAD_0_18 = (
    "(ddp_model, optimizer, opt_param_scheduler, load_arg='load', strict=True, "
    f"checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group: {_OPT_PG}, "
    f"pp_group: {_OPT_PG}, dp_cp_group: {_OPT_PG}"
)
_EVALUATE_0_17 = (
    "(forward_step_func, data_iterator, model, process_non_loss_data_func, config, "
    "verbose=False, non_loss_data_func=None, eval_iters=None"
)
_EVAL_PRINT_0_17 = (
    "(prefix, forward_step_func, data_iterator, model, iteration, process_non_loss_data_func, "
    "config, verbose=False, write_to_tensorboard=True, non_loss_data_func=None"
)
_GET_MODEL = (
    "(model_provider_func, model_type=<ModelType.encoder_or_decoder: 1>, wrap_with_ddp=True, "
    "config=None, pg_collection=None)"
)

BUGFIXES: tuple[Patch, ...] = (
    Patch(
        name="prebuilt-dataset-helpers",
        verified_on=ALL,
        kind="bugfix",
        target="megatron.core.datasets.utils:compile_helpers",
        signature="()",
        wrap=fixes.skip_make_when_prebuilt,
        reason="initialize_megatron runs `make` in the wheel, which has no Makefile (exit 1): "
        "the build is skipped when the prebuilt helpers_cpp imports.",
    ),
    Patch(
        name="distopt-fresh-state-dict",
        verified_on=ALL,
        kind="bugfix",
        target=f"{_DISTOPT}.state_dict",
        signature="(self)",
        wrap=fixes.state_dict_tolerates_fresh_state,
        reason="Without Apex/TE, a resume calls state_dict on a fresh optimizer, which asserts: "
        "a fresh optimizer reports step 0 (the checkpoint's step is loaded right after).",
    ),
    Patch(
        name="distopt-unshared-adam-step",
        verified_on=ALL,
        kind="bugfix",
        target=f"{_DISTOPT}.load_state_dict",
        signature="(self, state_dict)",
        wrap=fixes.load_state_dict_unshares_step,
        reason="Without Apex/TE, every parameter gets ONE step tensor, incremented once per "
        "parameter (silent drift after a resume): each parameter gets its own copy.",
    ),
    Patch(
        name="distopt-state-copy",
        verified_on=ALL,
        kind="bugfix",
        target=f"{_DISTOPT}._set_main_param_and_optimizer_states",
        signature="(self, model_param, tensors)",
        wrap=fixes.copy_state_safely,
        reason="Without Apex/TE, a resume copies into leaf-parameter views outside no_grad "
        "(raises) and resets Adam's step to 0: no_grad, and `step` left to param_groups.",
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
        reason="A preemption SIGTERM kills the Manager of torch_dist's results queue, so the "
        "--exit-signal-handler save fails: the queue's Manager ignores SIGTERM/SIGINT.",
    ),
    Patch(
        name="help-percent-in-docstrings",
        verified_on=ALL,
        kind="bugfix",
        target="megatron.training.argument_utils:"
        "ArgumentGroupFactory._build_argparse_kwargs_from_field",
        signature="(self, attribute: dataclasses.Field) -> dict[str, typing.Any]",
        wrap=fixes.docstring_help_is_text,
        reason="A bare '%' in a field docstring used as argparse help kills every `--help` "
        "(ValueError): docstring help gets its '%' doubled, metadata help is left alone.",
    ),
)

HOOKS: tuple[Patch, ...] = (
    Patch(
        name="hook-on-setup",
        verified_on=V19,
        kind="hook",
        hook=Feature.on_setup,
        target=f"{_TRAINING}:setup_model_and_optimizer",
        signature="(model_type, model_provider_func=None, checkpointing_context=None, *, "
        "cfg_container: megatron.training.config.container.PretrainConfigContainer | None = "
        f"None, pg_collection: {_PG}.ProcessGroupCollection | "
        f"{_PG}.MultiModuleProcessGroupCollection | None = None)",
        wrap=hooks.wrap_setup,
        reason="The DDP model chunks and the optimizer exist here and nowhere else in the "
        "public loop: features lay out bucket views and open their logs.",
        variants=(
            Variant(
                V17 + V18,
                "Classic signature (model provider first, no config container); the wrapper "
                "passes every argument through.",
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
        reason="Where gradients are reduced but not yet clipped: bucket norms and the "
        "update-ratio snapshot (one all-reduce, no host sync).",
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
        reason="Every rank, every iteration, with Megatron's reduced losses, lr, loss scale and "
        "norms: the StepRecord the features share.",
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

FEATURE_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="skip-list-final-checkpoint",
        verified_on=V19,
        target=f"{_TRAINING}:train",
        signature="(forward_step_func, model, optimizer, opt_param_scheduler, "
        "train_data_iterator, valid_data_iterator, process_non_loss_data_func, config, "
        "checkpointing_context, non_loss_data_func, inference_model=None, p2p_communicator: "
        "Optional[megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator] = None, "
        f"pg_collection: Union[{_PG}.ProcessGroupCollection, "
        f"{_PG}.MultiModuleProcessGroupCollection, NoneType] = None)",
        wrap=save_after_a_skipped_end,
        feature=SkipListFeature,
        reason="A skipped last iteration at a --save-interval multiple skipped both the interval "
        "and the final save: the final checkpoint is saved as Megatron would have.",
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
        reason="Under --rerun-mode validate_results a reproduced NaN/Inf exits 16 forever on "
        "the same GPU (Megatron-LM #5281). With --spike-detect it becomes a rollback (the "
        "spike exit code, no checkpoint); a transient result still exits 17.",
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
        reason="Under --rerun-mode disabled a NaN/Inf raises on the rank that saw it. With "
        "--spike-detect it reaches the detector, which rolls back after the step.",
    ),
    Patch(
        name="zloss-output-layer",
        verified_on=ALL,
        target="megatron.core.models.common.language_module.language_module:"
        "LanguageModule.compute_language_model_loss",
        signature="(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor",
        wrap=with_z_loss,
        feature=ZLossFeature,
        reason="--z-loss-coeff (megatron-core has no output-layer z-loss): the LM loss (main and "
        "MTP heads) becomes CE + c·log²Z, in one pass with the cross entropy's all-reduces "
        "(Megatron's fused pieces under --cross-entropy-loss-fusion, native).",
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
        reason="--fused-output-loss: _postprocess's output_processor hook runs the chunked "
        "output layer + CE + z-loss (labels, no inference); the main head's logits never exist.",
        variants=(
            Variant(
                V17,
                "No output_processor hook before 0.18: --fused-output-loss is refused (plain "
                "--z-loss-coeff works).",
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
        reason="The weight-decay flags add wd_mult ParamGroupOverrides to the config_overrides "
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
        reason="With a weight-decay flag: print every parameter's wd_mult and deciding rule "
        "once the param groups exist; fail on a GLOB matching nothing.",
    ),
    # Upstream bugs under --use-torch-fsdp2, on every verified version (layout row fsdp2-dp2).
    Patch(
        name="fsdp2-global-params-norm",
        verified_on=ALL,
        target=f"{_TRAINING}:calc_params_l2_norm",
        signature="(model, force_create_fp32_copy=False)",
        wrap=params_norm_over_shards,
        feature=TorchFsdpFeature,
        reason="Under FSDP2 the params norm is the local DTensor shard's, which the spike "
        "detector reads. The squares are summed over the data-parallel shards.",
    ),
    Patch(
        name="fsdp2-checkpoint-param-ids",
        verified_on=ALL,
        target="megatron.core.dist_checkpointing.optimizer:get_optim_param_to_id_map",
        signature="(optim_params_iter: Iterable[torch.nn.parameter.Parameter]) -> Dict[int, int]",
        wrap=optimizer_ids_of_shards,
        feature=TorchFsdpFeature,
        reason="to_local() of a Parameter(DTensor) is a fresh view (pytorch#166156): every FSDP2 "
        "save raised 'Param id 0 does not match'; each DTensor is keyed by its local tensor too.",
    ),
    Patch(
        name="fsdp2-resume-adam-step",
        verified_on=V19,
        target=f"{_TRAINING}:load_checkpoint",
        signature=f"{_LOAD_0_18}, dp_group: {_OPT_PG}, expt_dp_group: {_OPT_PG}, "
        "rng_state_key_prefix: str = '')",
        wrap=restores_adam_step,
        feature=TorchFsdpFeature,
        reason="Under FSDP2 a resume skips optimizer.load_state_dict, which alone restores "
        "Adam's step (torch Adam: KeyError 'step'). The checkpoint's step is given back.",
        variants=(
            Variant(
                V17 + V18,
                "No dp_group/expt_dp_group/rng_state_key_prefix parameters; the same skip.",
                signature=f"{_LOAD_0_18})",
            ),
        ),
    ),
    Patch(
        name="validation-by-dataset",
        verified_on=V19,
        target=f"{_TRAINING}:evaluate_and_print_results",
        signature=f"{_EVAL_PRINT_0_17}, pg_collection=None, p2p_communicator=None)",
        wrap=evaluating_by_dataset,
        feature=ValidationFeature,
        reason="Per-dataset validation: which split (its prefix ends 'on test set' for the "
        "test data) and iteration an evaluation is; the members' losses are reported after "
        "Megatron printed its own.",
        variants=(
            Variant(
                V17 + V18,
                "No pg_collection / p2p_communicator; the wrapper binds prefix, iteration and "
                "write_to_tensorboard by name, all present.",
                signature=f"{_EVAL_PRINT_0_17})",
            ),
        ),
    ),
    Patch(
        name="validation-set-by-dataset",
        verified_on=V19,
        target=f"{_TRAINING}:evaluate",
        signature=f"{_EVALUATE_0_17}, pg_collection=None, p2p_communicator=None)",
        wrap=summed_by_dataset,
        feature=ValidationFeature,
        reason="Per-dataset validation: evaluate runs one validation set (called once per set "
        "under --multiple-validation-sets) and returns (loss dict, data, timelimit); the "
        "members' sums start with it and are reduced when it returns.",
        variants=(
            Variant(
                V17 + V18,
                "No pg_collection / p2p_communicator; the same return value.",
                signature=f"{_EVALUATE_0_17})",
            ),
        ),
    ),
)

_INIT_0_18 = (
    "(allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None, "
    "get_position_embedding_ranks=None, store=None"
)
_INIT_0_17 = (
    "(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, "
    "allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None, "
    "get_position_embedding_ranks=None, parsed_args=None, store=None)"
)
CLASSIC_INIT = Patch(
    name="classic-pretrain-parsed-args",
    verified_on=V17,
    kind="entry",
    target=f"{_TRAINING}:initialize_megatron",
    signature=_INIT_0_17,
    wrap=fixes.with_parsed_args,
    reason="Classic pretrain (0.17) parses sys.argv again, so the features kept args Megatron "
    "never filled (consumed_samples = 0). The entry point's parsed args go in as parsed_args.",
    variants=(
        Variant(
            V18 + V19,
            "Not needed: pretrain takes the config container built from the args parsed once.",
            available=False,
        ),
    ),
)

CPU_RUNNER: tuple[Patch, ...] = (
    Patch(
        name="cpu-initialize-without-cuda",
        verified_on=V19,
        kind="cpu",
        target="megatron.training.initialize:initialize_megatron",
        also_bound_in=(_TRAINING,),
        signature=f"{_INIT_0_18}, skip_model_parallel_init=False, seed_pp_group=None, "
        "seed_dp_group=None, seed_tp_group=None, seed_ep_group=None, seed_etp_group=None, "
        "skip_random_seed=False)",
        wrap=fixes.allows_no_cuda,
        reason="Applied by the CPU runner alone: initialize_megatron asserts CUDA unless "
        "allow_no_cuda, which pretrain never passes; it is passed (counted).",
        variants=(
            Variant(
                V18, "No model-parallel-init or seed-group parameters.", signature=f"{_INIT_0_18})"
            ),
            Variant(V17, "Classic parameters (the arguments, parsed_args).", signature=_INIT_0_17),
        ),
    ),
)

ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption(
        name="ddp-bucket-groups",
        verified_on=ALL,
        target="megatron.core.distributed.distributed_data_parallel:DistributedDataParallel",
        assigned=("bucket_groups", "expert_parallel_bucket_groups"),
        used_by="megatron_ext.telemetry.bucket_layout",
        reason="Bucket grad norms walk each DDP chunk's dense and expert bucket groups.",
    ),
    Assumption(
        name="ddp-bucket-group-layout",
        verified_on=ALL,
        target=f"{_BUFFER}:_ParamAndGradBucketGroup",
        assigned=(
            "buckets",
            "ddp_config",
            "intra_distributed_optimizer_instance_size",
            "intra_distributed_optimizer_instance_rank",
        ),
        used_by="megatron_ext.telemetry.bucket_layout",
        reason="Whether a bucket group's grads are sharded, and which shard this rank owns.",
    ),
    Assumption(
        name="ddp-bucket-layout",
        verified_on=ALL,
        target=f"{_BUFFER}:_ParamAndGradBucket",
        assigned=("grad_data", "params_list", "param_to_index"),
        used_by="megatron_ext.telemetry.bucket_layout",
        reason="Bucket norms read each param's [start, end) of the contiguous grad_data (views).",
    ),
    Assumption(
        name="transformer-layer-number",
        verified_on=ALL,
        target="megatron.core.transformer.transformer_layer:TransformerLayer",
        assigned=("layer_number",),
        used_by="megatron_ext.telemetry.adapter",
        reason="Bucket names use the global layer_number (with the stage's and chunk's offset).",
    ),
    Assumption(
        name="chained-optimizer-parts",
        verified_on=ALL,
        target="megatron.core.optimizer.optimizer:ChainedOptimizer",
        assigned=("chained_optimizers",),
        used_by="megatron_ext.telemetry.adapter",
        reason="Dense and expert parameters live in different chained optimizers, each reduced "
        "over its own grad-stats group; bucket norms and the update ratio reduce the same way.",
    ),
    Assumption(
        name="optimizer-grad-norm-skip-threshold",
        verified_on=V18 + V19,
        target="megatron.core.optimizer.optimizer:ChainedOptimizer.step",
        assigned=("get_grad_norm", "grad_norm_skip_threshold", "step_with_ready_grads"),
        used_by="megatron_ext.spikes.update_skip",
        reason="step withholds the update when the norm exceeds config.grad_norm_skip_threshold, "
        "read after the norm: --spike-skip-update sets it before each norm (no patch, no sync).",
        variants=(
            Variant(
                V17,
                "No grad_norm_skip_threshold: --spike-skip-update is refused at start-up.",
                available=False,
            ),
        ),
    ),
    Assumption(
        name="local-attention-softmax",
        verified_on=ALL,
        target="megatron.core.transformer.dot_product_attention:DotProductAttention",
        assigned=("scale_mask_softmax",),
        used_by="megatron_ext.telemetry.attention_logit",
        reason="The local attention's scores are scale_mask_softmax's first argument: "
        "--signals-attention-logit reads their max with a forward pre-hook.",
    ),
    Assumption(
        name="local-attention-softmax-mask",
        verified_on=ALL,
        target="megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax",
        assigned=("attn_mask_type", "scale", "window_size"),
        used_by="megatron_ext.telemetry.attention_logit",
        reason="The softmax scales the scores and masks the future itself: the logit max too.",
    ),
    Assumption(
        name="optimizer-tp-groups",
        verified_on=V19,
        target="megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups",
        assigned=("tp_group", "expert_tp_group"),
        used_by="megatron_ext.telemetry.adapter",
        reason="Megatron sets each chained optimizer's TP groups after building it; telemetry "
        "counts each parameter with them as the grad norm does.",
        variants=(
            Variant(
                V17 + V18,
                "Only tp_group (no expert_tp_group), which filters expert parameters too; "
                "telemetry passes expert_tp_group only where the optimizer has one.",
                assigned=("tp_group",),
            ),
        ),
    ),
    Assumption(
        name="expert-param-mark",
        verified_on=V19,
        target="megatron.core.tensor_parallel.layers:param_is_not_tensor_parallel_duplicate",
        signature="(param, tp_group=None, expert_tp_group=None)",
        used_by="megatron_ext.telemetry.adapter",
        reason="Expert-parallel parameters are marked allreduce=False (read by this filter): "
        "telemetry sorts dense from expert by it and counts them with this filter.",
        variants=(
            Variant(
                V17 + V18,
                "No expert_tp_group parameter; the allreduce=False mark still sorts them.",
                signature="(param, tp_group=None)",
            ),
        ),
    ),
    Assumption(
        name="language-module-tp-group",
        verified_on=ALL,
        target="megatron.core.models.common.language_module.language_module:LanguageModule",
        assigned=("tp_group",),
        used_by="megatron_ext.zloss.adapter",
        reason="The z-loss reduces over the output layer's TP group, as Megatron's loss does.",
    ),
    Assumption(
        name="fused-cross-entropy-pieces",
        verified_on=ALL,
        target="megatron.core.fusions.fused_cross_entropy",
        names=(
            "calculate_logits_max",
            "calculate_predicted_logits",
            "calculate_cross_entropy_loss",
            "calculate_gradients",
        ),
        used_by="megatron_ext.zloss.adapter",
        reason="Under --cross-entropy-loss-fusion (native) the z-loss is Megatron's fused cross "
        "entropy rebuilt from these pieces, with log Z and the z gradient folded in.",
    ),
    Assumption(
        name="output-layer-modes",
        verified_on=ALL,
        target="megatron.core.tensor_parallel.layers:ColumnParallelLinear",
        assigned=("sequence_parallel", "gradient_accumulation_fusion", "tp_group", "weight"),
        used_by="megatron_ext.zloss.adapter",
        reason="The fused output loss delivers gradients as the output layer would, by its "
        "weight, TP group and sequence-parallel / gradient-accumulation-fusion modes.",
    ),
    Assumption(
        name="schedule-loss-scaling",
        verified_on=ALL,
        target="megatron.core.pipeline_parallel.schedules:forward_step_calc_loss",
        signature="(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data, "
        "num_microbatches, forward_data_store, cp_group_size=None, is_last_stage=None)",
        used_by="megatron_ext.zloss.adapter",
        reason="--fused-output-loss adds the weight gradient in the forward, scaled as the "
        "schedule scales the loss; the fused backward checks every step that it matches.",
    ),
    Assumption(
        name="ddp-grad-added-mark",
        verified_on=ALL,
        target="megatron.core.distributed.distributed_data_parallel:DistributedDataParallel",
        assigned=("grad_added_to_main_grad",),
        used_by="megatron_ext.zloss.adapter",
        reason="The fused output loss writes main_grad as Megatron's fused linear does: it sets "
        "grad_added_to_main_grad, which DDP resets and its hook reads.",
    ),
    Assumption(
        name="ckpt-results-queue",
        verified_on=ALL,
        target="megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
        used_by="megatron_ext.registry.fixes (the SIGTERM fix; the CPU runner, by fork)",
        reason="The queue is created before upstream's first use, which then reuses it.",
    ),
    Assumption(
        name="distopt-apex-or-te-flag",
        verified_on=ALL,
        target="megatron.core.optimizer.distrib_optimizer:HAVE_APEX_OR_TE",
        used_by="megatron_ext.registry.fixes",
        reason="The distributed-optimizer fixes apply only on the torch.optim fallback.",
    ),
    Assumption(
        name="load-base-checkpoint",
        verified_on=V19,
        target="megatron.training.checkpointing:_load_base_checkpoint",
        signature="(load_dir, args, rank0=False, sharded_state_dict=None, "
        "checkpointing_context=None, dp_cp_group=None, expt_dp_group=None, "
        "gpt_compat_layer_maps=None)",
        used_by="megatron_ext.weight_decay.adapter",
        reason="The weight-decay resume check reads the checkpoint's saved args before anything "
        "is built, as --use-checkpoint-args does.",
        variants=(
            Variant(
                V17 + V18,
                "Fewer parameters; the check calls it with (load_dir, args, rank0=True).",
                signature="(load_dir, args, rank0=False, sharded_state_dict=None, "
                "checkpointing_context=None)",
            ),
        ),
    ),
    Assumption(
        name="argument-factory-docstrings",
        verified_on=ALL,
        target="megatron.training.argument_utils:ArgumentGroupFactory",
        assigned=("field_docstrings",),
        used_by="megatron_ext.registry.fixes",
        reason="The --help fix tells docstring help from metadata help by this dict.",
    ),
    Assumption(
        name="checkpoint-common-state",
        verified_on=V19,
        target="megatron.core.dist_checkpointing.serialization:load_common_state_dict",
        signature="(checkpoint_dir: Union[str, pathlib.Path]) -> Dict[str, Any]",
        used_by="megatron_ext.common.checkpoint_state",
        reason="Read without importing megatron-core as it reads it: common.pt, else the "
        "'common_state/shard_0_1' bytes in the DCP files; any other layout goes to it.",
        variants=(
            Variant(
                V17 + V18,
                "The common state is in common.pt, written by save_common (the legacy branch).",
                target="megatron.core.dist_checkpointing.strategies.common:save_common",
                signature="(common_state_dict: Dict[str, Any], checkpoint_dir: str)",
            ),
        ),
    ),
    Assumption(
        name="blended-dataset-id",
        verified_on=ALL,
        target="megatron.core.datasets.blended_dataset:BlendedDataset",
        assigned=("datasets", "dataset_index"),
        used_by="megatron_ext.telemetry.adapter",
        reason="A blend's samples carry dataset_id = dataset_index[idx], the member's position: "
        "the per-source signals read it (a blend batch without it stops the run).",
    ),
    Assumption(
        name="idx-trailing-bytes",
        verified_on=ALL,
        target="megatron.core.datasets.indexed_dataset:_IndexReader",
        assigned=("sequence_lengths", "sequence_pointers", "document_indices"),
        used_by="megatron_ext.common.records.pair",
        reason="The .idx reader takes each array by the header's counts, so the fingerprint "
        "preprocess appends is never read.",
    ),
    Assumption(
        name="fsdp2-units",
        verified_on=ALL,
        target="megatron.core.distributed.torch_fully_sharded_data_parallel:"
        "TorchFullyShardedDataParallel",
        assigned=("fully_shard", "device_mesh"),
        used_by="megatron_ext.telemetry.sharded",
        reason="FSDP2 shards each TransformerLayer, the embedding and the root: one bucket norm "
        "per unit, over its local gradient shards.",
    ),
    Assumption(
        name="float16-main-params",
        verified_on=ALL,
        target="megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params",
        assigned=("float16_groups", "fp32_from_float16_groups"),
        used_by="megatron_ext.telemetry.sharded",
        reason="Under --bf16 the fp32 main parameters get the gradients (the model's are "
        "freed): FSDP2 bucket norms read them.",
    ),
    Assumption(
        name="distopt-main-param",
        verified_on=ALL,
        target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
        assigned=("main_param", "main_param_sharded"),
        used_by="megatron_ext.telemetry.adapter",
        reason="Under --bf16 the distributed optimizer hangs each model parameter's fp32 main "
        "shard on it (Megatron's params norm reads it): per-layer weight and update norms too.",
    ),
    Assumption(
        name="scheduler-sets-lr-each-step",
        verified_on=ALL,
        target="megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.step",
        assigned=("param_groups", "lr", "get_lr"),
        used_by="megatron_ext.recovery.adapter",
        reason="The scheduler sets every param group's lr after each update, so the recovery "
        "window's lr factor, set before the step's norm, lasts exactly one update.",
    ),
    Assumption(
        name="optimizer-inner-torch-optimizer",
        verified_on=ALL,
        target="megatron.core.optimizer.optimizer:MegatronOptimizer",
        assigned=("optimizer",),
        used_by="megatron_ext.recovery.adapter",
        reason="Each part wraps a torch optimizer whose state holds Adam's moments (distributed "
        "optimizer: this rank's shard): --recovery-reset-moments zeroes them.",
    ),
)

# The entry point's forms per version; megatron_ext.loop.entry holds the code of each form.
ENTRY_POINT: tuple[Assumption, ...] = (
    Assumption(
        name="entry-point",
        verified_on=V19,
        target=f"{_TRAINING}:pretrain",
        signature="(cfg_container: megatron.training.config.container.PretrainConfigContainer, "
        "train_valid_test_dataset_provider, model_type, forward_step_func, model_provider=None, "
        "process_non_loss_data_func=None, get_embedding_ranks=None, "
        "get_position_embedding_ranks=None, non_loss_data_func=None, store=None, "
        "inprocess_call_wrapper: Optional[Any] = None, p2p_communicator: Optional[megatron.core."
        "pipeline_parallel.p2p_communication.P2PCommunicator] = None, pg_collection: Union["
        f"{_PG}.ProcessGroupCollection, {_PG}.MultiModuleProcessGroupCollection, NoneType] = "
        "None, skip_model_parallel_init=False)",
        used_by="megatron_ext.loop.entry.run_with_config_container (0.18: "
        "run_with_model_provider, 0.17: run_classic), for pretrain_gpt_ext and megatron_ext.fork",
        reason="How the entry point hands Megatron its run: the GPT config container; a "
        "script's own model provider goes in pretrain's model_provider.",
        variants=(
            Variant(
                V18,
                "No GPT model config in the container: pretrain takes the model provider "
                "(megatron_ext.loop.gpt_model's, or the script's).",
                signature="(cfg_container: megatron.training.config.container."
                "PretrainConfigContainer, train_valid_test_dataset_provider, model_provider, "
                "model_type, forward_step_func, process_non_loss_data_func=None, "
                "get_embedding_ranks=None, get_position_embedding_ranks=None, "
                "non_loss_data_func=None, store=None, inprocess_call_wrapper: Optional[Any] = "
                "None)",
            ),
            Variant(
                V17,
                "Classic pretrain parses the arguments again: they are parsed once and handed "
                "to it (classic-pretrain-parsed-args).",
                signature="(train_valid_test_dataset_provider, model_provider, model_type, "
                "forward_step_func, process_non_loss_data_func=None, extra_args_provider=None, "
                "args_defaults={}, get_embedding_ranks=None, get_position_embedding_ranks=None, "
                "non_loss_data_func=None, store=None, inprocess_call_wrapper: Optional[Any] = "
                "None)",
            ),
        ),
    ),
    Assumption(
        name="batch-on-this-rank",
        verified_on=V19,
        target="megatron.core.utils:get_batch_on_this_tp_rank",
        signature="(batch: dict[str, torch.Tensor], has_cu_seqlens: bool, is_hybrid_cp: bool, "
        "create_attention_mask_in_dataloader: bool, broadcast_src_rank: int, broadcast_group: "
        "torch.distributed.distributed_c10d.ProcessGroup, cp_size: int, tp_rank: int, "
        "micro_batch_size: int, seq_length: int, mtp_on_this_rank: bool, "
        "pipeline_model_parallel_size: int = 1, is_pipeline_first_stage: bool = False, "
        "is_pipeline_last_stage: bool = False)",
        used_by="megatron_ext.loop.gpt_step.broadcast_batch (0.18: broadcast_batch_is_sft, "
        "0.17: broadcast_batch_from_iterator)",
        reason="TP rank 0's batch (seen by on_batch) broadcast over TP, then sliced for CP.",
        variants=(
            Variant(
                V18,
                "The packed-sequence switch is is_sft, not has_cu_seqlens.",
                signature="(batch: dict[str, torch.Tensor], is_sft: bool, is_hybrid_cp: bool, "
                "create_attention_mask_in_dataloader: bool, broadcast_src_rank: int, "
                "broadcast_group: torch.distributed.distributed_c10d.ProcessGroup, cp_size: "
                "int, tp_rank: int, micro_batch_size: int, seq_length: int, mtp_on_this_rank: "
                "bool, pipeline_model_parallel_size: int = 1, is_pipeline_first_stage: bool = "
                "False, is_pipeline_last_stage: bool = False)",
            ),
            Variant(
                V17,
                "In megatron.training.utils, reading an iterator itself: it is handed the batch "
                "the features saw; get_batch_on_this_cp_rank has no is_hybrid_cp.",
                target="megatron.training.utils:get_batch_on_this_tp_rank",
                signature="(data_iterator, mtp_on_this_rank: bool = False)",
            ),
        ),
    ),
    Assumption(
        name="model-pre-wrap-hooks",
        verified_on=V19,
        target="megatron.training.models.base:ModelConfig",
        assigned=("pre_wrap_hooks",),
        used_by="megatron_ext.loop.install",
        reason="on_model_built runs on the built chunks before mixed precision and DDP; "
        "FeatureSet.check_model_built refuses to train if it never ran.",
        variants=(
            Variant(
                V17 + V18,
                "No pre_wrap_hooks on the GPT path: the overlay's model provider "
                "(megatron_ext.loop.gpt_model), called by get_model per chunk, calls it.",
                target=f"{_TRAINING}:get_model",
                signature=_GET_MODEL,
                assigned=(),
            ),
        ),
    ),
    Assumption(
        name="script-model-provider",
        verified_on=ALL,
        target=f"{_TRAINING}:get_model",
        signature=_GET_MODEL,
        used_by="megatron_ext.fork (through megatron_ext.registry.hooks.observed_model_provider)",
        reason="get_model calls a script's own model provider once per chunk before mixed "
        "precision and DDP; on_model_built runs after the last one.",
    ),
    Assumption(
        name="inference-mode",
        verified_on=V18 + V19,
        target="megatron.core.inference.utils:InferenceMode",
        used_by="megatron_ext.zloss.adapter",
        reason="The fused output loss stays out of inference calls (InferenceMode.is_active()).",
        variants=(
            Variant(
                V17,
                "No InferenceMode: inference is told by inference_context alone.",
                target="megatron.core.inference.utils",
            ),
        ),
    ),
)


def _imports(module: str, names: str, *variants: Variant) -> Assumption:
    return Assumption(
        name=f"imports:{module}",
        verified_on=tuple(v for v in ALL if not any(v in x.verified_on for x in variants)),
        target=module,
        names=tuple(names.split()),
        used_by="training side (tests/unit/test_registry.py lists every import)",
        reason="Public names the training side imports from this module.",
        variants=variants,
    )


def _names(names: str) -> tuple[str, ...]:
    return tuple(names.split())


_C = "megatron.core"
_T = "megatron.training"
IMPORTS: tuple[Assumption, ...] = (
    _imports(_C, "mpu parallel_state"),
    _imports(f"{_C}.datasets", "helpers_cpp"),
    _imports(f"{_C}.datasets.blended_megatron_dataset_builder", "BlendedMegatronDatasetBuilder"),
    _imports(
        f"{_C}.datasets.blended_megatron_dataset_config",
        "convert_split_vector_to_split_matrix parse_and_normalize_split",
    ),
    _imports(f"{_C}.datasets.gpt_dataset", "GPTDataset GPTDatasetConfig MockGPTDataset"),
    _imports(f"{_C}.datasets.indexed_dataset", "DType IndexedDatasetBuilder"),
    _imports(f"{_C}.dist_checkpointing.serialization", "load_common_state_dict"),
    _imports(f"{_C}.dist_checkpointing.strategies", "filesystem_async"),
    _imports(f"{_C}.enums", "ModelType"),
    _imports(f"{_C}.fusions", "fused_cross_entropy"),
    _imports(f"{_C}.inference", "utils"),
    _imports(f"{_C}.models.gpt", "gpt_layer_specs"),
    _imports(f"{_C}.num_microbatches_calculator", "get_num_microbatches"),
    _imports(f"{_C}.models.gpt.gpt_model", "GPTModel"),
    _imports(
        f"{_C}.optimizer", "OptimizerConfig ParamKey ParamWithNamePredicate distrib_optimizer"
    ),
    _imports(f"{_C}.optimizer.optimizer", "ChainedOptimizer"),
    _imports(f"{_C}.optimizer_param_scheduler", "combine_param_group_overrides"),
    _imports(f"{_C}.parallel_state", "get_context_parallel_group"),
    _imports(f"{_C}.rerun_state_machine", "RerunMode RerunState get_rerun_state_machine"),
    _imports(f"{_C}.tensor_parallel", "gather_from_sequence_parallel_region"),
    _imports(f"{_C}.tensor_parallel.layers", "param_is_not_tensor_parallel_duplicate"),
    _imports(f"{_C}.tensor_parallel.utils", "VocabUtility"),
    _imports(f"{_C}.tokenizers.utils.build_tokenizer", "build_tokenizer"),
    _imports(f"{_C}.transformer.dot_product_attention", "DotProductAttention"),
    _imports(f"{_C}.transformer.enums", "AttnMaskType"),
    _imports(f"{_C}.transformer.module", "param_is_not_shared"),
    _imports(
        f"{_C}.utils",
        "get_attr_wrapped_model get_batch_on_this_cp_rank get_batch_on_this_tp_rank",
        Variant(
            V17,
            "get_batch_on_this_tp_rank is in megatron.training.utils.",
            names=_names("get_attr_wrapped_model get_batch_on_this_cp_rank"),
        ),
    ),
    _imports(
        _T,
        "get_args get_signal_handler get_tensorboard_writer get_timers get_wandb_writer "
        "global_vars inprocess_restart pretrain print_rank_0 set_startup_timestamps training",
    ),
    _imports(
        f"{_T}.argument_utils",
        "gpt_config_from_args pretrain_cfg_container_from_args",
        Variant(
            V18,
            "No gpt_config_from_args (entry-point).",
            names=_names("pretrain_cfg_container_from_args"),
        ),
        Variant(V17, "No config container (entry-point: classic pretrain).", names=()),
    ),
    _imports(
        f"{_T}.arguments",
        "core_transformer_config_from_args parse_and_validate_args parse_args",
        Variant(
            V17,
            "No parse_and_validate_args (entry-point: classic pretrain).",
            names=_names("core_transformer_config_from_args parse_args"),
        ),
    ),
    _imports(f"{_T}.checkpointing", "_load_base_checkpoint get_checkpoint_tracker_filename"),
    _imports(
        f"{_T}.utils",
        "calc_params_l2_norm get_blend_and_blend_per_split is_first_or_last_pipeline_stage",
        Variant(
            V17,
            "Also get_batch_on_this_tp_rank (batch-on-this-rank).",
            names=_names(
                "calc_params_l2_norm get_blend_and_blend_per_split "
                "is_first_or_last_pipeline_stage get_batch_on_this_tp_rank"
            ),
        ),
    ),
)

# The hooks the training script's side calls (no patch of Megatron).
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

PATCHES: tuple[Patch, ...] = (*BUGFIXES, *HOOKS, *FEATURE_PATCHES, CLASSIC_INIT, *CPU_RUNNER)
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
    """Verify every entry training relies on (start-up, before any patch is applied); a copy
    only the tools use is theirs to check and never blocks training."""
    for entry in ENTRIES:
        entry.verify()
    copies.verify(COPIES, scope="training")


def applied() -> list[Patch]:
    """Patches installed in this process."""
    return [p for p in PATCHES if p.is_applied()]
