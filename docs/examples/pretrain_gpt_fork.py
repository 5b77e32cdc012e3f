"""Pretrain GPT: a Megatron-LM fork's own ``pretrain_gpt.py``, with megatron-ext.

Its batch, loss, forward step, model and datasets are the script's own, written against
megatron-core 0.19's public API the way Megatron-LM's ``pretrain_gpt.py`` is. The lines marked
``# megatron-ext`` are all it takes to give it every megatron-ext feature (docs/fork.md); the
rest is what a fork already has. Run it like Megatron-LM's script:

    torchrun --nproc-per-node 8 pretrain_gpt_fork.py <Megatron-LM flags> <megatron-ext flags>

tests/e2e/test_fork_example.py trains it with every feature, through a spike drill, a rollback
and a resume, and checks ``megatron-ext lookup`` against its sample log.
"""

import time

_PROGRAM_START_TIME = time.time()

from collections.abc import Iterator  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (  # noqa: E402
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.parallel_state import get_context_parallel_group  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import (  # noqa: E402
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_timers, print_rank_0  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402
from megatron.training.utils import (  # noqa: E402
    get_blend_and_blend_per_split,
    is_first_or_last_pipeline_stage,
)

from megatron_ext.fork import Forward, Overlay  # noqa: E402  # megatron-ext

overlay = Overlay()  # megatron-ext: the features, installed by overlay.pretrain below

KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(
    data_iterator: Iterator[dict[str, Any]] | None,
    forward: Forward,  # megatron-ext: passed in by forward_step
    vp_stage: int | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """TP rank 0 reads the micro-batch and broadcasts it over TP; then it is sliced for CP."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = forward.read(data_iterator)  # megatron-ext: next(data_iterator), features see it
        batch = {k: v.cuda(non_blocking=True) for k in KEYS if (v := sample.get(k)) is not None}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=get_context_parallel_group()
    )
    return tuple(batch.get(key) for key in KEYS)


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Token-summed loss, its token count and the ``lm loss`` report, with Megatron's NaN check."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        get_rerun_state_machine().validate_result(
            result=loss,
            rejection_func=torch.isnan,
            message="found NaN in local forward loss calculation",
            tolerance=0.0,
            fatal=True,
        )
    return loss, num_tokens, report


def forward_step(data_iterator: Iterator[dict[str, Any]] | None, model: GPTModel) -> tuple:
    """One micro-batch: the batch, the model's per-token loss and the loss function."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    forward = overlay.forward(model)  # megatron-ext: this micro-batch, as the features see it
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, forward, vp_stage
    )
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, forward.loss(partial(loss_func, loss_mask), loss_mask)  # megatron-ext


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
) -> GPTModel:
    """One GPT chunk: the local or Transformer Engine layer spec, dense layers."""
    args = get_args()
    print_rank_0("building the fork's GPT model ...")
    config = config or core_transformer_config_from_args(args)
    if args.transformer_impl == "transformer_engine":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm
        )
    else:
        layer_spec = get_gpt_layer_local_spec(
            args.num_experts,
            args.moe_grouped_gemm,
            args.qk_layernorm,
            normalization=args.normalization,
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def is_dataset_built_on_rank(vp_stage: int | None = None) -> bool:
    """The data is read on TP rank 0 of the first and last pipeline stages only."""
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(
    train_val_test_num_samples: list[int], vp_stage: int | None = None
) -> tuple[Any, Any, Any]:
    """The train, validation and test datasets, blended as --data-path says."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    print_rank_0("> building the fork's train, validation and test datasets ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config,
    ).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    overlay.pretrain(  # megatron-ext: instead of Megatron's pretrain, on any megatron-core
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        program_start=_PROGRAM_START_TIME,
    )
