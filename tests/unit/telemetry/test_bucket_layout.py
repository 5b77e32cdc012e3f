"""The bucket layout (megatron_ext.telemetry.bucket_layout) on megatron-core's real
DistributedDataParallel over two gloo ranks, without a launch: which gradient ranges each
bucket view holds (whole buckets under DDP, this rank's shard under the distributed
optimizer), that the views' squares add up to the whole gradient's, and how the reduction
slots of several owners are laid out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from megatron_ext.telemetry.bucket_layout import (
    BucketNormer,
    BucketView,
    assign_slots,
    bucket_views,
    global_layer_name,
    layer_layout,
    layer_paths,
    squared_norms,
)
from megatron_ext.telemetry.layers import layer_of, slot_names, split_slots

HIDDEN = 8
LAYERS = 4
FIRST_LAYER_NUMBER = 3  # as on a later pipeline stage: global layers 2.. (1-based number 3..)


class _Layer(torch.nn.Module):
    def __init__(self, number: int) -> None:
        super().__init__()
        self.layer_number = number  # what Megatron's TransformerLayer carries (global, 1-based)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)


class _Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(FIRST_LAYER_NUMBER + i) for i in range(LAYERS)])


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = _Decoder()
        self.output_layer = torch.nn.Linear(HIDDEN, 5, bias=False)


def _ddp(distributed_optimizer: bool) -> Any:
    """A real megatron-core DDP chunk with several buckets (small bucket size)."""
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=1)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=True,  # keeps bucket_size: several buckets
        bucket_size=2 * HIDDEN * HIDDEN,
    )
    chunk = DistributedDataParallel(config, ddp_config, _Model())
    generator = torch.Generator().manual_seed(1)  # the same known gradient on every rank
    for bucket in _buckets(chunk):
        bucket.grad_data.copy_(torch.randn(bucket.grad_data.numel(), generator=generator))
    return chunk


def _buckets(chunk: Any) -> list[Any]:
    return [b for group in chunk.bucket_groups for b in group.buckets]


def _whole_norm_sq(chunk: Any, skip: torch.Tensor | None = None) -> float:
    return sum(
        float(p.main_grad.double().square().sum())
        for p in chunk.module.parameters()
        if p is not skip
    )


def _check_views(rank: int) -> None:
    # DDP: every rank's views hold whole buckets, so its squares are the whole gradient's.
    chunk = _ddp(distributed_optimizer=False)
    views = bucket_views([chunk], counted=lambda p: True, not_shared=lambda p: True)
    names = [v.name for v in views[False]]
    # Global layer numbers (this chunk holds layers 2-5), in Megatron's reverse bucket order.
    assert views[True] == [] and names == [
        "b0:layers4-5[output_layer.weight..decoder.layers.4.fc.weight]",
        "b1:layers2-3[decoder.layers.3.fc.bias..decoder.layers.2.fc.weight]",
    ], names
    total = float(squared_norms(views[False]).sum())
    assert total == pytest.approx(_whole_norm_sq(chunk), rel=1e-6)
    # A parameter Megatron's norm does not count on this rank (a TP duplicate) is left out.
    skip = chunk.module.output_layer.weight
    fewer = bucket_views([chunk], counted=lambda p: p is not skip, not_shared=lambda p: True)
    assert float(squared_norms(fewer[False]).sum()) == pytest.approx(
        _whole_norm_sq(chunk, skip=skip), rel=1e-6
    )
    # A bucket holding only shared copies (the tied embedding on the last stage) is dropped.
    only = {id(p) for p in _buckets(chunk)[0].params_list}
    dropped = bucket_views([chunk], counted=lambda p: True, not_shared=lambda p: id(p) not in only)
    assert [v.name[v.name.index(":") :] for v in dropped[False]] == [
        n[n.index(":") :] for n in names[1:]
    ]

    # Distributed optimizer: each rank's views lie in its own shard; the two ranks' squares
    # add up to the whole gradient's (the all-reduce telemetry does over the DP group).
    chunk = _ddp(distributed_optimizer=True)
    views = bucket_views([chunk], counted=lambda p: True, not_shared=lambda p: True)
    for bucket in _buckets(chunk):
        base, size = bucket.grad_data.storage_offset(), bucket.grad_data.numel()
        lo, hi = rank * (size // 2), (rank + 1) * (size // 2)
        for segment in (s for v in views[False] for s in v.segments):
            start = segment.storage_offset() - base
            if 0 <= start < size:  # a segment of this bucket
                assert lo <= start and start + segment.numel() <= hi, (rank, start, lo, hi)
    local = squared_norms(views[False]).sum().reshape(1)
    dist.all_reduce(local)
    assert float(local) == pytest.approx(_whole_norm_sq(chunk), rel=1e-6)
    _check_layers(chunk, views)


def _check_layers(chunk: Any, views: dict) -> None:
    """Per layer, over the distributed optimizer's shards: both ranks list every layer (the
    slots they share), and their slots add up to each layer's whole gradient and weights."""
    layers, owners = layer_layout(views)
    expected = [f"decoder.layers.{i}" for i in range(2, 6)] + ["output_layer"]
    assert layers == {False: expected, True: []}, layers
    local = BucketNormer(views[False], owners)()
    dist.all_reduce(local)
    buckets, grads, weights = split_slots(
        [v.name for v in views[False]] + slot_names(layers[False]), local.tolist()
    )
    assert sum(grads.values()) == pytest.approx(sum(buckets.values()), rel=1e-9)
    paths = layer_paths(chunk.named_modules())  # stage-local layer i is global i + 2
    expected: tuple[dict, dict] = ({}, {})
    for name, param in chunk.named_parameters():
        entry = layer_of(global_layer_name(name, paths))
        for sums, tensor in zip(expected, (param.main_grad, param.detach())):
            sums[entry] = sums.get(entry, 0.0) + float(tensor.double().square().sum())
    assert grads == pytest.approx(expected[0], rel=1e-6)
    assert weights == pytest.approx(expected[1], rel=1e-6)


def _check_slots(rank: int) -> None:
    world = dist.group.WORLD
    views = {False: [BucketView(f"b{i}:r{rank}", ()) for i in range(rank + 1)], True: []}
    # Two pipeline stages (one rank each): stage 0's slots first, then stage 1's.
    (reduction,) = assign_slots(views, {False: world}, stage=rank, staged=True, expert_rank=0)
    assert reduction.names == ["pp0.b0:r0", "pp1.b0:r1", "pp1.b1:r1"]
    assert reduction.parts == [(0, rank + 1, 0 if rank == 0 else 1)]
    # One owner (TP peers / optimizer shards): shared slots, no offset.
    same = {False: [BucketView("b0:x", ()), BucketView("b1:x", ())], True: [BucketView("b0:e", ())]}
    reductions = assign_slots(
        same, {False: world, True: world}, stage=0, staged=False, expert_rank=rank
    )
    (reduction,) = reductions  # dense and expert parts of one group share one all-reduce
    assert reduction.names == ["b0:x", "b1:x", "ep0.b0:e", "ep1.b0:e"]
    assert reduction.parts == [(0, 2, 0), (2, 1, 2 + rank)]
    # Ranks of one owner that disagree on its buckets are refused, not summed.
    with pytest.raises(RuntimeError, match="disagree on its gradient buckets"):
        assign_slots(views, {False: world}, stage=0, staged=False, expert_rank=0)


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # No GPU here: DDP allocates its buffers on torch.cuda.current_device().
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    parallel_state.initialize_model_parallel()
    try:
        _check_views(rank)
        _check_slots(rank)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_bucket_layout_on_real_ddp_over_two_gloo_ranks(tmp_path: Path) -> None:
    # Spawned, not forked: a fork of a test process whose earlier tests started torch's and
    # gloo's threads can crash in the child (SIGSEGV seen in the full unit run); a fresh
    # interpreter per rank costs its imports (a few seconds) and inherits nothing.
    mp.start_processes(
        _worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True, start_method="spawn"
    )
