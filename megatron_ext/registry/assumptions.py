"""The registry's assumptions: every private Megatron name the overlay relies on without
replacing it (:class:`~megatron_ext.registry.patching.Assumption`), one entry each, with the module
that relies on it, why and the versions it was verified on.

Part of :mod:`megatron_ext.registry.table` (which lists them in ``ENTRIES``, verifies them at
start-up and prints them with ``megatron-ext patches``); kept in its own file so that the
patches and the names merely read can each be read in one screenful of a table. Targets are
``module:qualname`` strings, resolved only when verified: no Megatron import here.
"""

from __future__ import annotations

from megatron_ext.common.versions import ALL, V17, V18, V19
from megatron_ext.registry.patching import Assumption, Variant

_BUFFER = "megatron.core.distributed.param_and_grad_buffer"

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
        reason="A bucket group says whether its grads are sharded (distributed optimizer) "
        "and which shard this rank owns.",
    ),
    Assumption(
        name="ddp-bucket-layout",
        verified_on=ALL,
        target=f"{_BUFFER}:_ParamAndGradBucket",
        assigned=("grad_data", "params_list", "param_to_index"),
        used_by="megatron_ext.telemetry.bucket_layout",
        reason="A bucket's contiguous grad_data and each param's [start, end) in it are what "
        "the bucket norms read (views, no copy).",
    ),
    Assumption(
        name="transformer-layer-number",
        verified_on=ALL,
        target="megatron.core.transformer.transformer_layer:TransformerLayer",
        assigned=("layer_number",),
        used_by="megatron_ext.telemetry.adapter",
        reason="Bucket names use global layer numbers: a layer's 1-based layer_number includes "
        "its pipeline stage's and virtual chunk's offset, named_parameters() does not.",
    ),
    Assumption(
        name="chained-optimizer-parts",
        verified_on=ALL,
        target="megatron.core.optimizer.optimizer:ChainedOptimizer",
        assigned=("chained_optimizers",),
        used_by="megatron_ext.telemetry.adapter",
        reason="Dense and expert parameters live in different chained optimizers, whose grad "
        "norms Megatron reduces over their own grad-stats groups (DDP with EP: TP x PP vs "
        "expert TP x EP x PP); bucket norms and the update ratio reduce the same way.",
    ),
    Assumption(
        name="optimizer-grad-norm-skip-threshold",
        verified_on=V18 + V19,
        target="megatron.core.optimizer.optimizer:ChainedOptimizer.step",
        assigned=("get_grad_norm", "grad_norm_skip_threshold", "step_with_ready_grads"),
        used_by="megatron_ext.spikes.update_skip",
        reason="ChainedOptimizer.step computes the grad norm, then withholds the update when it "
        "exceeds a part's config.grad_norm_skip_threshold, read after the norm: "
        "--spike-skip-update sets that threshold before each norm (no patch, no sync).",
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
        reason="The local attention's scores reach its scale_mask_softmax module as the first "
        "argument (mask second): --signals-attention-logit reads their max there with a "
        "forward pre-hook, as TE's max-logit output does for --log-max-attention-logit.",
    ),
    Assumption(
        name="local-attention-softmax-mask",
        verified_on=ALL,
        target="megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax",
        assigned=("attn_mask_type", "scale", "window_size"),
        used_by="megatron_ext.telemetry.attention_logit",
        reason="The softmax multiplies the scores by `scale` and, for a causal mask type "
        "without a mask, masks the future itself: the logit max applies both.",
    ),
    Assumption(
        name="optimizer-tp-groups",
        verified_on=V19,
        target="megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups",
        assigned=("tp_group", "expert_tp_group"),
        used_by="megatron_ext.telemetry.adapter",
        reason="Megatron sets each chained optimizer's tp_group and expert_tp_group after "
        "building it (setattr, no constructor argument); telemetry hands them to Megatron's "
        "own duplicate filter to count each parameter as its grad norm does.",
        variants=(
            Variant(
                V17 + V18,
                "Only tp_group is set (no expert_tp_group): Megatron's grad norm filters "
                "duplicates of every parameter, expert ones included, over tp_group, and so does "
                "telemetry (it passes expert_tp_group only where the optimizer has one).",
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
        reason="Megatron marks expert-parallel parameters allreduce=False (this filter reads "
        "the mark, and copy_optimizer_param_metadata copies it onto main parameters); telemetry "
        "sorts parameters into dense and expert by it and counts them with this filter.",
        variants=(
            Variant(
                V17 + V18,
                "The filter has no expert_tp_group parameter (see optimizer-tp-groups); the "
                "allreduce=False mark still sorts dense from expert parameters.",
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
        reason="The z-loss reduces over the output layer's tensor-parallel group, as "
        "Megatron's own compute_language_model_loss does.",
    ),
    Assumption(
        name="output-layer-modes",
        verified_on=ALL,
        target="megatron.core.tensor_parallel.layers:ColumnParallelLinear",
        assigned=("sequence_parallel", "gradient_accumulation_fusion", "tp_group", "weight"),
        used_by="megatron_ext.zloss.adapter",
        reason="The fused output loss delivers gradients as the output layer would: it reads "
        "the layer's weight, TP group, sequence-parallel and gradient-accumulation-fusion "
        "modes.",
    ),
    Assumption(
        name="schedule-loss-scaling",
        verified_on=ALL,
        target="megatron.core.pipeline_parallel.schedules:forward_step_calc_loss",
        signature="(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data, "
        "num_microbatches, forward_data_store, cp_group_size=None, is_last_stage=None)",
        used_by="megatron_ext.zloss.adapter",
        reason="--fused-output-loss adds the weight gradient to main_grad in the forward, "
        "scaled by the gradient the schedule will send: a 3-tuple loss is divided by its "
        "token count and the micro-batch count (unless calculate_per_token_loss), then "
        "backward_step multiplies it by grad_scale_func's loss scale. The fused backward "
        "checks every step that the gradient it receives is that scale times the mask.",
    ),
    Assumption(
        name="ddp-grad-added-mark",
        verified_on=ALL,
        target="megatron.core.distributed.distributed_data_parallel:DistributedDataParallel",
        assigned=("grad_added_to_main_grad",),
        used_by="megatron_ext.zloss.adapter",
        reason="The fused output loss writes the weight gradient into main_grad as Megatron's "
        "fused linear does: it sets grad_added_to_main_grad (which DDP resets each step and "
        "its hook reads) and returns a dummy .grad, zeros where zero_out_wgrad is set.",
    ),
    Assumption(
        name="ckpt-results-queue",
        verified_on=ALL,
        target="megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
        used_by="megatron_ext.registry.fixes",
        reason="The SIGTERM fix creates this module-level queue before upstream's first use.",
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
        reason="The weight-decay resume check reads the checkpoint's saved args before "
        "anything is built, the way --use-checkpoint-args does.",
        variants=(
            Variant(
                V17 + V18,
                "No dp_cp_group / expt_dp_group / gpt_compat_layer_maps; the check calls it "
                "with (load_dir, args, rank0=True), valid on every version.",
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
    # Megatron pieces read without importing megatron-core (5 s of imports for an answer in
    # milliseconds); test_checkpoint_state.py proves the same results on the same inputs.
    Assumption(
        name="checkpoint-common-state",
        verified_on=V19,
        target="megatron.core.dist_checkpointing.serialization:load_common_state_dict",
        signature="(checkpoint_dir: Union[str, pathlib.Path]) -> Dict[str, Any]",
        used_by="megatron_ext.common.checkpoint_state",
        reason="Read as it reads it: legacy common.pt, else the bytes of the "
        "'common_state/shard_0_1' ShardedObject in the DCP files (torch.save of [state]); "
        "any other layout is handed to this function.",
        variants=(
            Variant(
                V17 + V18,
                "torch_dist checkpoints keep the common state in common.pt, written by "
                "save_common (torch.save of the state), which the legacy branch reads.",
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
        reason="BlendedDataset.__getitem__ returns dataset_id = dataset_index[idx], the position "
        "of the sample's member in the blend's prefixes; the GPT step carries it to the "
        "per-source signals (a blend batch without it stops the run loudly).",
    ),
    Assumption(
        name="idx-trailing-bytes",
        verified_on=ALL,
        target="megatron.core.datasets.indexed_dataset:_IndexReader",
        assigned=("sequence_lengths", "sequence_pointers", "document_indices"),
        used_by="megatron_ext.common.records.pair",
        reason="preprocess appends a .bin fingerprint after the .idx arrays; the reader takes "
        "each array by the counts in the header (numpy.frombuffer with count and offset), so "
        "the trailing bytes are never read (tests read a fingerprinted .idx with it).",
    ),
    Assumption(
        name="fsdp2-units",
        verified_on=ALL,
        target="megatron.core.distributed.torch_fully_sharded_data_parallel:"
        "TorchFullyShardedDataParallel",
        assigned=("fully_shard", "device_mesh"),
        used_by="megatron_ext.telemetry.sharded",
        reason="Under --use-torch-fsdp2 Megatron calls torch's fully_shard on each "
        "TransformerLayer, the embedding and the root module over its device mesh: bucket "
        "grad norms are one per such unit, over its parameters' local gradient shards.",
    ),
    Assumption(
        name="float16-main-params",
        verified_on=ALL,
        target="megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params",
        assigned=("float16_groups", "fp32_from_float16_groups"),
        used_by="megatron_ext.telemetry.sharded",
        reason="Under --bf16 the optimizer's fp32 main parameters (fp32_from_float16_groups, in "
        "the order of float16_groups) get the gradients and Megatron frees the model's after "
        "copying them: FSDP2 bucket norms read the main parameters' gradients.",
    ),
)
