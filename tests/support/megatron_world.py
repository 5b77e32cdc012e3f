"""Real megatron-core objects in the test process: a world of one gloo rank, Megatron's parallel
state, a tiny GPTModel, DDP and ``get_megatron_optimizer``, for the adapters' fast tests.

Why not the CPU runner's shims (megatron_ext/cpu/shims.py): they are installed for good in the
process that trains (tripwires on every ``torch.cuda`` callable, a torch function mode that is
never left). Here the same CPU mapping (``device='cuda'`` -> cpu, ``Tensor.type()`` CUDA names,
the device, stream and RNG calls megatron-core makes while building and stepping a model) is
held only inside :func:`megatron_world`, and everything it changed is put back on exit: the
torch attributes, the torch function mode, Megatron's parallel state and the process group.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_ext.cpu.shims import _CudaToCpuMode, _FakeEvent, _FakeStream, _props

SEED = 1234
VOCAB, SEQ, HIDDEN, LAYERS, HEADS = 128, 16, 32, 2, 4

# torch.cuda calls megatron-core makes building a model, DDP and the optimizer, and stepping.
_CUDA = {
    "current_device": lambda: "cpu",
    "device_count": lambda: 1,
    "set_device": lambda *a, **k: None,
    "synchronize": lambda *a, **k: None,
    "current_stream": lambda *a, **k: _FakeStream(),
    "default_stream": lambda *a, **k: _FakeStream(),
    "stream": lambda *a, **k: _FakeStream(),
    "get_device_properties": _props,
    "get_rng_state": lambda *a, **k: torch.get_rng_state(),
    "set_rng_state": lambda *a, **k: None,
    "manual_seed": lambda *a, **k: None,
    "manual_seed_all": lambda *a, **k: None,
    "empty_cache": lambda *a, **k: None,
    "Stream": _FakeStream,
    "Event": _FakeEvent,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_world() -> Iterator[None]:
    """World size 1 on gloo with Megatron's parallel state (TP=PP=DP=1) and its RNG tracker;
    on exit none of it is left (process group, parallel state, tracker, torch's CPU RNG)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    assert not dist.is_initialized(), "another test left a process group behind"
    with (
        pytest.MonkeyPatch.context() as patch,
        torch.random.fork_rng(devices=[]),  # the seeds set here stay here
        _CudaToCpuMode(),
    ):
        for name, value in _CUDA.items():
            patch.setattr(torch.cuda, name, value)
        patch.setattr(torch.cuda.random, "get_rng_state", _CUDA["get_rng_state"])
        patch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
        try:
            parallel_state.initialize_model_parallel()
            model_parallel_cuda_manual_seed(SEED)
            yield
        finally:
            get_cuda_rng_tracker().reset()
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


@contextlib.contextmanager
def patches_undone() -> Iterator[None]:
    """Remove, on exit, every registry patch a feature's ``install`` applied inside: the
    Megatron functions other tests see stay Megatron's."""
    from megatron_ext.registry import table as registry

    before = {p.name for p in registry.applied()}
    try:
        yield
    finally:
        for applied in registry.applied():
            if applied.name not in before:
                applied.remove()


def tiny_config(**overrides: Any) -> Any:
    """The TransformerConfig of a 2-layer GPT, fp32, CPU initialisation, no fusions."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **{
            "num_layers": LAYERS,
            "hidden_size": HIDDEN,
            "num_attention_heads": HEADS,
            "use_cpu_initialization": True,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "gradient_accumulation_fusion": False,
            "bias_activation_fusion": False,
            "bias_dropout_fusion": False,
            "masked_softmax_fusion": False,
            "persist_layer_norm": False,
            "apply_rope_fusion": False,
            **overrides,
        }
    )


def tiny_gpt(untied: bool = True, **config: Any) -> Any:
    """A real GPTModel (local transformer spec), seeded."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(SEED)
    return GPTModel(
        config=tiny_config(**config),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=not untied,
    )


def ddp(model: Any, distributed_optimizer: bool = False, bucket_size: int = 4000) -> Any:
    """Megatron's DistributedDataParallel around ``model`` (small buckets: several of them)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=True,  # Megatron buckets only then
        bucket_size=bucket_size,
    )
    return DistributedDataParallel(model.config, config, model)


def optimizer(chunks: list[Any], weight_decay: float = 0.1, overrides: dict | None = None) -> Any:
    """``get_megatron_optimizer`` for the DDP chunks (Adam, fp32, clip 1.0)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=weight_decay,
        clip_grad=1.0,
        use_distributed_optimizer=chunks[0].ddp_config.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, chunks, config_overrides=overrides)


def batch(seed: int = 0, size: int = 2) -> dict[str, torch.Tensor]:
    """A micro-batch as Megatron's GPT step gets it (tokens, labels, mask, positions)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(size, SEQ),
        "position_ids": torch.arange(SEQ).expand(size, SEQ).contiguous(),
    }


def backward(chunk: Any, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward/backward of the DDP chunk; grads land in its buffers, reduced (DP=1)."""
    chunk.zero_grad_buffer()
    loss = chunk(
        micro_batch["tokens"],
        micro_batch["position_ids"],
        None,
        labels=micro_batch["labels"],
    )
    loss.sum().backward()
    chunk.finish_grad_sync()
    return loss


# The z-loss feature's flags with the fused output loss off (Megatron's own output layer).
PLAIN_OUTPUT_LOSS = {
    "cross_entropy_loss_fusion": False,
    "fused_output_loss": False,
    "fused_output_loss_chunk_tokens": 0,
    "log_output_z": False,
}


def args(**values: Any) -> SimpleNamespace:
    """A Megatron-like args namespace: only the fields the hook under test reads."""
    return SimpleNamespace(**values)
