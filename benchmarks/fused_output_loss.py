"""Output layer + CE + z-loss: fused (``--fused-output-loss``) against the unfused path, side
by side in one run: peak memory of the head + loss and time, forward + backward.

Arms on the same inputs: ``unfused`` (Megatron's ``ColumnParallelLinear`` + the overlay's CE +
z-loss), ``fused`` (:func:`megatron_ext.zloss.core.fused_output_loss`, ``.grad`` returned),
``ddp`` (the same with an fp32 ``main_grad``, as training runs it), ``recompute`` (a
benchmark-only Cut Cross-Entropy design) and ``eval`` (fused under ``no_grad``). Peak memory is
tracked per storage by a ``TorchDispatchMode`` on the ``meta`` device (exact bytes, cheap);
times are process CPU time on one thread, median of ``--reps`` interleaved repetitions, with a
one-rank gloo TP group. Method and figures: BENCHMARKS.md#fused-output-loss.

    python benchmarks/fused_output_loss.py --reps 1          # the grid in BENCHMARKS.md
    python benchmarks/fused_output_loss.py --hidden 4096 --vocab 32768 --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

COEFF = 1e-4
SCALE = 0.5  # the schedule's gradient per token (loss scale / micro-batches / tokens)
TOKENS = (4096, 2)  # (sequence, micro-batch)
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PeakBytes(TorchDispatchMode):
    """Live bytes of the storages that ops create under this mode, and their peak."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._tracked: dict[int, int] = {}
        self._inputs = {id(t.untyped_storage()) for t in inputs}  # kept alive by the caller

    def _free(self, key: int) -> None:
        self.live -= self._tracked.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self._tracked or key in self._inputs or storage.nbytes() == 0:
                continue
            self._tracked[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out


def _methods(group: dist.ProcessGroup, chunk: int | None) -> dict[str, Callable[..., Any]]:
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_ext.zloss import cross_entropy_and_z_loss
    from megatron_ext.zloss.core import default_chunk_tokens, fused_output_loss

    def unfused(hidden, weight, labels, mask):
        config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=weight.dtype)
        layer = ColumnParallelLinear(
            weight.size(1),
            weight.size(0),
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=False,
            skip_weight_param_allocation=True,
            tp_group=group,
        )
        logits, _ = layer(hidden, weight=weight)
        return cross_entropy_and_z_loss(logits, labels, COEFF, group, overwrite_logits=True)

    def fused(hidden, weight, labels, mask):
        return fused_output_loss(
            hidden, weight, labels, mask, z_loss_coeff=COEFF, tp_group=group, chunk_tokens=chunk
        )

    def ddp(hidden, weight, labels, mask):  # the weight gradient straight into main_grad
        return fused_output_loss(
            hidden,
            weight,
            labels,
            mask,
            z_loss_coeff=COEFF,
            tp_group=group,
            chunk_tokens=chunk,
            accumulate_into_main_grad=weight.requires_grad,
            grad_scale=torch.tensor(SCALE, device=hidden.device),
            dummy_wgrad=False,
        )

    def recompute(hidden, weight, labels, mask):  # the other design, for the comparison
        chunk_tokens = chunk or default_chunk_tokens(weight.size(0))
        loss = _Recompute.apply(
            hidden.reshape(-1, hidden.size(-1)), weight, labels.view(-1), chunk_tokens
        )
        return SimpleNamespace(loss=loss.view(labels.shape))

    return {"unfused": unfused, "fused": fused, "ddp": ddp, "recompute": recompute}


class _Recompute(torch.autograd.Function):
    """Cut Cross-Entropy's design (one TP rank, the benchmark's): the forward keeps each
    token's log Z only, the backward recomputes every chunk's logits (a fourth matmul) and
    needs no assumption on the incoming gradient. Here to be measured against the chosen
    design, not used by training."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, labels, chunk: int):  # type: ignore[override]
        log_z = torch.empty(hidden.size(0), device=hidden.device)
        loss = torch.empty_like(log_z)
        for start in range(0, hidden.size(0), chunk):
            rows = slice(start, start + chunk)
            logits = torch.matmul(hidden[rows], weight.t()).float()
            log_z[rows] = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, labels[rows].unsqueeze(-1)).squeeze(-1)
            loss[rows] = log_z[rows] - target + COEFF * log_z[rows] ** 2
            del logits
        ctx.save_for_backward(hidden, weight, labels, log_z)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss):  # type: ignore[override]
        hidden, weight, labels, log_z = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, device=weight.device)
        for start in range(0, hidden.size(0), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            work = torch.matmul(hidden[rows], weight.t()).float()  # the recomputed logits
            work.sub_(log_z[rows].unsqueeze(-1)).exp_()
            work.mul_(((1 + 2 * COEFF * log_z[rows]) * grad_loss[rows]).unsqueeze(-1))
            index = torch.arange(work.size(0), device=work.device)
            work[index, labels[rows]] -= grad_loss[rows]
            grad_logits = work.to(hidden.dtype)
            del work
            torch.matmul(grad_logits, weight, out=grad_hidden[rows])
            if grad_logits.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
            else:
                grad_weight.add_(torch.matmul(grad_logits.t(), hidden[rows]))
            del grad_logits
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def _step(
    method: Callable[..., Any],
    inputs: tuple[torch.Tensor, ...],
    train: bool,
    main_grad: torch.Tensor | None = None,
) -> Any:
    """Forward and (``train``) backward of Megatron's loss; with ``main_grad``, the weight is
    given it as Megatron DDP gives every parameter (the weight gradient is read from it)."""
    hidden, weight, labels, mask = inputs
    h, w = hidden.detach().requires_grad_(train), weight.detach().requires_grad_(train)
    if main_grad is not None:
        main_grad.zero_()
        w.main_grad, w.grad_added_to_main_grad = main_grad, False
    with torch.set_grad_enabled(train):
        terms = method(h, w, labels, mask)
        if train:
            (torch.sum(terms.loss.view(-1) * mask.view(-1)) * SCALE).backward()
    return terms.loss.detach(), h.grad, w.grad if main_grad is None else main_grad


def _inputs(hidden_size: int, vocab: int, dtype: torch.dtype, device: str) -> tuple:
    seq, batch = TOKENS
    if device == "meta":  # the same ops on shapes only: exact bytes, no arithmetic
        return (
            torch.empty(seq, batch, hidden_size, dtype=dtype, device="meta"),
            torch.empty(vocab, hidden_size, dtype=dtype, device="meta"),
            torch.zeros(seq, batch, dtype=torch.long, device="meta"),
            torch.empty(seq, batch, device="meta"),
        )
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(seq, batch, hidden_size, generator=gen).to(dtype),
        (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(dtype),
        torch.randint(0, vocab, (seq, batch), generator=gen),
        (torch.rand(seq, batch, generator=gen) > 0.1).float(),
    )


def _main_grad(inputs: tuple[torch.Tensor, ...], name: str) -> torch.Tensor | None:
    """The fp32 main_grad Megatron DDP gives the weight (``ddp`` only; bf16 runs accumulate
    in fp32, as Megatron's --bf16 default does)."""
    weight = inputs[1]
    if name != "ddp":
        return None
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def bench(hidden_size: int, vocab: int, dtype: torch.dtype, timed: bool, args: Any) -> None:
    """One cell: peaks (meta device) and, if ``timed``, CPU times and a value check."""
    methods = _methods(dist.group.WORLD, args.chunk_tokens)
    runs = {**{name: (m, True) for name, m in methods.items()}, "eval": (methods["fused"], False)}
    peaks, above = {}, {}
    for name, (method, train) in runs.items():
        inputs = _inputs(hidden_size, vocab, dtype, "meta")
        main_grad = _main_grad(inputs, name)
        with PeakBytes((*inputs, *([] if main_grad is None else [main_grad]))) as tracker:
            _, grad_hidden, grad_weight = _step(method, inputs, train, main_grad)
        peaks[name] = tracker.peak
        # What is left once the two gradients every path must return are set aside (under
        # DDP the weight's is in main_grad, a buffer that exists before the step).
        returned = [grad_hidden] + ([grad_weight] if main_grad is None else [])
        above[name] = tracker.peak - sum(
            g.untyped_storage().nbytes() for g in returned if g is not None
        )
    times: dict[str, list[float]] = {name: [] for name in runs}
    if timed:
        inputs, clock, results = _inputs(hidden_size, vocab, dtype, "cpu"), CLOCKS[args.clock], {}
        for _ in range(args.reps):  # interleaved: machine noise hits every method alike
            for name, (method, train) in runs.items():
                main_grad = _main_grad(inputs, name)
                start = clock()
                results[name] = _step(method, inputs, train, main_grad)
                times[name].append(clock() - start)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name in ("fused", "ddp", "recompute"):  # the same numbers as the unfused path
            for a, b in zip(results[name], results["unfused"], strict=True):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max())
    seq, batch = TOKENS
    print(
        f"\n[{seq}x{batch} tokens, hidden {hidden_size}, V/TP {vocab}, {dtype}, c={COEFF}, "
        f"chunk {args.chunk_tokens or 'auto'}; "
        + (
            f"{args.clock} time, {torch.get_num_threads()} thread(s), {args.reps} reps]"
            if timed
            else "not timed]"
        )
    )
    print(
        f"{'method':9} {'median s':>9} {'x unfused':>9} {'peak MiB':>9} {'x unfused':>9} "
        f"{'- grads MiB':>11} {'x unfused':>9}"
    )
    for name in runs:
        timing = f"{'-':>9} {'-':>9}"
        if timed:
            median = statistics.median(times[name])
            timing = f"{median:9.2f} {median / statistics.median(times['unfused']):9.2f}"
        print(
            f"{name:9} {timing} {peaks[name] / 2**20:9.1f} {peaks[name] / peaks['unfused']:9.3f} "
            f"{above[name] / 2**20:11.1f} {above[name] / above['unfused']:9.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--vocab", type=int, nargs="+", default=[16384, 32768], help="V/TP")
    parser.add_argument("--dtype", choices=tuple(DTYPES), nargs="+", default=list(DTYPES))
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: automatic")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--time-hidden",
        type=int,
        nargs="*",
        default=[1024],
        help="hidden sizes also timed on CPU (fp32 only unless --time-bf16)",
    )
    parser.add_argument("--time-bf16", action="store_true", help="also time the bf16 cells")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1
        )
        try:
            for dtype in args.dtype:
                for hidden_size in args.hidden:
                    for vocab in args.vocab:
                        timed = hidden_size in args.time_hidden and (
                            dtype == "fp32" or args.time_bf16
                        )
                        bench(hidden_size, vocab, DTYPES[dtype], timed, args)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
