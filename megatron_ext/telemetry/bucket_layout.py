"""Which gradient ranges make each DDP bucket, and which slots each grad-stats group reduces
(no Megatron imports: the DDP and optimizer objects are read through their attributes, and
Megatron's parameter filters are passed in by the adapter).

Why a layout at all: Σ bucket² must equal Megatron's grad-norm², so a bucket is measured over
exactly what Megatron's norm counts on this rank (the bucket's own distributed-optimizer shard,
no tensor-parallel duplicates, no shared embedding copy), and the squares are reduced over the
group Megatron reduces that kind of parameter's norm over (its grad-stats group: TP x PP for
dense parameters under DDP, expert TP x EP x PP for MoE experts, the whole distributed-optimizer
instance with ``--use-distributed-optimizer``). Each group gets one all-reduce of a slot vector
in which every owner of a distinct set of buckets (a pipeline stage; for experts, a stage and
an expert-parallel rank) has its own slots, so ranks that share an owner's buckets (TP peers,
optimizer shards, expert-DP replicas under DDP) sum their parts into the same slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.telemetry.bucket_norms import (
    BucketView,
    bucket_name,
    clip_range,
    global_layer_name,
    layer_paths,
)

# Megatron's filter of what its grad norm counts on this rank, for one parameter.
Counted = Callable[[torch.Tensor], bool]


@dataclass
class Reduction:
    """Bucket slots all-reduced over one grad-stats group: every owner's buckets, in order.

    ``parts`` places this rank's buckets: (first local bucket, count, first slot).
    """

    group: Any
    names: list[str]
    parts: list[tuple[int, int, int]]


def is_expert(param: torch.Tensor) -> bool:
    """Megatron marks expert-parallel parameters ``allreduce=False`` (reduced over expert DP);
    the optimizer copies the mark onto its main parameters."""
    return not getattr(param, "allreduce", True)


def bucket_views(
    chunks: Iterable[Any], counted: Counted, not_shared: Counted
) -> dict[bool, list[BucketView]]:
    """This rank's dense (False) and expert (True) bucket views of the DDP model ``chunks``,
    named with global layer numbers.

    ``counted`` is Megatron's grad-norm filter for a parameter on this rank; ``not_shared``
    its shared-copy filter alone (a bucket holding only a shared copy is left out: its
    gradient is counted where the original lives).
    """
    views: dict[bool, list[BucketView]] = {False: [], True: []}
    for chunk in chunks:
        paths = layer_paths(chunk.named_modules())
        names_of = {p: global_layer_name(n, paths) for n, p in chunk.named_parameters()}
        kinds = ((False, chunk.bucket_groups), (True, chunk.expert_parallel_bucket_groups))
        for expert, bucket_groups in kinds:
            for group in bucket_groups:
                sharded = group.ddp_config.use_distributed_optimizer
                size = group.intra_distributed_optimizer_instance_size if sharded else 1
                rank = group.intra_distributed_optimizer_instance_rank if sharded else 0
                for bucket in group.buckets:
                    shard = bucket.grad_data.numel() // size
                    lo, hi = rank * shard, (rank + 1) * shard
                    ordered = sorted(bucket.params_list, key=lambda p: bucket.param_to_index[p])
                    if not any(map(not_shared, ordered)):
                        continue  # only a shared copy: its gradient is counted elsewhere
                    segments = tuple(
                        bucket.grad_data[r[0] : r[1]]
                        for p in ordered
                        if counted(p)
                        if (r := clip_range(*bucket.param_to_index[p], lo, hi)) is not None
                    )
                    name = bucket_name(len(views[expert]), [names_of[p] for p in ordered])
                    views[expert].append(BucketView(name=name, segments=segments))
    return views


def grad_stats_groups(optimizers: Iterable[Any], has_experts: bool) -> dict[bool, Any]:
    """The group Megatron reduces each kind of parameter's norm over (expert: True), from the
    parts of a ChainedOptimizer."""
    groups: dict[bool, Any] = {}
    for opt in optimizers:
        for param in opt.get_parameters():
            groups.setdefault(is_expert(param), opt.get_grad_stats_parallel_group())
    if has_experts and True not in groups:
        raise RuntimeError(
            "megatron-ext --log-bucket-grad-norms: this pipeline stage has no expert "
            "parameters while the model has experts; bucket norms need MoE layers on "
            "every stage"
        )
    return groups


def gather_slots(
    names: list[str], owner: tuple[int, ...], label: str, group: Any
) -> tuple[list[str], int]:
    """Every owner's bucket names over ``group`` and where this rank's start.

    An owner is what holds a distinct set of buckets (a pipeline stage; for experts, a
    stage and an expert-parallel rank). Ranks of one owner (TP peers, distributed-optimizer
    shards, expert-DP replicas under DDP) share its slots: the all-reduce sums their parts.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (owner, label, names), group=group)
    by_owner: dict[tuple[int, ...], tuple[str, list[str]]] = {}
    for key, prefix, found in gathered:
        if by_owner.setdefault(tuple(key), (prefix, found)) != (prefix, found):
            raise RuntimeError(
                f"megatron-ext telemetry: ranks of {prefix or 'one stage'} disagree on its "
                "gradient buckets; re-verify megatron_ext.telemetry.adapter"
            )
    order = sorted(by_owner)
    offset = sum(len(by_owner[o][1]) for o in order[: order.index(owner)])
    return [prefix + n for o in order for prefix, found in [by_owner[o]] for n in found], offset


def assign_slots(
    views: dict[bool, list[BucketView]],
    groups: dict[bool, Any],
    stage: int,
    staged: bool,
    expert_rank: int,
) -> list[Reduction]:
    """One :class:`Reduction` per distinct grad-stats group, with every owner's slot names
    (prefixed ``pp<stage>.`` when pipelined, ``ep<rank>.`` for experts) and where this rank's
    dense and expert buckets (in :func:`bucket_views` order, dense first) go in it."""
    reductions: list[Reduction] = []
    first_local = 0
    for expert in sorted(groups):
        owner = (stage, expert_rank) if expert else (stage,)
        label = (f"pp{stage}." if staged else "") + (f"ep{owner[-1]}." if expert else "")
        names, offset = gather_slots([v.name for v in views[expert]], owner, label, groups[expert])
        reduction = next((r for r in reductions if r.group is groups[expert]), None)
        if reduction is None:
            reduction = Reduction(groups[expert], [], [])
            reductions.append(reduction)
        count = len(views[expert])
        reduction.parts.append((first_local, count, len(reduction.names) + offset))
        reduction.names += names
        first_local += count
    return reductions


def params_by_group(
    optimizers: Iterable[Any], counted: Callable[[torch.Tensor, Any], bool]
) -> list[tuple[Any, list[torch.Tensor]]]:
    """This rank's optimizer (main) parameters that the global norms count once, per
    grad-stats group (dense and expert parameters may reduce over different groups);
    ``counted(param, optimizer_part)`` is Megatron's grad-norm filter."""
    sets: list[tuple[Any, list[torch.Tensor]]] = []
    for opt in optimizers:
        group = opt.get_grad_stats_parallel_group()
        params = [p for p in opt.get_parameters() if counted(p, opt)]
        found = next((ps for g, ps in sets if g is group), None)
        if found is None:
            sets.append((group, params))
        else:
            found.extend(params)
    return sets
