"""The torch FSDP2 feature: on with Megatron's own ``--use-torch-fsdp2``, no flag of its own.
Its registry patches (``fsdp2-*``) put right three megatron-core paths that read a ``DTensor``
shard as the whole parameter: the params norm, torch_dist's parameter ids, Adam's step on resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from megatron_ext.common import dtensors
from megatron_ext.common.features import Feature
from megatron_ext.common.files import checkpoint_dir


class TorchFsdpFeature(Feature):
    """Holds the run's args for the FSDP2 patches; on whenever ``--use-torch-fsdp2`` is."""

    name = "fsdp2"

    def __init__(self) -> None:
        self.args: Any = None

    def enabled(self, args: Any) -> bool:
        return bool(getattr(args, "use_torch_fsdp2", False))

    def install(self, args: Any) -> None:
        self.args = args


def params_norm_over_shards(
    original: Callable[..., float], feature: TorchFsdpFeature
) -> Callable[..., float]:
    """Wrapper of ``fsdp2-global-params-norm``."""

    def calc_params_l2_norm(model: Any, force_create_fp32_copy: bool = False) -> float:
        """Megatron's norm of this rank's shards (reduced over the model-parallel group), then
        the squares added over the data-parallel shards."""
        norm = original(model, force_create_fp32_copy)
        chunks = model if isinstance(model, list) else [model]
        groups = dtensors.shard_groups(p for chunk in chunks for p in chunk.parameters())
        squared = torch.tensor([norm * norm], dtype=torch.float64, device="cuda")
        return math.sqrt(dtensors.sum_over_shards(squared, groups).item())

    return calc_params_l2_norm


def optimizer_ids_of_shards(
    original: Callable[..., dict], feature: TorchFsdpFeature
) -> Callable[..., dict]:
    """Wrapper of ``fsdp2-checkpoint-param-ids``."""

    def get_optim_param_to_id_map(optim_params_iter: Any) -> dict[int, int]:
        """Megatron's map, plus each DTensor parameter keyed by the local tensor object it keeps
        (what ``make_sharded_tensor_for_checkpoint`` stores)."""
        params = list(optim_params_iter)
        mapping = original(params)
        for index, param in enumerate(params):
            shard = dtensors.own_local(param)
            if shard is not None:
                mapping.setdefault(id(shard), index)
        return mapping

    return get_optim_param_to_id_map


def restores_adam_step(
    original: Callable[..., Any], feature: TorchFsdpFeature
) -> Callable[..., Any]:
    """Wrapper of ``fsdp2-resume-adam-step``."""

    def load_checkpoint(
        ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, *a: Any, **kw: Any
    ) -> Any:
        """Megatron's load, then each optimizer parameter given the checkpoint's common Adam
        step (its own tensor: torch's Adam increments it in place) where the in-place load left
        a state without one (torch's Adam; TE/Apex Adam keep no per-parameter step)."""
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        result = original(ddp_model, optimizer, opt_param_scheduler, *a, **kw)
        parts = getattr(optimizer, "chained_optimizers", [])
        missing = [
            part
            for part in parts
            if any("exp_avg" in s and "step" not in s for s in part.optimizer.state.values())
        ]
        load_dir = getattr(feature.args, kw.get("load_arg", a[0] if a else "load"), None)
        if not missing or not load_dir:
            return result
        common = load_common_state_dict(str(checkpoint_dir(load_dir, result[0])))
        saved = common.get("optimizer") or {}
        states = [saved] if len(parts) == 1 else [saved.get(i, {}) for i in range(len(parts))]
        for part, state in zip(parts, states):
            step = state.get("state", {}).get("common_step")
            for param_state in part.optimizer.state.values() if part in missing else ():
                if step is not None and "step" not in param_state:
                    param_state["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        return result

    return load_checkpoint
