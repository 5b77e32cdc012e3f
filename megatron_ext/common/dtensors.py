"""Torch FSDP2's sharded tensors, as the overlay's sums read them (torch only, no Megatron): a
rank's local sum of squares is its part, the global value adds the parts over the groups the
tensors are sharded over (:func:`shard_groups`). For plain tensors every function is the identity.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_ext.common.errors import StartupError


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``tensor`` (``tensor`` itself when it is not a DTensor)."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def own_local(tensor: torch.Tensor) -> torch.Tensor | None:
    """The local tensor object a DTensor keeps (``_local_tensor``, the object megatron-core's
    ``make_sharded_tensor_for_checkpoint`` stores), None for a plain tensor. Not
    :func:`local`: torch's ``to_local()`` of a ``Parameter(DTensor)`` returns a fresh view
    since pytorch/pytorch#166156, so its ``id`` is no longer the stored object's."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else None


def shard_groups(tensors: Iterable[torch.Tensor]) -> list[Any]:
    """The process groups the DTensors among ``tensors`` are sharded over, one per sharded
    mesh dimension (replicated dimensions hold copies: nothing to add); [] without DTensors.
    Megatron shards every parameter over one mesh: two layouts are a refusal, not a guess."""
    layouts = {(t.device_mesh, tuple(t.placements)) for t in tensors if isinstance(t, DTensor)}
    if not layouts:
        return []
    if len(layouts) > 1:
        raise StartupError(
            f"the FSDP parameters are sharded {len(layouts)} different ways; megatron-ext's "
            "norms assume Megatron's one device mesh (re-verify megatron_ext.common.dtensors)"
        )
    mesh, placements = layouts.pop()
    return [mesh.get_group(dim) for dim, p in enumerate(placements) if p.is_shard()]


def sum_over_shards(sums: torch.Tensor, groups: list[Any]) -> torch.Tensor:
    """All-reduce (sum) ``sums`` in place over each of ``groups``; returns it."""
    for group in groups:
        dist.all_reduce(sums, group=group)
    return sums
