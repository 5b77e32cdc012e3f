"""Bucket norms and the update ratio under torch FSDP2, no Megatron imports: each
``fully_shard`` unit (registry assumption ``fsdp2-units``) plays the bucket, its norm summed
over the shards' mesh group and then the grad-stats group. Under DDP these are plain sums.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from megatron_ext.common import dtensors
from megatron_ext.telemetry.bucket_layout import (
    BucketView,
    Counted,
    SlotNormer,
    bucket_name,
    global_layer_name,
    layer_paths,
)
from megatron_ext.telemetry.layers import layer_of, local_layers, segment_owners


def is_fully_sharded(chunks: Iterable[Any]) -> bool:
    """Whether ``chunks`` were wrapped by torch FSDP2 (they hold ``fully_shard`` units)."""
    return any(isinstance(m, FSDPModule) for chunk in chunks for m in chunk.modules())


class UnitNormer(SlotNormer):
    """Each FSDP unit's squared gradient norm over its local shards, summed over the shard
    group; with ``names`` (each unit's parameter names), also per-layer slots. FSDP2 gives a
    parameter a new ``.grad`` after ``zero_grad``: gradients are read each call."""

    def __init__(
        self,
        units: list[list[torch.Tensor]],
        counted: Counted,
        holders: dict[int, torch.Tensor],
        names: list[list[str]] | None = None,
    ) -> None:
        self.groups = dtensors.shard_groups(p for params in units for p in params)
        kept = [
            (i, holders.get(id(p), p), layer_of(names[i][j]) if names else "")
            for i, params in enumerate(units)
            for j, p in enumerate(params)
            if counted(p) and dtensors.local(p).numel()
        ]
        self.params = [p for _, p, _ in kept]  # the tensors Megatron's norm reads
        self.layers = local_layers({False: (layer_of(n) for ns in names or [] for n in ns)})
        layers = segment_owners([(False, n) for *_, n in kept], self.layers) if names else None
        self.device = next((p.device for params in units for p in params), torch.device("cpu"))
        super().__init__([i for i, _, _ in kept], len(units), layers)

    def grads(self) -> list[torch.Tensor]:
        """Each parameter's local gradient; none this step: an empty one (norm 0)."""
        return [
            dtensors.local(p).new_zeros(0) if p.grad is None else dtensors.local(p.grad)
            for p in self.params
        ]

    def weights(self) -> list[torch.Tensor]:
        return [dtensors.local(p.detach()) for p in self.params]

    def __call__(self, loss_scale: Any = 1.0) -> torch.Tensor:
        return dtensors.sum_over_shards(super().__call__(loss_scale), self.groups)


def main_params(parts: Iterable[Any]) -> dict[int, torch.Tensor]:
    """Model parameter id -> its fp32 main parameter where a part keeps one (Float16Optimizer,
    registry ``float16-main-params``): its gradient is the one Megatron's norm reads."""
    return {
        id(model): main
        for part in parts
        for models, mains in zip(
            getattr(part, "float16_groups", ()), getattr(part, "fp32_from_float16_groups", ())
        )
        for model, main in zip(models, mains)
    }


def fsdp_units(
    chunks: Iterable[Any], counted: Counted, parts: Iterable[Any], layers: bool = False
) -> tuple[list[BucketView], UnitNormer]:
    """One named view per FSDP unit holding parameters (in module order), and their normer
    (``layers``: with per-layer slots). A parameter belongs to the innermost ``fully_shard``
    module above it; a unit is listed whatever ``counted`` says (TP ranks must name the same
    units)."""
    units: list[list[torch.Tensor]] = []
    unit_names: list[list[str]] = []
    views: list[BucketView] = []
    for chunk in chunks:
        paths = layer_paths(chunk.named_modules())
        owner: dict[int, str] = {}
        for module_name, module in chunk.named_modules():  # parents first: inner units win
            if isinstance(module, FSDPModule):
                owner |= {id(p): module_name for p in module.parameters()}
        members: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, param in chunk.named_parameters():
            members.setdefault(owner.get(id(param), ""), []).append((name, param))
        for found in members.values():
            names = [global_layer_name(n, paths) for n, _ in found]
            views.append(BucketView(name=bucket_name(len(views), names), segments=()))
            units.append([p for _, p in found])
            unit_names.append(names)
    return views, UnitNormer(units, counted, main_params(parts), unit_names if layers else None)


def snapshot(sets: list[tuple[Any, list[torch.Tensor]]]) -> list[list[torch.Tensor]]:
    """An fp32 copy of this rank's part of each set's parameters (for the update ratio)."""
    return [[dtensors.local(p.detach()).float().clone() for p in ps] for _, ps in sets]


def update_ratio(
    sets: list[tuple[Any, list[torch.Tensor]]],
    before: list[list[torch.Tensor]],
    riders: list[tuple[Any, torch.Tensor]] = (),
) -> float | None:
    """||Δθ|| / ||θ|| over the whole model: per (grad-stats group, counted parameters) set,
    fused norms of this rank's part, summed over the shard group and then the set's group.
    ``riders`` (group, local sums): summed in place in their group's all-reduce."""
    delta = norm = 0.0
    for (group, params), old in zip(sets, before):
        current = [dtensors.local(p.detach()).float() for p in params]
        device = current[0].device if current else torch.device("cpu")
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        if current:
            deltas = torch._foreach_sub(current, old)
            for row, tensors in enumerate((deltas, current)):
                sums[row] = torch.stack(torch._foreach_norm(tensors)).double().square().sum()
        mine = [t for g, t in riders if g is group]
        sums = torch.cat([sums, *(t.to(device) for t in mine)])
        dtensors.sum_over_shards(sums, dtensors.shard_groups(params))
        dist.all_reduce(sums, group=group)
        for tensor, part in zip(mine, sums[2:].split([len(t) for t in mine])):
            tensor.copy_(part)
        delta, norm = delta + sums[0].item(), norm + sums[1].item()
    return math.sqrt(delta) / math.sqrt(norm) if norm > 0 else None
