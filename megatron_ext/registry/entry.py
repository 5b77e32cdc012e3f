"""The entry point's part of the registry (:mod:`megatron_ext.registry.table` lists it with the
rest): how ``pretrain_gpt_ext.py`` and a script of the user's own (:mod:`megatron_ext.fork`)
drive each megatron-core's ``pretrain``, the batch helpers, and every megatron name the
training side imports, so that a name that moved is a start-up refusal naming it (checked
with every other entry) instead of an ImportError somewhere.
"""

from __future__ import annotations

from megatron_ext.common.versions import ALL, V17, V18, V19
from megatron_ext.loop import entry, gpt_model, gpt_step, hooks
from megatron_ext.registry.patching import Assumption, Patch, Variant

_TRAINING = "megatron.training.training"
_PG = "megatron.core.process_groups_config"

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
        wrap=entry.run_with_config_container,
        used_by="pretrain_gpt_ext, megatron_ext.fork",
        reason="How the entry point hands Megatron its run: the GPT config container (0.19), "
        "a container plus the overlay's model provider (0.18) or classic pretrain (0.17); a "
        "script of the user's own (megatron_ext.fork) goes through the same runner, with its "
        "model provider in pretrain's model_provider on 0.19 and 0.18.",
        variants=(
            Variant(
                V18,
                "No GPT model config in the container: pretrain takes the overlay's own model "
                "provider (megatron_ext.loop.gpt_model).",
                signature="(cfg_container: megatron.training.config.container."
                "PretrainConfigContainer, train_valid_test_dataset_provider, model_provider, "
                "model_type, forward_step_func, process_non_loss_data_func=None, "
                "get_embedding_ranks=None, get_position_embedding_ranks=None, "
                "non_loss_data_func=None, store=None, inprocess_call_wrapper: Optional[Any] = "
                "None)",
                wrap=entry.run_with_model_provider,
            ),
            Variant(
                V17,
                "Classic pretrain parses the arguments again in initialize_megatron: they are "
                "parsed once and handed to it (classic-pretrain-parsed-args), the features "
                "installed on the object Megatron validated and uses.",
                signature="(train_valid_test_dataset_provider, model_provider, model_type, "
                "forward_step_func, process_non_loss_data_func=None, extra_args_provider=None, "
                "args_defaults={}, get_embedding_ranks=None, get_position_embedding_ranks=None, "
                "non_loss_data_func=None, store=None, inprocess_call_wrapper: Optional[Any] = "
                "None)",
                wrap=entry.run_classic,
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
        wrap=gpt_step.broadcast_batch,
        used_by="megatron_ext.loop.gpt_step",
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
                wrap=gpt_step.broadcast_batch_is_sft,
            ),
            Variant(
                V17,
                "In megatron.training.utils, reading the batch from an iterator itself: it is "
                "handed the batch the features saw; get_batch_on_this_cp_rank has no "
                "is_hybrid_cp.",
                target="megatron.training.utils:get_batch_on_this_tp_rank",
                signature="(data_iterator, mtp_on_this_rank: bool = False)",
                wrap=gpt_step.broadcast_batch_from_iterator,
            ),
        ),
    ),
    Assumption(
        name="model-pre-wrap-hooks",
        verified_on=V19,
        target="megatron.training.models.base:ModelConfig",
        assigned=("pre_wrap_hooks",),
        used_by="megatron_ext.loop.install",
        reason="on_model_built runs on the built chunks before mixed-precision and DDP wrapping "
        "(the earliest point parameter names exist: checks fail before DDP and optimizer); "
        "FeatureSet.check_model_built refuses to train if it never ran.",
        variants=(
            Variant(
                V17 + V18,
                "No megatron.training.models (0.17), or its pre_wrap_hooks never called by the "
                "GPT path (0.18): the overlay's own model provider, which get_model calls for "
                "each chunk before wrapping, calls on_model_built itself.",
                target=f"{_TRAINING}:get_model",
                signature="(model_provider_func, model_type=<ModelType.encoder_or_decoder: 1>, "
                "wrap_with_ddp=True, config=None, pg_collection=None)",
                assigned=(),
                wrap=gpt_model.model_provider,
            ),
        ),
    ),
    Assumption(
        name="script-model-provider",
        verified_on=ALL,
        target=f"{_TRAINING}:get_model",
        signature="(model_provider_func, model_type=<ModelType.encoder_or_decoder: 1>, "
        "wrap_with_ddp=True, config=None, pg_collection=None)",
        wrap=hooks.observed_model_provider,
        used_by="megatron_ext.fork",
        reason="A script's own model provider (megatron_ext.fork) reaches on_model_built the way "
        "the overlay's own does on 0.17/0.18: get_model calls the provider once per model chunk "
        "(virtual stage) before mixed precision and DDP wrapping, and the overlay's wrapper runs "
        "the hook after the last chunk; on 0.19 pretrain builds through get_model when the "
        "config container has no model config.",
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
                "No InferenceMode: an inference call is told by its inference_context alone "
                "(and --fused-output-loss is refused on 0.17 anyway).",
                target="megatron.core.inference.utils",
            ),
        ),
    ),
)

CLASSIC_INIT = Patch(
    name="classic-pretrain-parsed-args",
    verified_on=V17,
    kind="entry",
    target=f"{_TRAINING}:initialize_megatron",
    signature="(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, "
    "allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None, "
    "get_position_embedding_ranks=None, parsed_args=None, store=None)",
    wrap=entry.with_parsed_args,
    reason="Classic pretrain (0.17) parses sys.argv again, so the features kept an args object "
    "Megatron never filled (every signals row had consumed_samples = 0). The entry point's "
    "parsed args go in as parsed_args; Megatron validates them and makes them its global args.",
    variants=(
        Variant(
            V18 + V19,
            "Not needed: pretrain takes the config container built from the args parsed once.",
            available=False,
        ),
    ),
)


def _imports(module: str, names: tuple[str, ...], *variants: Variant) -> Assumption:
    return Assumption(
        name=f"imports:{module}",
        verified_on=tuple(v for v in ALL if not any(v in x.verified_on for x in variants)),
        target=module,
        names=names,
        used_by="training side (tests/unit/test_registry.py lists every import)",
        reason="Public names the training side imports from this module.",
        variants=variants,
    )


_CORE = "megatron.core"
IMPORTS: tuple[Assumption, ...] = (
    _imports(_CORE, ("mpu", "parallel_state")),
    _imports(f"{_CORE}.datasets", ("helpers_cpp",)),
    _imports(
        f"{_CORE}.datasets.blended_megatron_dataset_builder", ("BlendedMegatronDatasetBuilder",)
    ),
    _imports(
        f"{_CORE}.datasets.blended_megatron_dataset_config",
        ("convert_split_vector_to_split_matrix", "parse_and_normalize_split"),
    ),
    _imports(f"{_CORE}.datasets.gpt_dataset", ("GPTDataset", "GPTDatasetConfig", "MockGPTDataset")),
    _imports(f"{_CORE}.datasets.indexed_dataset", ("DType", "IndexedDatasetBuilder")),
    _imports(f"{_CORE}.dist_checkpointing.serialization", ("load_common_state_dict",)),
    _imports(f"{_CORE}.dist_checkpointing.strategies", ("filesystem_async",)),
    _imports(f"{_CORE}.enums", ("ModelType",)),
    _imports(f"{_CORE}.inference", ("utils",)),
    _imports(f"{_CORE}.models.gpt", ("gpt_layer_specs",)),
    _imports(f"{_CORE}.num_microbatches_calculator", ("get_num_microbatches",)),
    _imports(f"{_CORE}.models.gpt.gpt_model", ("GPTModel",)),
    _imports(
        f"{_CORE}.optimizer",
        ("OptimizerConfig", "ParamKey", "ParamWithNamePredicate", "distrib_optimizer"),
    ),
    _imports(f"{_CORE}.optimizer.optimizer", ("ChainedOptimizer",)),
    _imports(f"{_CORE}.optimizer_param_scheduler", ("combine_param_group_overrides",)),
    _imports(f"{_CORE}.parallel_state", ("get_context_parallel_group",)),
    _imports(
        f"{_CORE}.rerun_state_machine", ("RerunMode", "RerunState", "get_rerun_state_machine")
    ),
    _imports(f"{_CORE}.tensor_parallel", ("gather_from_sequence_parallel_region",)),
    _imports(f"{_CORE}.tensor_parallel.layers", ("param_is_not_tensor_parallel_duplicate",)),
    _imports(f"{_CORE}.tokenizers.utils.build_tokenizer", ("build_tokenizer",)),
    _imports(f"{_CORE}.transformer.dot_product_attention", ("DotProductAttention",)),
    _imports(f"{_CORE}.transformer.enums", ("AttnMaskType",)),
    _imports(f"{_CORE}.transformer.module", ("param_is_not_shared",)),
    _imports(
        f"{_CORE}.utils",
        ("get_attr_wrapped_model", "get_batch_on_this_cp_rank", "get_batch_on_this_tp_rank"),
        Variant(
            V17,
            "get_batch_on_this_tp_rank is in megatron.training.utils.",
            names=("get_attr_wrapped_model", "get_batch_on_this_cp_rank"),
        ),
    ),
    _imports(
        "megatron.training",
        (
            "get_args",
            "get_signal_handler",
            "get_tensorboard_writer",
            "get_timers",
            "get_wandb_writer",
            "global_vars",
            "inprocess_restart",
            "pretrain",
            "print_rank_0",
            "set_startup_timestamps",
            "training",
        ),
    ),
    _imports(
        "megatron.training.argument_utils",
        ("gpt_config_from_args", "pretrain_cfg_container_from_args"),
        Variant(
            V18,
            "No gpt_config_from_args (entry-point).",
            names=("pretrain_cfg_container_from_args",),
        ),
        Variant(V17, "No config container (entry-point: classic pretrain).", names=()),
    ),
    _imports(
        "megatron.training.arguments",
        ("core_transformer_config_from_args", "parse_and_validate_args", "parse_args"),
        Variant(
            V17,
            "No parse_and_validate_args (entry-point: classic pretrain).",
            names=("core_transformer_config_from_args", "parse_args"),
        ),
    ),
    _imports(
        "megatron.training.checkpointing",
        ("_load_base_checkpoint", "get_checkpoint_tracker_filename"),
    ),
    _imports(
        "megatron.training.utils",
        ("calc_params_l2_norm", "get_blend_and_blend_per_split", "is_first_or_last_pipeline_stage"),
        Variant(
            V17,
            "Also get_batch_on_this_tp_rank (batch-on-this-rank).",
            names=(
                "calc_params_l2_norm",
                "get_blend_and_blend_per_split",
                "is_first_or_last_pipeline_stage",
                "get_batch_on_this_tp_rank",
            ),
        ),
    ),
)
