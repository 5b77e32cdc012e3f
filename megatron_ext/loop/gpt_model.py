"""The overlay's own GPT model provider, for megatron-core 0.17 and 0.18 (registry
``model-pre-wrap-hooks``): 0.19 builds the model from its config container and calls
``pre_wrap_hooks``; 0.17/0.18 ship no GPT builder (0.18's ``pre_wrap_hooks`` are never called
on the GPT path). This is Megatron-LM core_v0.18's ``gpt_builder`` for the standard path, and
it calls ``on_model_built`` itself once this rank's last chunk is built.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.training import get_args, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args

from megatron_ext.common.errors import StartupError
from megatron_ext.common.features import FeatureSet
from megatron_ext.loop import gpt_step
from megatron_ext.registry import hooks

# Megatron-LM's builder options this provider does not implement: refused, not ignored.
UNSUPPORTED = (
    "spec",
    "yaml_cfg",
    "mtp_num_layers",
    "heterogeneous_layers_config_path",
    "experimental_attention_variant",
)


def check_supported(args: Any) -> None:
    """Refuse builder options the overlay's provider does not implement on this version."""
    if used := gpt_step.flags_set(args, UNSUPPORTED):
        raise StartupError(
            f"{', '.join(used)} is not supported by pretrain_gpt_ext.py on this megatron-core "
            "(0.17/0.18 have no GPT config container; the overlay builds the standard GPT "
            "model itself); use megatron-core 0.19.2 or Megatron-LM's pretrain_gpt.py."
        )


def layer_spec(args: Any, config: Any, vp_stage: int | None) -> Any:
    """The transformer layer (or MoE block) spec Megatron-LM's ``gpt_builder`` picks."""
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        return gpt_layer_specs.get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )
    build = (
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
        if use_te
        else gpt_layer_specs.get_gpt_layer_local_spec
    )
    kwargs = {} if use_te else {"normalization": args.normalization}
    return build(
        args.num_experts,
        args.moe_grouped_gemm,
        args.qk_layernorm,
        args.multi_latent_attention,
        qk_l2_norm=args.qk_l2_norm,
        **kwargs,
    )


def model_provider(
    features: FeatureSet,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
) -> GPTModel:
    """One GPT chunk, as ``get_model`` asks for it; after this rank's last one,
    ``on_model_built`` on all of them (:func:`megatron_ext.registry.hooks.chunk_built`)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    hooks.chunk_built(features, model)
    return model
