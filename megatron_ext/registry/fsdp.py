"""The registry's patches of the torch FSDP2 feature (:mod:`megatron_ext.fsdp.adapter`), kept
beside :mod:`megatron_ext.registry.table`, which lists them with its other feature patches (applied
bound to the feature, which is on exactly when ``--use-torch-fsdp2`` is). What the FSDP2
bucket norms rely on is the assumption ``fsdp2-units`` (:mod:`megatron_ext.registry.assumptions`).

Each fixes an upstream megatron-core bug under FSDP2, found by the layout matrix's
``fsdp2-dp2`` row (CPU harness) and present in megatron-core 0.17.1, 0.18.2 and 0.19.2 alike.
"""

from __future__ import annotations

from megatron_ext.common.versions import ALL, V17, V18, V19
from megatron_ext.fsdp.adapter import (
    TorchFsdpFeature,
    optimizer_ids_of_shards,
    params_norm_over_shards,
    restores_adam_step,
)
from megatron_ext.registry.patching import Patch, Variant

_TRAINING = "megatron.training.training"
_PG = "Optional[torch.distributed.distributed_c10d.ProcessGroup] = None"
_LOAD_0_18 = (
    "(ddp_model, optimizer, opt_param_scheduler, load_arg='load', strict=True, "
    f"checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group: {_PG}, "
    f"pp_group: {_PG}, dp_cp_group: {_PG}"
)

FSDP_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="fsdp2-global-params-norm",
        verified_on=ALL,
        target=f"{_TRAINING}:calc_params_l2_norm",
        signature="(model, force_create_fp32_copy=False)",
        wrap=params_norm_over_shards,
        feature=TorchFsdpFeature,
        reason="Under --use-torch-fsdp2 every parameter is a DTensor shard and Megatron's "
        "params norm (--log-params-norm, and the signals' params_norm) is the local shard's "
        "(13.98 for 19.78 at DP=2): the spike detector and the cause tree read it. The squares "
        "are added over the data-parallel shards; Megatron-FSDP's own path is left alone.",
    ),
    Patch(
        name="fsdp2-checkpoint-param-ids",
        verified_on=ALL,
        target="megatron.core.dist_checkpointing.optimizer:get_optim_param_to_id_map",
        signature="(optim_params_iter: Iterable[torch.nn.parameter.Parameter]) -> Dict[int, int]",
        wrap=optimizer_ids_of_shards,
        feature=TorchFsdpFeature,
        reason="Megatron matches optimizer parameters to the model's sharded tensors by "
        "id(to_local(param)); torch's to_local() of a Parameter(DTensor) is a fresh view "
        "(pytorch#166156), so under --use-torch-fsdp2 every torch_dist save raised 'Param id 0 "
        "does not match any model sharded param'. Each DTensor is also keyed by its own local "
        "tensor, the object the sharded state dict holds.",
    ),
    Patch(
        name="fsdp2-resume-adam-step",
        verified_on=V19,
        target=f"{_TRAINING}:load_checkpoint",
        signature=f"{_LOAD_0_18}, dp_group: {_PG}, expt_dp_group: {_PG}, "
        "rng_state_key_prefix: str = '')",
        wrap=restores_adam_step,
        feature=TorchFsdpFeature,
        reason="Under --use-torch-fsdp2 load_checkpoint loads the optimizer tensors in place "
        "and skips optimizer.load_state_dict, which alone restores the common Adam step: with "
        "torch's Adam (no Apex/TE) every resume died at its first step (KeyError: 'step'). The "
        "checkpoint's step is given back to each parameter.",
        variants=(
            Variant(
                V17 + V18,
                "No dp_group/expt_dp_group/rng_state_key_prefix parameters; the same skip.",
                signature=f"{_LOAD_0_18})",
            ),
        ),
    ),
)
