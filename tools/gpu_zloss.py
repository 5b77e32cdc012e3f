"""GPU check rung 3: z-loss against Megatron's cross-entropy paths on CUDA, side by side.

One TP=8 shard of a 128k vocabulary (4096 x 2 x 16384 bf16 logits), forward + backward of
the per-token loss, timed with CUDA events over interleaved repetitions (median), and the peak
memory each method allocates above its inputs (``torch.cuda.max_memory_allocated``):

- ``megatron CE``: ``tensor_parallel.vocab_parallel_cross_entropy`` (the default path);
- ``megatron fused CE``: ``fused_vocab_parallel_cross_entropy`` (``--cross-entropy-loss-fusion``);
- ``z-loss``: the overlay's one-pass CE + c·log²Z, what runs without the fusion and, routed,
  under ``--cross-entropy-fusion-impl te``;
- ``z-loss fused``: the z-loss composed with Megatron's fused CE (the fusion, native);
- ``TE fused CE``: Transformer Engine's ``parallel_cross_entropy`` as Megatron calls it
  (``--cross-entropy-fusion-impl te``); skipped, saying so, where TE is not installed.

Prints one JSON line: per-method ms and MiB, the z-loss ratios against the faster Megatron
path (time) and the smaller one (memory), the composed z-loss against Megatron's fused CE and
the routed one against TE's. Without CUDA it says it skipped and exits 0.
"""

from __future__ import annotations

import argparse
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
TE_SKIPPED = "TE fused CE skipped: Transformer Engine is not installed"


def _methods(
    group: dist.ProcessGroup,
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_ext.zloss import cross_entropy_and_z_loss
    from megatron_ext.zloss.adapter import fused_cross_entropy_and_z_loss

    methods = {
        "megatron CE": lambda x, t: vocab_parallel_cross_entropy(x, t, tp_group=group),
        "megatron fused CE": lambda x, t: fused_vocab_parallel_cross_entropy(x, t, group),
        "z-loss": lambda x, t: (
            cross_entropy_and_z_loss(x, t, COEFF, group, overwrite_logits=True).loss
        ),
        "z-loss fused": lambda x, t: fused_cross_entropy_and_z_loss(x, t, COEFF, group).loss,
    }
    te_cross_entropy = _te_cross_entropy()
    if te_cross_entropy is not None:
        methods["TE fused CE"] = lambda x, t: te_cross_entropy(x, t, group)
    return methods


def _te_cross_entropy() -> Callable | None:
    """Megatron's wrapper of TE's fused CE, or None (said on stderr) without TE."""
    try:
        from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy
    except ImportError:
        te_parallel_cross_entropy = None
    if te_parallel_cross_entropy is None:
        print(f"gpu_zloss: {TE_SKIPPED}", file=sys.stderr, flush=True)
    return te_parallel_cross_entropy


def _ratios(ms: dict[str, float], peaks: dict[str, int]) -> dict[str, object]:
    """z-loss against Megatron's faster CE, the composed one against the fused CE, the routed
    one against TE's (or why not)."""
    fastest = min(ms["megatron CE"], ms["megatron fused CE"])
    smallest = min(peaks["megatron CE"], peaks["megatron fused CE"])
    ratios: dict[str, object] = {
        "time_vs_fastest_megatron": round(ms["z-loss"] / fastest, 3),
        "memory_vs_megatron": round(peaks["z-loss"] / smallest, 3),
        "fused_vs_plain_megatron_time": round(ms["megatron fused CE"] / ms["megatron CE"], 3),
        "composed_vs_fused_time": round(ms["z-loss fused"] / ms["megatron fused CE"], 3),
        "composed_vs_fused_memory": round(peaks["z-loss fused"] / peaks["megatron fused CE"], 3),
    }
    if "TE fused CE" not in ms:
        return {**ratios, "te": TE_SKIPPED}
    return {
        **ratios,
        "routed_vs_te_time": round(ms["z-loss"] / ms["TE fused CE"], 3),
        "routed_vs_te_memory": round(peaks["z-loss"] / peaks["TE fused CE"], 3),
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
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        print("gpu_zloss: skipped: needs a CUDA device (GPU check rung 3)", flush=True)
        return
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
    for method in methods.values():  # warm-up (the fused CEs compile on first use)
        _once(method, source, target)
    times: dict[str, list[float]] = {name: [] for name in methods}
    peaks: dict[str, int] = {}
    for _ in range(REPS):
        for name, method in methods.items():
            ms, peak = _once(method, source, target)
            times[name].append(ms)
            peaks[name] = max(peaks.get(name, 0), peak)
    ms = {name: statistics.median(t) for name, t in times.items()}
    figures = {
        "shape": [SEQ, BATCH, VOCAB_SHARD],
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "peak_mib": {name: round(p / 2**20, 1) for name, p in peaks.items()},
        **_ratios(ms, peaks),
    }
    print(json.dumps(figures))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
