"""Per-bucket gradient norms: which gradient ranges make each DDP bucket, their fused norm, and
which slots each grad-stats group reduces. No Megatron imports (the adapter passes Megatron's
parameter filters in).

Σ bucket² must equal Megatron's grad-norm², so a bucket is measured over exactly what
Megatron's norm counts on this rank (its distributed-optimizer shard, no TP duplicates, no
shared embedding copy) and reduced over the group Megatron reduces that parameter's norm over.
Each group gets one all-reduce of a slot vector in which every owner of distinct buckets (a
pipeline stage; for experts, a stage and an EP rank) has its own slots, so ranks sharing an
owner's buckets (TP peers, optimizer shards, expert-DP replicas) sum into the same slots.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Megatron's filter of what its grad norm counts on this rank, for one parameter.
Counted = Callable[[torch.Tensor], bool]

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class BucketView:
    """The gradient views of one bucket that this rank's share of the global norm counts."""

    name: str
    segments: tuple[torch.Tensor, ...]


@dataclass
class Reduction:
    """Bucket slots all-reduced over one grad-stats group: every owner's buckets, in order;
    ``parts`` places this rank's buckets as (first local bucket, count, first slot)."""

    group: Any
    names: list[str]
    parts: list[tuple[int, int, int]]


def bucket_name(index: int, param_names: list[str]) -> str:
    """A stable label, the same on every DP rank and restart: index, layer span and first/last
    parameter, e.g. ``b0:layers0-1[decoder.layers.1.mlp.linear_fc2.weight..output_layer.weight]``.
    """
    short = [n.removeprefix("module.").removeprefix("module.") for n in param_names]
    layers = sorted({int(m.group(1)) for n in short if (m := _LAYER.search(n))})
    span = f"layers{layers[0]}-{layers[-1]}" if layers else "no-layers"
    return f"b{index}:{span}[{short[0]}..{short[-1]}]"


def layer_paths(modules: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Stage-local layer module paths -> global ones, from ``named_modules()``: a layer is a
    module at ``...layers.<i>`` with an int ``layer_number`` (1-based, offset included)."""
    paths = {}
    for name, module in modules:
        head, _, index = name.rpartition(".")
        number = getattr(module, "layer_number", None)
        if head.endswith("layers") and index.isdigit() and isinstance(number, int):
            paths[name] = f"{head}.{number - 1}"
    return paths


def global_layer_name(name: str, layer_paths: dict[str, str]) -> str:
    """``name`` with its stage-local layer path (``named_parameters()`` numbers layers per
    pipeline stage and virtual chunk) replaced by the global one."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        local = ".".join(parts[:end])
        if local in layer_paths:
            return layer_paths[local] + name[len(local) :]
    return name


def clip_range(start: int, end: int, lo: int, hi: int) -> tuple[int, int] | None:
    """Intersect ``[start, end)`` with the shard ``[lo, hi)``; ``None`` when disjoint."""
    a, b = max(start, lo), min(end, hi)
    return (a, b) if a < b else None


class BucketNormer:
    """Every bucket's squared norm with one fused ``_foreach_norm`` per step (fp32 per
    segment, fp64 sums, as Megatron's norm; no gradient copy). The segment → bucket index is
    built once: a host-to-device copy per step would synchronise the GPU."""

    def __init__(self, views: list[BucketView]) -> None:
        self.count = len(views)
        self.segments = [s for v in views for s in v.segments]
        device = self.segments[0].device if self.segments else torch.device("cpu")
        self.owner = torch.tensor(
            [i for i, v in enumerate(views) for _ in v.segments], dtype=torch.long, device=device
        )

    def __call__(self) -> torch.Tensor:
        totals = torch.zeros(self.count, dtype=torch.float64, device=self.owner.device)
        if not self.segments:
            return totals
        per_segment = torch.stack(torch._foreach_norm(self.segments)).double().square()
        return totals.index_add_(0, self.owner, per_segment)


def squared_norms(views: list[BucketView]) -> torch.Tensor:
    """One-shot form of :class:`BucketNormer`."""
    return BucketNormer(views)()


def is_expert(param: torch.Tensor) -> bool:
    """Megatron marks expert-parallel parameters ``allreduce=False`` (the optimizer copies the
    mark onto its main parameters)."""
    return not getattr(param, "allreduce", True)


def bucket_views(
    chunks: Iterable[Any], counted: Counted, not_shared: Counted
) -> dict[bool, list[BucketView]]:
    """This rank's dense (False) and expert (True) bucket views of the DDP model ``chunks``.
    ``counted``: Megatron's grad-norm filter; ``not_shared``: its shared-copy filter alone (a
    bucket of only a shared copy is left out: it is counted where the original lives)."""
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
    """Every owner's bucket names over ``group`` and where this rank's owner starts."""
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
    """This rank's counted optimizer (main) parameters per grad-stats group;
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
