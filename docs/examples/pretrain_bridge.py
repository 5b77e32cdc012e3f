"""Pretrain a tiny GPT with Megatron-Bridge's own ``pretrain``, with megatron-ext.

A Bridge user's script: a ``ConfigContainer`` (model provider, data, optimizer, checkpoints)
and one call. The line marked ``# megatron-ext`` is all it takes to give it every megatron-ext
feature (docs/bridge.md); ``--plain`` runs Bridge's ``pretrain`` and its own GPT forward step
untouched (what tests/bridge compares against)::

    torchrun --nproc-per-node 8 pretrain_bridge.py --data-path PREFIX --tokenizer DIR \\
        --work RUN --train-iters 50 -- --z-loss-coeff 1e-4 --spike-detect ...

Every flag the script does not know (after ``--`` or not) is megatron-ext's
(``python pretrain_gpt_ext.py --help`` lists them). tests/bridge trains it on CPU
(``megatron_ext/cpu/run.py --bridge-script``) with every feature, through a spike drill,
a rollback and a resume, under megatron-ext's supervisor.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The script's own flags, and the rest for megatron-ext: its own flags and those
    megatron-ext's launchers add (``--save``/``--load`` CKPT_DIR, ``--exit-signal-handler``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--data-path", nargs="+", required=True, help="[WEIGHT] PREFIX ...")
    parser.add_argument("--tokenizer", required=True, help="a HuggingFace tokenizer directory")
    parser.add_argument("--work", type=Path, required=True, help="checkpoints go to WORK/ckpt")
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help="Bridge alone, no megatron-ext")
    parser.add_argument(
        "--own-forward-step", action="store_true", help="a forward step of the user's own form"
    )
    options, rest = parser.parse_known_args(argv)
    return options, [word for word in rest if word != "--"]


def config(options: argparse.Namespace):
    """The run's ConfigContainer: a tiny Llama-style GPT (RoPE, RMSNorm, SwiGLU, untied
    output layer) on Megatron's local layer spec, fp32, CPU-friendly fusions off."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        GPTDatasetConfig,
        LoggerConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )

    seq_length = 64
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    ckpt = str(options.work / "ckpt")
    model = GPTModelProvider(
        transformer_layer_spec=local_layer_spec,
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=172,
        num_attention_heads=4,
        seq_length=seq_length,
        normalization="RMSNorm",
        activation_func=F.silu,
        gated_linear_unit=True,
        position_embedding_type="rope",
        add_bias_linear=False,
        share_embeddings_and_output_weights=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Bridge's Llama/Qwen recipes fuse the CE with impl "te"; no TE here, megatron-core's own.
        cross_entropy_loss_fusion=True,
        cross_entropy_fusion_impl="native",
        use_cpu_initialization=True,
        make_vocab_size_divisible_by=128,
    )
    return ConfigContainer(
        model=model,
        train=TrainingConfig(
            train_iters=options.train_iters,
            global_batch_size=options.global_batch_size,
            micro_batch_size=options.micro_batch_size,
        ),
        validation=ValidationConfig(eval_interval=10_000, eval_iters=0),
        optimizer=OptimizerConfig(
            optimizer="adam",
            bf16=False,
            fp16=False,
            lr=1e-3,
            min_lr=1e-4,
            weight_decay=0.1,
            clip_grad=1.0,
            use_distributed_optimizer=False,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="cosine",
            lr_warmup_iters=2,
            lr_decay_iters=options.train_iters,
            start_weight_decay=0.1,
            end_weight_decay=0.1,
            weight_decay_incr_style="constant",
        ),
        ddp=DistributedDataParallelConfig(
            overlap_grad_reduce=True, bucket_size=20_000, use_distributed_optimizer=False
        ),
        dataset=GPTDatasetConfig(
            random_seed=1234,
            seq_length=seq_length,
            data_path=options.data_path,
            split="100,0,0",
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            path_to_cache=str(options.work / "index-cache"),
            num_dataset_builder_threads=1,
            dataloader_type="single",
            num_workers=0,
        ),
        logger=LoggerConfig(log_interval=1, tensorboard_dir=str(options.work / "tensorboard")),
        tokenizer=TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=options.tokenizer
        ),
        checkpoint=CheckpointConfig(
            save=ckpt, load=ckpt, save_interval=options.save_interval, ckpt_format="torch_dist"
        ),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend=backend),
    )


class CountingStep:
    """A forward step of the user's own: Bridge's three-argument form (``state`` first, which
    Bridge injects), counting its micro-batches around Bridge's GPT step."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, state, data_iterator, model):
        from megatron.bridge.training.gpt_step import forward_step

        self.calls += 1
        return forward_step(state, data_iterator, model)


def main(argv: list[str]) -> None:
    options, ext_flags = parse(argv)
    if options.own_forward_step:
        from megatron_ext.bridge import pretrain

        step = CountingStep()
        pretrain(config(options), ext_flags, forward_step_func=step)
        print(f"own forward step: {step.calls} micro-batches", flush=True)
        return
    if options.plain:
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain

        pretrain(config(options), forward_step)
        return
    from megatron_ext.bridge import pretrain  # megatron-ext

    pretrain(config(options), ext_flags)  # megatron-ext: instead of Bridge's pretrain


if __name__ == "__main__":
    main(sys.argv[1:])
