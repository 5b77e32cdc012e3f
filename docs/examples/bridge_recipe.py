"""Train one of Megatron-Bridge's own recipe functions with megatron-ext, shrunk to a tiny model.

A Bridge user's script: the recipe's ``ConfigContainer`` as Bridge builds it (mock data,
NullTokenizer, its optimizer, layout kind and cross-entropy fusion), changed only in size
(:func:`shrink`) and where a CPU needs it (:func:`for_cpu`), then one call::

    HF_HUB_OFFLINE=1 torchrun --nproc-per-node 2 bridge_recipe.py --recipe llama3 \\
        --work RUN --train-iters 6 -- --z-loss-coeff 1e-5 --spike-detect ...

The recipes that build their provider from a HuggingFace config (``llama3``, ``qwen3_moe``)
read it from the HuggingFace cache as an offline user gives it (``HF_HOME``, a
``config.json`` under the repository's snapshot). Unknown flags are megatron-ext's.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

# --recipe: (module under megatron.bridge.recipes, recipe function, the layout kept on 2 ranks)
RECIPES = {
    "vanilla_gpt": ("gpt.h100.vanilla_gpt", "vanilla_gpt_pretrain_1gpu_h100_bf16_config", {}),
    # TP4 PP2 CP2 SP: TP 2 on two ranks (CP needs TE's attention, SP TE's norms).
    "llama3": (
        "llama.h100.llama3",
        "llama3_8b_pretrain_16gpu_h100_bf16_16k_config",
        {"tensor_model_parallel_size": 2},
    ),
    # TP4 PP2 EP4 SP: EP 2 on two ranks.
    "qwen3_moe": (
        "qwen.h100.qwen3_moe",
        "qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config",
        {"expert_model_parallel_size": 2},
    ),
}
CUDA_FUSIONS = (
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "moe_permute_fusion",
    "moe_grouped_gemm",
    "moe_router_fusion",
)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The script's own flags, and the rest for megatron-ext."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--recipe", choices=sorted(RECIPES), required=True)
    parser.add_argument("--work", type=Path, required=True, help="checkpoints go to WORK/ckpt")
    parser.add_argument("--train-iters", type=int, default=6)
    parser.add_argument("--save-interval", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help="Bridge alone, no megatron-ext")
    options, rest = parser.parse_known_args(argv)
    return options, [word for word in rest if word != "--"]


def recipe_function(name: str):
    """The recipe function. ``megatron.bridge.recipes``' own ``__init__`` imports every
    family's recipes (``diffusers`` for Flux, ...); where one of those optional packages is
    missing, the recipe's own module is imported without it."""
    module, function, _ = RECIPES[name]
    package = "megatron.bridge.recipes"
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as missing:
        print(f"bridge_recipe: {package} needs {missing.name}; importing {module} alone")
        spec = importlib.util.find_spec(package)
        stand_in = types.ModuleType(package)
        stand_in.__path__ = list(spec.submodule_search_locations)
        stand_in.__spec__ = spec
        sys.modules[package] = stand_in
    return getattr(importlib.import_module(f"{package}.{module}"), function)


def shrink(cfg, options: argparse.Namespace) -> None:
    """Size only: 2 layers, hidden 64, sequence 64, a 1024-token NullTokenizer vocabulary, a
    few iterations, the run's directories."""
    model, seq = cfg.model, 64
    model.num_layers, model.hidden_size, model.num_attention_heads = 2, 64, 4
    model.ffn_hidden_size = 176
    model.kv_channels = 16
    model.seq_length = cfg.dataset.seq_length = seq
    if getattr(model, "num_query_groups", None):
        model.num_query_groups = 2
    if model.num_moe_experts:
        model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size = 4, 2, 32
    if cfg.tokenizer.tokenizer_type == "NullTokenizer":  # the model's from it, padded
        cfg.tokenizer.vocab_size, model.vocab_size = 1024, None
    train, sched = cfg.train, cfg.scheduler
    train.train_iters = options.train_iters
    train.global_batch_size, train.micro_batch_size = (
        options.global_batch_size,
        options.micro_batch_size,
    )
    sched.lr_warmup_iters, sched.lr_decay_iters = 2, options.train_iters
    cfg.validation.eval_iters = 0  # time: the recipes evaluate 32 batches every 500-2000
    cfg.checkpoint.save = cfg.checkpoint.load = str(options.work / "ckpt")
    cfg.checkpoint.save_interval = options.save_interval
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = str(options.work / "tensorboard")
    cfg.dataset.path_to_cache = str(options.work / "index-cache")


def for_cpu(cfg, layout: dict[str, int]) -> None:
    """What a CPU needs: Megatron's local layer spec, CUDA-only fusions off, gloo, the MoE
    allgather dispatcher, no data workers, and the recipe's layout kind at two ranks."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    model = cfg.model
    model.transformer_layer_spec, model.transformer_impl = local_layer_spec, "local"
    for name in CUDA_FUSIONS:
        if hasattr(model, name):
            setattr(model, name, False)
    model.tensor_model_parallel_size = model.pipeline_model_parallel_size = 1
    model.context_parallel_size = model.expert_model_parallel_size = 1
    model.sequence_parallel = False  # the local spec's torch LayerNorm refuses it
    for name, size in layout.items():
        setattr(model, name, size)
    model.pipeline_dtype = None
    if model.num_moe_experts:  # flex (DeepEP) is CUDA-only; alltoall hands all_to_all_single
        # tensor split sizes, which gloo rejects
        model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend = "allgather", None
    model.use_cpu_initialization = True
    cfg.dataset.num_workers = 0
    cfg.dist.distributed_backend = "gloo"


def config(options: argparse.Namespace):
    """The recipe's ConfigContainer, shrunk and made to run on this machine."""
    cfg = recipe_function(options.recipe)()
    if cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer":
        # Offline without the tokenizer's files (Qwen3 MoE); mock data reads no text.
        cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model = "NullTokenizer", None
        cfg.tokenizer.hf_tokenizer_kwargs = {}
    shrink(cfg, options)
    if not torch.cuda.is_available():
        for_cpu(cfg, RECIPES[options.recipe][2])
    return cfg


def main(argv: list[str]) -> None:
    from megatron_ext.bridge import te_standin

    te_standin.install()  # Bridge imports Transformer Engine unguarded (docs/bridge.md)
    options, ext_flags = parse(argv)
    cfg = config(options)
    if options.plain:
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain

        pretrain(cfg, forward_step)
        return
    from megatron_ext.bridge import pretrain  # megatron-ext

    pretrain(cfg, ext_flags)


if __name__ == "__main__":
    main(sys.argv[1:])
