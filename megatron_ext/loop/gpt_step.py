"""The overlay's GPT step for Megatron: batch, loss, forward step and dataset provider, as
Megatron-LM's ``pretrain_gpt.py`` (core_v0.19.0, not shipped in the wheel) does the standard
pretraining path; SFT, FIM, packed sequences, hybrid CP, ModelOpt and cached-logit
distillation are refused at start-up. :func:`bind` binds the run's FeatureSet: the features'
hooks are called through :mod:`megatron_ext.registry.hooks`, as a script of the user's own does.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.parallel_state import get_context_parallel_group
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_timers, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from megatron_ext.common.features import FeatureSet, LossInputs, MicroBatch
from megatron_ext.registry import hooks

# Megatron-LM pretrain_gpt.py: a loss 10x the max of the first losses is "spiky".
SPIKY_LOSS_FACTOR = 10

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")

# Megatron data modes whose batches are not the standard [micro-batch, sequence] GPT batch
# (packed sequences, FIM-permuted tokens) that this step and the features read.
BATCH_MODES = ("sft", "fim_data", "dataloader_inter_document_masking", "hybrid_context_parallel")
UNSUPPORTED_FLAGS = (
    *BATCH_MODES,
    "logits_load_dir",
    "use_legacy_models",
    "overlap_moe_expert_parallel_comm",
)


def flags_set(args: Any, attributes: tuple[str, ...]) -> list[str]:
    """The flags, as typed, of the Megatron ``attributes`` that ``args`` sets."""
    return ["--" + a.replace("_", "-") for a in attributes if getattr(args, a, None)]


def check_supported(args: Any) -> None:
    """Refuse Megatron modes this entry point does not implement, instead of mis-training."""
    if used := flags_set(args, UNSUPPORTED_FLAGS):
        raise SystemExit(
            f"pretrain_gpt_ext.py does not support {', '.join(used)}; use Megatron-LM's "
            "pretrain_gpt.py for those modes."
        )
    check_layout(args)


def check_layout(args: Any) -> None:
    """Refuse, before distributed init, what Megatron would assert deep in model construction
    on every rank: layouts its local layer spec cannot build, and the CPU runner's limits."""
    if args.async_save and getattr(torch.cuda, "_megatron_ext_cpu_harness", False):
        raise SystemExit(
            "pretrain_gpt_ext.py: --async-save is refused on the CPU runner: Megatron's "
            "persistent checkpoint worker (--use-persistent-ckpt-worker, without which Megatron "
            "turns --async-save off) starts in a forkserver process without the runner's "
            "CUDA stand-ins, dies at the first save, and the training waits for it forever. "
            "Drop --async-save on CPU (saves are synchronous); on a GPU it is checked by "
            "tools/gpu_smoke.sh's async-save rung."
        )
    if getattr(args, "use_megatron_fsdp", False):
        _check_megatron_fsdp()
    if args.transformer_impl != "local":
        return
    needs = "Install Transformer Engine and run with --transformer-impl transformer_engine"
    if args.context_parallel_size > 1:
        raise SystemExit(
            f"pretrain_gpt_ext.py: --context-parallel-size {args.context_parallel_size} needs "
            "Transformer Engine: with --transformer-impl local Megatron has no attention that "
            f"supports context parallelism (only TEDotProductAttention does). {needs}, or use "
            "--context-parallel-size 1."
        )
    if args.sequence_parallel and importlib.util.find_spec("apex") is None:
        raise SystemExit(
            "pretrain_gpt_ext.py: --sequence-parallel needs Transformer Engine or Apex: with "
            "--transformer-impl local and no Apex, Megatron's layers use torch's LayerNorm/"
            f"RMSNorm, which does not support sequence parallelism. {needs}, or drop "
            "--sequence-parallel."
        )


def _check_megatron_fsdp() -> None:
    """Refuse where Megatron-FSDP's wrapper fails with a traceback on every rank."""
    if getattr(torch.cuda, "_megatron_ext_cpu_harness", False):
        raise SystemExit(
            "pretrain_gpt_ext.py: --use-megatron-fsdp is refused on the CPU runner: Megatron-"
            "FSDP's wrapper builds torch.device(f'cuda:{torch.cuda.current_device()}') "
            "(RuntimeError: Invalid device string: 'cuda:cpu', mcore_fsdp_adapter.py) and its "
            "gradient reduce-scatter uses ReduceOp.PREMUL_SUM (RuntimeError: Cannot use "
            "ReduceOp.PREMUL_SUM with Gloo). Use --use-torch-fsdp2 on CPU, or run on GPUs."
        )
    if importlib.util.find_spec("einops") is None:
        raise SystemExit(
            "pretrain_gpt_ext.py: --use-megatron-fsdp needs einops (Megatron-FSDP asserts it "
            "while wrapping the model, after the whole start-up): pip install einops."
        )


def get_batch(
    data_iterator: Iterator[dict[str, Any]] | None,
    micro_batch: MicroBatch,
    features: FeatureSet,
    vp_stage: int | None,
    broadcast: Callable[..., dict[str, Any]],
) -> dict[str, Any] | None:
    """Read on TP rank 0 (``on_batch`` sees it there), broadcast over TP, slice for CP
    (``broadcast``: the installed version's form of ``batch-on-this-rank``)."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        batch = hooks.read_batch(features, data_iterator, micro_batch)  # type: ignore[arg-type]
        for key in BATCH_KEYS:
            value = batch.get(key)
            batch[key] = value.cuda(non_blocking=True) if value is not None else None
    return broadcast(batch, features.args, tp_rank)


def _tp_then_cp(batch: dict[str, Any], args: Any, tp_rank: int, **packed: bool) -> dict[str, Any]:
    """megatron-core 0.18 and 0.19's ``megatron.core.utils`` helpers; ``packed`` is the
    version's switch turning packed sequences off."""
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

    batch = get_batch_on_this_tp_rank(
        batch,
        **packed,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=get_context_parallel_group()
    )


def broadcast_batch(batch: dict[str, Any], args: Any, tp_rank: int) -> dict[str, Any]:
    """megatron-core 0.19: no packed sequences (``has_cu_seqlens``)."""
    return _tp_then_cp(batch, args, tp_rank, has_cu_seqlens=False)


def broadcast_batch_is_sft(batch: dict[str, Any], args: Any, tp_rank: int) -> dict[str, Any]:
    """megatron-core 0.18: the same helpers, whose packed-sequence switch is ``is_sft``."""
    return _tp_then_cp(batch, args, tp_rank, is_sft=False)


def broadcast_batch_from_iterator(batch: dict[str, Any], args: Any, tp_rank: int) -> dict[str, Any]:
    """megatron-core 0.17: its helper reads an iterator itself (TP rank 0): it is handed one
    over the batch the features saw, with only the keys present."""
    from megatron.core.utils import get_batch_on_this_cp_rank
    from megatron.training.utils import get_batch_on_this_tp_rank

    present = {k: v for k, v in batch.items() if k in BATCH_KEYS and v is not None}
    batch = get_batch_on_this_tp_rank(iter([present]) if tp_rank == 0 else None)
    batch = {key: batch.get(key) for key in BATCH_KEYS}
    return get_batch_on_this_cp_rank(batch, cp_group=get_context_parallel_group())


def loss_func(
    features: FeatureSet,
    loss_mask: torch.Tensor,
    micro_batch: MicroBatch,
    output_tensor: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Token-summed loss, token count and the ``lm loss`` report, with the features' entries
    (``on_loss``)."""
    args = features.args
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    inputs = LossInputs(micro_batch, output_tensor, mask, loss, num_tokens)
    report = hooks.loss_report(features, inputs, report)

    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward pass is deterministic
                fatal=True,
            )
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(
                rerun_state_machine.is_unexpectedly_large,
                threshold=SPIKY_LOSS_FACTOR,
                context="loss",
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
    return loss, num_tokens, report


def forward_step(
    features: FeatureSet, broadcast: Callable[..., dict[str, Any]], data_iterator: Any, model: Any
):
    """One micro-batch forward; returns the per-token loss tensor and the loss closure."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    micro_batch = micro_batch_of(features, model)
    batch = get_batch(data_iterator, micro_batch, features, vp_stage, broadcast)
    timers("batch-generator").stop()
    if batch is None:
        batch = dict.fromkeys(BATCH_KEYS)
    output_tensor = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output_tensor, partial(loss_func, features, batch["loss_mask"], micro_batch)


def micro_batch_of(features: FeatureSet, model: Any) -> MicroBatch:
    """The micro-batch ``model`` is about to run: the iteration as Megatron logs it (1-indexed),
    training or evaluation, this rank's DP rank."""
    return MicroBatch(
        # --skip-train evaluates without train(), which sets curr_iteration.
        iteration=getattr(features.args, "curr_iteration", features.args.iteration) + 1,
        training=model.training,
        dp_rank=mpu.get_data_parallel_rank(),
    )


def is_dataset_built_on_rank(vp_stage: int | None = None) -> bool:
    """Datasets are read on TP rank 0 of the first and last pipeline stages only."""
    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def gpt_dataset_config_from_args(args: Any) -> GPTDatasetConfig:
    """The GPTDatasetConfig Megatron-LM's pretrain_gpt.py builds (standard path)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def train_valid_test_datasets_provider(
    args: Any, train_val_test_num_samples: list[int], vp_stage: int | None = None
):
    """Build train/valid/test datasets through BlendedMegatronDatasetBuilder (bound with
    ``on_train_dataset`` by :func:`bind`)."""
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        gpt_dataset_config_from_args(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


def bind(
    features: FeatureSet, broadcast: Callable[..., dict[str, Any]]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(forward step, dataset provider) for ``pretrain``, calling ``features``' hooks."""
    build = partial(train_valid_test_datasets_provider, features.args)
    provider = partial(hooks.datasets, features, build)
    provider.is_distributed = True  # type: ignore[attr-defined]  # every rank calls it
    return partial(forward_step, features, broadcast), provider


def get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """First stage, plus the last when the output layer shares the embedding weights."""
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))
