"""GPU check rung 7: ``--fused-output-loss`` against Megatron's output layer + CE on CUDA.

4096 x 2 tokens, hidden 4096, one TP shard of V/TP = 32k, bf16; forward + backward of the
output layer and the per-token loss (Megatron's masked sum on top), timed with CUDA events
over interleaved repetitions (median), and the peak memory each method allocates above its
inputs (``torch.cuda.max_memory_allocated``):

- ``megatron CE``: ``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy`` (plain path);
- ``megatron fused CE``: the same layer + ``fused_vocab_parallel_cross_entropy``
  (``--cross-entropy-loss-fusion``);
- ``fused output loss``: :func:`megatron_ext.zloss.core.fused_output_loss` (z-loss 1e-4),
  the weight gradient returned as ``.grad`` (a bare module);
- ``fused output loss, DDP``: the same with the weight as Megatron DDP leaves it (an fp32
  ``main_grad``, allocated before the measure as DDP's grad buffer is): the weight gradient
  goes into ``main_grad`` during the forward, what training runs.

``--cpu`` rehearses the same code at a tiny size on CPU (gloo; wall-clock times, no peaks;
compiled functions run eagerly), so that the rung cannot rot between GPU loans. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GPU_SHAPE, CPU_SHAPE = (8192, 4096, 32768), (256, 64, 1024)  # tokens, hidden, V/TP
COEFF, REPS = 1e-4, 8


def _methods(
    group: dist.ProcessGroup, device: str, main_grad: torch.Tensor
) -> dict[str, Callable[..., torch.Tensor]]:
    from megatron.core import ModelParallelConfig
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

    from megatron_ext.zloss.core import fused_output_loss

    def head(cross_entropy: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(hidden, weight, labels, mask):
            config = ModelParallelConfig(use_cpu_initialization=device == "cpu")
            layer = ColumnParallelLinear(
                weight.size(1),
                weight.size(0),
                config=config,
                init_method=torch.nn.init.zeros_,
                bias=False,
                skip_weight_param_allocation=True,
                tp_group=group,
            )
            logits, _ = layer(hidden.unsqueeze(1), weight=weight)
            return cross_entropy(logits, labels.unsqueeze(1)).view(-1)

        return run

    return {
        "megatron CE": head(lambda x, t: vocab_parallel_cross_entropy(x, t, tp_group=group)),
        "megatron fused CE": head(lambda x, t: fused_vocab_parallel_cross_entropy(x, t, group)),
        "fused output loss": lambda h, w, t, m: (
            fused_output_loss(h, w, t, m, z_loss_coeff=COEFF, tp_group=group).loss
        ),
        "fused output loss, DDP": lambda h, w, t, m: (
            _under_ddp(fused_output_loss, w, main_grad)(
                h, w, t, m, z_loss_coeff=COEFF, tp_group=group
            ).loss
        ),
    }


def _under_ddp(fused: Callable, weight: torch.Tensor, main_grad: torch.Tensor) -> Callable:
    """``fused`` with ``weight`` given ``main_grad`` and DDP's mark, the schedule's gradient
    per token being 1 here (the loss is the masked sum)."""
    main_grad.zero_()
    weight.main_grad, weight.grad_added_to_main_grad = main_grad, False
    one = torch.ones((), device=main_grad.device)

    def call(*args, **kwargs):
        return fused(
            *args, **kwargs, accumulate_into_main_grad=True, grad_scale=one, dummy_wgrad=False
        )

    return call


def _once(method: Callable, inputs: tuple[torch.Tensor, ...], cuda: bool) -> tuple[float, int]:
    hidden, weight, labels, mask = inputs
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    torch.sum(method(h, w, labels, mask) * mask).backward()
    if not cuda:
        return (time.perf_counter() - began) * 1e3, 0
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU rehearsal (tiny size)")
    cpu = parser.parse_args().cpu
    device = "cpu" if cpu else "cuda"
    with tempfile.TemporaryDirectory() as rendezvous:
        if cpu:
            # Megatron's fused CE is torch.compile'd; inductor's CPU code needs a C++ compiler
            # (#46: none is needed). Eager, as the CPU runner's torch.compile shim runs it.
            torch.compiler.set_stance("force_eager")
            dist.init_process_group("gloo", f"file://{rendezvous}/store", rank=0, world_size=1)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29534")
            dist.init_process_group("nccl", rank=0, world_size=1)
            torch.cuda.set_device(0)
        tokens, hidden, vocab = CPU_SHAPE if cpu else GPU_SHAPE
        dtype = torch.float32 if cpu else torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = (
            torch.randn(tokens, hidden, device=device, generator=gen).to(dtype),
            (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).to(dtype),
            torch.randint(0, vocab, (tokens,), device=device, generator=gen),
            (torch.rand(tokens, device=device, generator=gen) > 0.1).float(),
        )
        main_grad = torch.zeros(vocab, hidden, device=device)  # DDP's fp32 grad buffer
        methods = _methods(dist.new_group([0]), device, main_grad)
        for method in methods.values():  # warm-up (the fused CE compiles on first use)
            _once(method, inputs, not cpu)
        times: dict[str, list[float]] = {name: [] for name in methods}
        peaks: dict[str, int] = {}
        for _ in range(2 if cpu else REPS):
            for name, method in methods.items():
                ms, peak = _once(method, inputs, not cpu)
                times[name].append(ms)
                peaks[name] = max(peaks.get(name, 0), peak)
        dist.destroy_process_group()
    ms = {name: statistics.median(t) for name, t in times.items()}
    fused, ddp, plain = "fused output loss", "fused output loss, DDP", "megatron CE"
    print(
        json.dumps(
            {
                "shape": [tokens, hidden, vocab],
                "dtype": str(dtype),
                "ms": {k: round(v, 3) for k, v in ms.items()},
                "peak_mib": {k: round(p / 2**20, 1) for k, p in peaks.items()},
                "time_vs_megatron_ce": round(ms[fused] / ms[plain], 3),
                "time_vs_megatron_fused_ce": round(ms[fused] / ms["megatron fused CE"], 3),
                "memory_vs_megatron_ce": round(peaks[fused] / peaks[plain], 3) if not cpu else None,
                "ddp_time_vs_megatron_ce": round(ms[ddp] / ms[plain], 3),
                "ddp_memory_vs_megatron_ce": (
                    round(peaks[ddp] / peaks[plain], 3) if not cpu else None
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
