"""Per-bucket gradient norms: which gradient ranges make each DDP bucket, their fused norm, and
which slots each grad-stats group reduces, so that Σ bucket² = grad-norm². No Megatron imports.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.telemetry.layers import layer_of, local_layers, segment_owners, slot_names

# Megatron's filter of what its grad norm counts on this rank, for one parameter.
Counted = Callable[[torch.Tensor], bool]
# A parameter's fp32 main copy and whether it is this rank's shard of the bucket range (None:
# the parameter is its own main copy).
MainOf = Callable[[torch.Tensor], tuple[torch.Tensor, bool] | None]

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class BucketView:
    """The gradient views of one bucket that this rank's share of the global norm counts;
    per segment, its layer entry and the weights' view (:mod:`.layers`); ``members``: the
    layer entries of every parameter of the bucket (the same on every rank of its owner)."""

    name: str
    segments: tuple[torch.Tensor, ...]
    layers: tuple[str, ...] = ()
    weights: tuple[torch.Tensor, ...] = ()
    members: tuple[str, ...] = ()


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


class SlotNormer:
    """Squared norms of gradient pieces with one fused ``_foreach_norm``, index-added into each
    piece's unit slot (a DDP bucket, an FSDP unit) and, with ``layers``, its layer's gradient
    and weight slots; the index is built once (a per-step copy to the device would sync).
    Subclasses set ``device`` and say where the pieces' gradients and weights are."""

    grad_dtype: torch.dtype | None = torch.float32  # None: each gradient's own dtype
    device: torch.device

    def grads(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def weights(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def __init__(
        self, units: list[int], count: int, layers: tuple[list[int], list[int], int] | None
    ) -> None:
        grads, weights, size = layers or ([], [], 0)
        self.size = count + size
        self.pieces = len(units)
        self.by_layer = bool(grads)
        owners = units + [count + i for i in grads]
        self.owner = torch.tensor(owners, dtype=torch.long, device=self.device)
        self.weight_owner = torch.tensor(
            [count + i for i in weights], dtype=torch.long, device=self.device
        )

    def __call__(self, loss_scale: Any = 1.0) -> torch.Tensor:
        """Squared norms: the units', then the layer slots; gradients unscaled by
        ``loss_scale`` (fp16 gradients are scaled; a tensor keeps it on device)."""
        totals = torch.zeros(self.size, dtype=torch.float64, device=self.device)
        if self.pieces:
            scale = torch.as_tensor(loss_scale).to(self.device, torch.float64)
            norms = torch.stack(torch._foreach_norm(self.grads(), 2, dtype=self.grad_dtype))
            squares = norms.double().square() / (scale * scale)
            totals.index_add_(0, self.owner, squares.repeat(2) if self.by_layer else squares)
        if self.by_layer:
            norms = torch._foreach_norm(self.weights(), 2, dtype=torch.float32)
            totals.index_add_(0, self.weight_owner, torch.stack(norms).double().square())
        return totals

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the pieces' weights, for :meth:`update_squares` after the step
        (allocated per step: it is not held through the next forward and backward)."""
        return [w.clone() for w in self.weights()] if self.by_layer else []

    def update_squares(self, before: list[torch.Tensor]) -> torch.Tensor:
        """Each layer's ||Δw||² since ``before`` (a :meth:`snapshot`, consumed: the
        difference is taken in place) in its gradient slot (the rest 0)."""
        totals = torch.zeros(self.size, dtype=torch.float64, device=self.device)
        if self.by_layer:
            torch._foreach_sub_(before, self.weights())
            norms = torch._foreach_norm(before, 2, dtype=torch.float32)
            totals.index_add_(0, self.owner[self.pieces :], torch.stack(norms).double().square())
        return totals


class BucketNormer(SlotNormer):
    """Every DDP bucket's squared norm from its segments (views of ``grad_data``)."""

    grad_dtype = None

    def __init__(
        self, views: list[BucketView], layers: tuple[list[int], list[int], int] | None = None
    ) -> None:
        self.segments = [s for v in views for s in v.segments]
        self.segment_weights = [w for v in views for w in v.weights] if layers else []
        self.device = self.segments[0].device if self.segments else torch.device("cpu")
        owners = [i for i, v in enumerate(views) for _ in v.segments]
        super().__init__(owners, len(views), layers)

    def grads(self) -> list[torch.Tensor]:
        return self.segments

    def weights(self) -> list[torch.Tensor]:
        return self.segment_weights


def squared_norms(views: list[BucketView]) -> torch.Tensor:
    """One-shot form of :class:`BucketNormer`."""
    return BucketNormer(views)()


def bucket_views(
    chunks: Iterable[Any], counted: Counted, not_shared: Counted, main_of: MainOf | None = None
) -> dict[bool, list[BucketView]]:
    """This rank's dense (False) and expert (True) bucket views of the DDP model ``chunks``.
    ``counted``: Megatron's grad-norm filter; ``not_shared``: its shared-copy filter alone (a
    bucket of only a shared copy is left out: it is counted where the original lives);
    ``main_of``: a parameter's fp32 main copy where the optimizer keeps one (for weights)."""
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
                    ranges = [
                        (p, r)
                        for p in ordered
                        if counted(p)
                        if (r := clip_range(*bucket.param_to_index[p], lo, hi)) is not None
                    ]
                    name = bucket_name(len(views[expert]), [names_of[p] for p in ordered])
                    view = BucketView(
                        name=name,
                        segments=tuple(bucket.grad_data[a:b] for _, (a, b) in ranges),
                        layers=tuple(layer_of(names_of[p]) for p, _ in ranges),
                        weights=tuple(
                            _weights(p, r, bucket.param_to_index[p][0], main_of) for p, r in ranges
                        ),
                        members=tuple(layer_of(names_of[p]) for p in ordered if not_shared(p)),
                    )
                    views[expert].append(view)
    return views


def _weights(
    param: torch.Tensor, span: tuple[int, int], start: int, main_of: MainOf | None
) -> torch.Tensor:
    """The weights the optimizer updates for ``param``'s bucket range ``span`` (``start``:
    where the parameter begins): its main copy's (a shard of exactly ``span``, or the whole
    parameter's), else the parameter's own."""
    main = main_of(param) if main_of is not None else None
    tensor, sharded = main or (param, False)
    if not sharded:
        return tensor.detach().view(-1)[span[0] - start : span[1] - start]
    if tensor.numel() != span[1] - span[0]:
        raise RuntimeError(
            "megatron-ext telemetry: a main parameter shard does not match its gradient range "
            f"({tensor.numel()} != {span[1] - span[0]}); re-verify registry distopt-main-param"
        )
    return tensor.detach().view(-1)


def layer_layout(
    views: dict[bool, list[BucketView]],
) -> tuple[dict[bool, list[str]], tuple[list[int], list[int], int]]:
    """Each kind's layer entries (from every parameter: ranks of an owner agree) and the
    segments' slots in the local layer vector, for :class:`BucketNormer`."""
    layers = local_layers({k: (n for v in vs for n in v.members) for k, vs in views.items()})
    kinds = [(k, n) for k in sorted(views) for v in views[k] for n in v.layers]
    return layers, segment_owners(kinds, layers)


def grad_stats_groups(optimizers: Iterable[Any], has_experts: bool) -> dict[bool, Any]:
    """The group Megatron reduces each kind of parameter's norm over (expert: True), from the
    parts of a ChainedOptimizer. Megatron marks expert-parallel parameters ``allreduce=False``
    (the optimizer copies the mark onto its main parameters)."""
    groups: dict[bool, Any] = {}
    for opt in optimizers:
        for param in opt.get_parameters():
            expert = not getattr(param, "allreduce", True)
            groups.setdefault(expert, opt.get_grad_stats_parallel_group())
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
    layers: dict[bool, list[str]] | None = None,
) -> list[Reduction]:
    """One :class:`Reduction` per distinct grad-stats group, with every owner's slot names
    (prefixed ``pp<stage>.`` when pipelined, ``ep<rank>.`` for experts) and where this rank's
    dense and expert buckets (in :func:`bucket_views` order, dense first) go in it; then,
    with ``layers``, every owner's layer slots (global names, :func:`.layers.slot_names`)."""
    reductions: dict[Any, Reduction] = {}  # by group (process groups compare by identity)
    local = {k: [v.name for v in vs] for k, vs in views.items()}
    first_local = _place(reductions, local, groups, stage, expert_rank, staged, 0)
    if layers is not None:
        named = {k: slot_names(layers.get(k, [])) for k in views}
        _place(reductions, named, groups, stage, expert_rank, None, first_local)
    return list(reductions.values())


def _place(
    reductions: dict[Any, Reduction],
    local: dict[bool, list[str]],
    groups: dict[bool, Any],
    stage: int,
    expert_rank: int,
    staged: bool | None,
    first_local: int,
) -> int:
    """Add each kind's slots (``staged`` None: unlabelled, for names already global) to its
    group's reduction; returns the next local index."""
    for expert in sorted(groups):
        owner = (stage, expert_rank) if expert else (stage,)
        label = f"pp{stage}." if staged else ""
        label += f"ep{expert_rank}." if expert and staged is not None else ""
        names, offset = gather_slots(local[expert], owner, label, groups[expert])
        reduction = reductions.setdefault(groups[expert], Reduction(groups[expert], [], []))
        count = len(local[expert])
        reduction.parts.append((first_local, count, len(reduction.names) + offset))
        reduction.names += names
        first_local += count
    return first_local


def params_by_group(
    optimizers: Iterable[Any], counted: Callable[[torch.Tensor, Any], bool]
) -> list[tuple[Any, list[torch.Tensor]]]:
    """This rank's counted optimizer (main) parameters per grad-stats group;
    ``counted(param, optimizer_part)`` is Megatron's grad-norm filter."""
    sets: dict[Any, list[torch.Tensor]] = {}  # by group, as in assign_slots
    for opt in optimizers:
        params = [p for p in opt.get_parameters() if counted(p, opt)]
        sets.setdefault(opt.get_grad_stats_parallel_group(), []).extend(params)
    return list(sets.items())
