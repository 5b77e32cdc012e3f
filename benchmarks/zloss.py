"""Cross entropy + output z-loss: time and saved-for-backward memory, side by side in one run.

Methods on identical fresh logits: ``megatron CE`` (Megatron's ``vocab_parallel_cross_entropy``,
no z-loss), ``naive CE + z`` (``c * logsumexp(logits)**2`` taken first, CE on a copy),
``z-loss (keeps logits)`` (:func:`megatron_ext.zloss.vocab_parallel_cross_entropy_with_z_loss`)
and ``z-loss (training path)`` (``overwrite_logits=True``, as ``--z-loss-coeff`` runs it).
Times are process CPU time on one thread, median and best of ``--reps`` interleaved
repetitions; saved bytes are the storages ``saved_tensors_hooks`` packs. Method and figures:
BENCHMARKS.md#z-loss.

    python benchmarks/zloss.py [--dtype bf16]     # the two sizes in BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

COEFF = 1e-4
# (sequence, micro-batch, full vocabulary, tensor-parallel size whose shard is timed)
SIZES = ((512, 2, 32000, 1), (2048, 2, 131072, 8))
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


@dataclass
class Method:
    name: str
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # per-token loss to backprop


def _methods(group: dist.ProcessGroup) -> list[Method]:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_ext.zloss import (
        cross_entropy_and_z_loss,
        vocab_parallel_cross_entropy_with_z_loss,
    )

    def naive(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z = torch.logsumexp(logits.float(), dim=-1) ** 2
        return vocab_parallel_cross_entropy(logits.clone(), target, tp_group=group) + COEFF * z

    return [
        Method("megatron CE", lambda x, t: vocab_parallel_cross_entropy(x, t, tp_group=group)),
        Method("naive CE + z", naive),
        Method(
            "z-loss (keeps logits)",
            lambda x, t: vocab_parallel_cross_entropy_with_z_loss(x, t, COEFF, group)[0],
        ),
        Method(
            "z-loss (training path)",
            lambda x, t: cross_entropy_and_z_loss(x, t, COEFF, group, overwrite_logits=True).loss,
        ),
    ]


def _saved_bytes(method: Method, logits: torch.Tensor, target: torch.Tensor) -> int:
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = logits.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = method.run(x, target)
    loss.backward(torch.ones_like(loss))
    return sum(storages.values())


def _time_once(
    method: Method,
    logits: torch.Tensor,
    target: torch.Tensor,
    grad: torch.Tensor,
    clock: Callable[[], float],
) -> tuple[float, torch.Tensor]:
    x = logits.clone().requires_grad_()
    start = clock()
    loss = method.run(x, target)
    loss.backward(grad)
    return clock() - start, loss.detach()


def bench(
    seq: int,
    batch: int,
    vocab: int,
    tp: int,
    dtype: torch.dtype,
    reps: int,
    clock: str,
    group: dist.ProcessGroup,
) -> None:
    shard = vocab // tp
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(seq, batch, shard, generator=gen) * 2).to(dtype)
    # Targets over the full vocabulary: 1/tp of them fall in this rank's shard, as in TP.
    target = torch.randint(0, vocab, (seq, batch), generator=gen)
    grad = torch.rand(seq, batch, generator=gen)
    methods = _methods(group)
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for rep in range(reps + 2):  # interleaved, so machine noise hits every method alike
        for method in methods:
            elapsed, _ = _time_once(method, logits, target, grad, CLOCKS[clock])
            if rep >= 2:  # warm-up
                times[method.name].append(elapsed)
    losses = {m.name: _time_once(m, logits, target, grad, CLOCKS[clock])[1] for m in methods}
    z_values = [v for k, v in losses.items() if k != "megatron CE"]
    for value in z_values[1:]:
        torch.testing.assert_close(value, z_values[0], rtol=1e-5, atol=1e-5)
    saved = {m.name: _saved_bytes(m, logits, target) for m in methods}

    tokens = seq * batch
    base_time = statistics.median(times["megatron CE"])
    base_best = min(times["megatron CE"])
    base_saved = saved["megatron CE"]
    print(
        f"\n[s={seq}, b={batch}, vocab={vocab}, shard {shard} (TP={tp}), {dtype}, "
        f"c={COEFF}, {clock} time, {torch.get_num_threads()} thread(s), {reps} reps]"
    )
    print(
        f"{'method':24} {'median ms':>10} {'x megatron':>10} {'best ms':>8} {'x megatron':>10} "
        f"{'saved MiB':>10} {'saved - megatron':>17}"
    )
    for method in methods:
        median, best = statistics.median(times[method.name]), min(times[method.name])
        extra = saved[method.name] - base_saved
        print(
            f"{method.name:24} {median * 1e3:10.1f} {median / base_time:10.2f} "
            f"{best * 1e3:8.1f} {best / base_best:10.2f} "
            f"{saved[method.name] / 2**20:10.1f} {extra / tokens:+13.1f} B/tok"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1
        )
        try:
            for seq, batch, vocab, tp in SIZES:
                bench(seq, batch, vocab, tp, dtype, args.reps, args.clock, dist.group.WORLD)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
