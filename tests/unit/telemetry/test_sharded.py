"""Bucket norms under torch FSDP2 on real megatron-core objects: Megatron's
TorchFullyShardedDataParallel (over a CPU mesh, as the CPU runner's shim builds it) and its
bf16 optimizer, whose fp32 main parameters hold the gradients Megatron's norm reads (it frees
the model's after copying them). The layout matrix's ``fsdp2-dp2`` row checks fp32 at DP=2."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from megatron_ext.telemetry.sharded import fsdp_units, is_fully_sharded
from tests.support.megatron_world import LAYERS, backward, batch, megatron_world, tiny_gpt


def _fsdp2_bf16(monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    original = DeviceMesh.from_group
    monkeypatch.setattr(
        DeviceMesh, "from_group", staticmethod(lambda group, _, *a, **k: original(group, "cpu"))
    )
    model = tiny_gpt(bf16=True, params_dtype=torch.bfloat16, transformer_impl="local")
    model = Float16Module(model.config, model)  # what Megatron's get_model does under --bf16
    chunk = TorchFullyShardedDataParallel(model.config, DistributedDataParallelConfig(), model)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0)
    return chunk, get_megatron_optimizer(config, [chunk])


def test_fsdp2_units_add_up_to_megatron_grad_norm_from_the_bf16_main_grads(monkeypatch) -> None:
    with megatron_world():
        chunk, optimizer = _fsdp2_bf16(monkeypatch)
        backward(chunk, batch())
        optimizer.prepare_grads()  # main grads filled, the model's freed
        assert is_fully_sharded([chunk])
        parts = optimizer.chained_optimizers
        views, normer = fsdp_units([chunk], lambda p: True, parts)
        spans = [v.name.split("[")[0] for v in views]
        layers = [f"b{i + 1}:layers{i}-{i}" for i in range(LAYERS)]
        assert spans == ["b0:no-layers", *layers, f"b{LAYERS + 1}:no-layers"]
        squares = normer()
        assert float(squares.sum()) == pytest.approx(optimizer.get_grad_norm() ** 2, rel=1e-5)
        assert bool((squares > 0).all())
        # The model's own gradients are gone: reading them would give zero norms.
        _, model_grads = fsdp_units([chunk], lambda p: True, [])
        assert float(model_grads().sum()) == 0.0
