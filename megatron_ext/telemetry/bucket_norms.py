"""Per-bucket gradient norms over contiguous gradient buffers (no Megatron imports).

Why per bucket: a global grad norm says *that* something blew up; the bucket (a contiguous
run of layers) says *where*. A bucket's norm is computed over the views of its contiguous
``grad_data`` that the global norm counts on this rank (its parameters, or the parts of them
inside this rank's distributed-optimizer shard, minus tensor-parallel duplicates and shared
embedding copies), so Σ bucket_norm² equals Megatron's grad-norm²; a bucket that holds only a
shared copy (the tied embedding's on the last pipeline stage, whose gradient is the
embedding's) is not listed. Names carry global layer numbers. All segments of all buckets
go through one fused ``torch._foreach_norm`` (per-segment fp32 norms, like Megatron's own
norm), summed per bucket in fp64: no copy of the gradients is made.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class BucketView:
    """The gradient views of one bucket that this rank's share of the global norm counts."""

    name: str
    segments: tuple[torch.Tensor, ...]


def bucket_name(index: int, param_names: list[str]) -> str:
    """A stable, readable label: bucket index, layer span and first/last parameter.

    Example: ``b0:layers0-1[decoder.layers.1.mlp.linear_fc2.weight..output_layer.weight]``.
    Names come from the model's parameter names, so they are identical on every DP rank and
    across restarts with the same model config.
    """
    short = [n.removeprefix("module.").removeprefix("module.") for n in param_names]
    layers = sorted({int(m.group(1)) for n in short if (m := _LAYER.search(n))})
    span = f"layers{layers[0]}-{layers[-1]}" if layers else "no-layers"
    return f"b{index}:{span}[{short[0]}..{short[-1]}]"


def layer_paths(modules: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Stage-local layer module paths -> global ones, from ``named_modules()``: a layer is a
    module at ``...layers.<i>`` with an int ``layer_number`` (1-based, and Megatron includes
    the stage's and virtual chunk's offset in it)."""
    paths = {}
    for name, module in modules:
        head, _, index = name.rpartition(".")
        number = getattr(module, "layer_number", None)
        if head.endswith("layers") and index.isdigit() and isinstance(number, int):
            paths[name] = f"{head}.{number - 1}"
    return paths


def global_layer_name(name: str, layer_paths: dict[str, str]) -> str:
    """``name`` with its stage-local layer path replaced by the global one.

    ``named_parameters()`` numbers layers within a pipeline stage (and virtual chunk): global
    layer 3 on the second of two 2-layer stages is ``decoder.layers.1``. ``layer_paths`` maps
    such local module paths to global ones (``decoder.layers.1`` -> ``decoder.layers.3``), so
    a bucket's name says which layers of the model it holds, whatever the layout.
    """
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
    """Computes every bucket's squared norm with one fused ``_foreach_norm`` per step.

    The segment list and the segment → bucket index are built once (a host-to-device copy
    per step would synchronise the GPU).
    """

    def __init__(self, views: list[BucketView]) -> None:
        self.count = len(views)
        self.segments = [s for v in views for s in v.segments]
        device = self.segments[0].device if self.segments else torch.device("cpu")
        self.owner = torch.tensor(
            [i for i, v in enumerate(views) for _ in v.segments], dtype=torch.long, device=device
        )

    def __call__(self) -> torch.Tensor:
        """Squared L2 norm of each bucket (fp64 sums of per-segment fp32 norms)."""
        device = self.owner.device
        totals = torch.zeros(self.count, dtype=torch.float64, device=device)
        if not self.segments:
            return totals
        per_segment = torch.stack(torch._foreach_norm(self.segments)).double().square()
        return totals.index_add_(0, self.owner, per_segment)


def squared_norms(views: list[BucketView]) -> torch.Tensor:
    """One-shot convenience form of :class:`BucketNormer`."""
    return BucketNormer(views)()
