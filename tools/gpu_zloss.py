"""GPU check rung 3: z-loss against Megatron's two cross-entropy paths on CUDA, side by side.

One TP=8 shard of a 128k vocabulary (4096 x 2 x 16384 bf16 logits), forward + backward of
the per-token loss, timed with CUDA events over interleaved repetitions (median), and the peak
memory each method allocates above its inputs (``torch.cuda.max_memory_allocated``):

- ``megatron CE``: ``tensor_parallel.vocab_parallel_cross_entropy`` (the default path);
- ``megatron fused CE``: ``fused_vocab_parallel_cross_entropy``, what
  ``--cross-entropy-loss-fusion`` selects (the overlay refuses that flag with z-loss);
- ``z-loss``: the overlay's one-pass CE + c·log²Z as training runs it.

Prints one JSON line: per-method ms and MiB, and the z-loss ratios against the faster Megatron
path (time) and the smaller one (memory).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ, BATCH, VOCAB_SHARD, COEFF, REPS = 4096, 2, 16384, 1e-4, 12


def _methods(
    group: dist.ProcessGroup,
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_ext.zloss import cross_entropy_and_z_loss

    return {
        "megatron CE": lambda x, t: vocab_parallel_cross_entropy(x, t, tp_group=group),
        "megatron fused CE": lambda x, t: fused_vocab_parallel_cross_entropy(x, t, group),
        "z-loss": lambda x, t: (
            cross_entropy_and_z_loss(x, t, COEFF, group, overwrite_logits=True).loss
        ),
    }


def _once(method: Callable, source: torch.Tensor, target: torch.Tensor) -> tuple[float, int]:
    logits = source.clone().requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    method(logits, target).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    group = dist.new_group([0])
    gen = torch.Generator(device="cuda").manual_seed(0)
    source = (
        torch.randn(SEQ, BATCH, VOCAB_SHARD, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
    )
    target = torch.randint(0, VOCAB_SHARD, (SEQ, BATCH), device="cuda", generator=gen)
    methods = _methods(group)
    for method in methods.values():  # warm-up (the fused CE compiles on first use)
        _once(method, source, target)
    times: dict[str, list[float]] = {name: [] for name in methods}
    peaks: dict[str, int] = {}
    for _ in range(REPS):
        for name, method in methods.items():
            ms, peak = _once(method, source, target)
            times[name].append(ms)
            peaks[name] = max(peaks.get(name, 0), peak)
    ms = {name: statistics.median(t) for name, t in times.items()}
    mib = {name: round(p / 2**20, 1) for name, p in peaks.items()}
    fastest = min(ms["megatron CE"], ms["megatron fused CE"])
    smallest = min(peaks["megatron CE"], peaks["megatron fused CE"])
    print(
        json.dumps(
            {
                "shape": [SEQ, BATCH, VOCAB_SHARD],
                "ms": {k: round(v, 3) for k, v in ms.items()},
                "peak_mib": mib,
                "time_vs_fastest_megatron": round(ms["z-loss"] / fastest, 3),
                "memory_vs_megatron": round(peaks["z-loss"] / smallest, 3),
                "fused_vs_plain_megatron_time": round(
                    ms["megatron fused CE"] / ms["megatron CE"], 3
                ),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
