"""Step time with every per-step signal on vs off, side by side in one run, on the CPU harness.

Arms (the tiny test model of ``tests/harness.py``: 2 layers, hidden 64, seq 64, global batch 8,
one rank, gloo, through the real ``megatron.training.pretrain`` loop):

- ``off``: no megatron-ext telemetry, no sample log;
- ``samples``: ``--sample-log-dir DIR`` only: the per-micro-batch sample log (ids, token SHA-1s,
  token-summed loss and each sample's token-averaged loss, one host transfer per step);
- ``on``: ``--log-bucket-grad-norms --signals-dir DIR --signals-update-ratio --sample-log-dir
  DIR`` (bucket norms, the signals record with params norm and update ratio, worst-rank loss,
  and the per-micro-batch sample log).

Launches are interleaved (off, samples, on, off, ...) so load from other jobs on the machine
hits every arm alike. Each launch logs every iteration (``--log-interval 1``); the step time is
Megatron's own "elapsed time per iteration (ms)", the first ``--warmup`` iterations of each
launch are dropped, and each arm's figure is the median over all its remaining iterations.

The isolated part times the per-step telemetry pieces that do not need Megatron (the fused
bucket-norm pass, the update-ratio snapshot, building and appending the signals record, the
sample log's per-step transfer with and without the per-sample losses) on buffers of the tiny
model's size, to show what fixed per-step cost the end-to-end ratio is made of.

    python benchmarks/signals.py                         # the figures in BENCHMARKS.md
    python benchmarks/signals.py --reps 3 --iters 60 --workdir /tmp/signals-bench
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the launch helper: tests.support.harness

from megatron_ext.common.io import token_sha1  # noqa: E402
from megatron_ext.common.records.signals import SignalRecord, SignalsWriter  # noqa: E402
from megatron_ext.demo import prepare_tiny_dataset  # noqa: E402
from megatron_ext.telemetry.bucket_layout import BucketView, squared_norms  # noqa: E402
from tests.support.harness import launch  # noqa: E402

STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
PARAMETERS = re.compile(
    r"number of parameters on \([\w, ]+\) model parallel rank \([\d, ]+\): "
    r"(\d+)"
)

CAVEATS = """\
What this CPU figure can and cannot say about the <=1% target on a real GPU step:
- It CAN bound the fixed per-step costs, those that do not grow with the model: building and
  appending the signals record, the worst-rank all-gather, the bucket-norm all-reduce, the
  sample log's per-sample SHA-1 and .item() calls, the Python of the patched calls. On this
  model they are at most the on-off difference in ms (up to the noise between the arms).
- It CANNOT give the ratio on a realistic step. Here one step is ~50-100 ms of tiny matmuls
  (2 layers x 64 hidden, 8 sequences of 64 tokens), so fixed costs of a few ms look like
  several percent, while a 7B-70B GPU step takes seconds: the same ms would be ~0.1%.
- It CANNOT see host-device synchronisation: on CPU a .item() costs nothing, on a GPU it
  drains the kernel queue. The sample log takes sample ids and token SHA-1s from the host
  batch (no sync), keeps each micro-batch's loss, token count and per-sample losses as device
  tensors, and reads them all in ONE transfer per step, after Megatron's training_log (one
  sync per step, not per micro-batch); the worst-rank loss is one all-gather and one read per
  step. The per-sample losses add b floats per micro-batch to that transfer and no sync.
- The costs that scale with the model on a GPU are memory-bound passes over this rank's
  gradients/parameters: the bucket norms read the grad buffer once (the same read Megatron's
  grad norm already does), the params norm (computed every step under --signals-dir when
  --log-params-norm is off) reads the parameters once, and --signals-update-ratio copies the
  fp32 main parameters and reads them twice more (hence opt-in). Their share of a GPU step is
  a bandwidth estimate (bytes / HBM bandwidth vs step time), not something a CPU run measures;
  confirm it with this script's arms on a GPU node (same flags, real model size).
- CPU wall time on a shared machine is noisy: compare the two medians from this one run only."""


def _launch(workdir: Path, data_args: list[str], iters: int, extra: list[str]) -> str:
    """One real launch of the entry point through the CPU harness; returns its log."""
    run = launch(
        workdir, [*data_args, "--train-iters", str(iters), *extra], timeout=900, sample_log=False
    )
    if run.returncode != 0:
        raise SystemExit(
            f"launch failed (exit {run.returncode}); log: {workdir / 'log.txt'}\n{run.log[-3000:]}"
        )
    return run.log


def step_times(log: str, warmup: int) -> list[float]:
    """Megatron's per-iteration wall times (ms) after the first ``warmup`` iterations."""
    return [float(ms) for it, ms in STEP.findall(log) if int(it) > warmup]


def _median_ms(operation: Callable[[], object], reps: int = 200) -> float:
    for _ in range(5):
        operation()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        operation()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def isolated_costs(parameters: int, directory: Path) -> dict[str, float]:
    """Median ms of the Megatron-free per-step pieces on a tiny-model-sized fp32 grad buffer."""
    torch.manual_seed(0)
    grads = torch.randn(parameters)
    segments = tuple(grads.tensor_split(15))  # the tiny model has 15 parameter tensors
    views = [BucketView("b0:layers0-1[embedding..output_layer]", segments)]
    params = [torch.randn(s.numel()) for s in segments]
    snapshot = [p.detach().float().clone() for p in params]
    tokens = torch.randint(0, 1024, (8, 64))  # one global batch of the tiny run
    writer = SignalsWriter(directory)

    def update_ratio_sums() -> None:  # the adapter's loop, without the all-reduce
        sums = torch.zeros(2)
        for p, before in zip(params, snapshot):
            sums[0] += (p.detach().float() - before).square().sum()
            sums[1] += p.detach().float().square().sum()

    def record() -> None:
        writer.write(
            SignalRecord(
                iteration=1,
                attempt=0,
                job_id="local",
                wall_time=time.time(),
                consumed_samples=8,
                skipped_samples=0,
                lm_loss=3.0,
                max_local_loss=3.1,
                max_loss_dp_rank=0,
                grad_norm=1.0,
                bucket_grad_norms={views[0].name: 1.0},
                params_norm=50.0,
                update_ratio=1e-3,
                lr=1e-3,
                loss_scale=1.0,
                num_zeros=0.0,
            )
        )

    # The sample log's loss work per step: 4 micro-batches of [2, 64] per-token losses (the tiny
    # run's global batch on one rank), as the adapter does it (on_loss + after_step).
    micro = [(torch.rand(2, 64) * 6, torch.ones(2 * 64)) for _ in range(4)]

    def sample_log_losses(per_sample: bool) -> list:
        pending = []
        for per_token, mask in micro:
            loss, tokens = (per_token.view(-1) * mask).sum(), mask.sum().to(torch.int)
            row = [loss.detach().clone().view(1), tokens.detach().clone().float().view(1)]
            if per_sample:
                m = mask.view(2, -1)
                row.append((per_token.detach().float() * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))
            pending.append(torch.cat(row))
        return torch.stack(pending).tolist()

    return {
        "sample log: loss + tokens, one transfer": _median_ms(lambda: sample_log_losses(False)),
        "sample log: + per-sample losses": _median_ms(lambda: sample_log_losses(True)),
        "bucket norms (squared_norms)": _median_ms(lambda: squared_norms(views)),
        "update-ratio snapshot (fp32 copy)": _median_ms(
            lambda: [p.detach().float().clone() for p in params]
        ),
        "update-ratio sums (per-parameter loop)": _median_ms(update_ratio_sums),
        "sample log: SHA-1 of 8 samples": _median_ms(lambda: [token_sha1(row) for row in tokens]),
        "signals record build + append": _median_ms(record),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="launches per arm (>= 2)")
    parser.add_argument("--iters", type=int, default=40, help="--train-iters per launch")
    parser.add_argument("--warmup", type=int, default=5, help="iterations dropped per launch")
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep data and launch logs here (default: a temporary directory)",
    )
    args = parser.parse_args()
    if args.reps < 2 or args.iters <= args.warmup:
        parser.error("need --reps >= 2 and --iters > --warmup")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="signals-bench-"))
    try:
        document, tokenizer_args = prepare_tiny_dataset(root)
        data_args = [
            "--data-path",
            str(document),
            "--split",
            "100,0,0",
            *tokenizer_args,
            "--data-cache-path",
            str(root / "index-cache"),
        ]
        arms = ("off", "samples", "on")
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        per_launch: dict[str, list[float]] = {arm: [] for arm in arms}
        parameters = 0
        started = time.monotonic()
        for rep in range(args.reps):
            for arm in arms:
                workdir = root / f"{arm}-{rep}"
                shutil.rmtree(workdir, ignore_errors=True)
                extra = {
                    "off": [],
                    "samples": ["--sample-log-dir", str(workdir / "samples")],
                    "on": [
                        "--log-bucket-grad-norms",
                        "--signals-dir",
                        str(workdir / "signals"),
                        "--signals-update-ratio",
                        "--sample-log-dir",
                        str(workdir / "samples"),
                    ],
                }[arm]
                log = _launch(workdir, data_args, args.iters, extra)
                steps = step_times(log, args.warmup)
                if len(steps) != args.iters - args.warmup:
                    raise SystemExit(
                        f"{workdir}/log.txt: expected {args.iters - args.warmup} "
                        f"timed iterations, parsed {len(steps)}"
                    )
                if arm == "on" and not (workdir / "signals" / "signals.jsonl").is_file():
                    raise SystemExit(f"{workdir}: the 'on' arm wrote no signals log")
                times[arm] += steps
                per_launch[arm].append(statistics.median(steps))
                if found := PARAMETERS.search(log):
                    parameters = int(found.group(1))
                print(
                    f"  {arm:7} launch {rep + 1}: median {per_launch[arm][-1]:7.1f} ms/iter",
                    flush=True,
                )
        elapsed = time.monotonic() - started

        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        samples = statistics.median(times["samples"])
        print(
            f"\n[CPU harness, tiny model ({parameters:,} parameters), 1 rank, "
            f"{args.reps} interleaved launches per arm, {args.iters} iterations each, first "
            f"{args.warmup} dropped; torch {torch.__version__}; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {elapsed:.0f} s]"
        )
        print(f"{'arm':7} {'median ms/iter':>15} {'per-launch medians':>30} {'iterations':>11}")
        for arm, value in (("off", off), ("samples", samples), ("on", on)):
            launches = ", ".join(f"{m:.1f}" for m in per_launch[arm])
            print(f"{arm:7} {value:15.1f} {launches:>30} {len(times[arm]):>11}")
        for arm, value in (("samples", samples), ("on", on)):
            print(
                f"ratio {arm}/off: {value / off:.3f} ({(value / off - 1) * 100:+.1f}%, "
                f"{value - off:+.1f} ms/iter)"
            )
            paired = [b / a for a, b in zip(per_launch["off"], per_launch[arm])]
            print(
                f"  paired ratios (each {arm} launch / the off launch of its round): "
                + ", ".join(f"{r:.3f}" for r in paired)
            )
        # Launches of the same arm differ only by machine noise: a smaller on/off difference
        # is not resolved by this run.
        spread = max((max(m) - min(m)) / statistics.median(m) for m in per_launch.values())
        print(
            f"noise: per-launch medians of one arm differ by up to {spread * 100:.1f}%; an "
            "on/off difference below that is not resolved here"
        )

        if parameters:
            print(
                "\nIsolated per-step pieces on a buffer of the tiny model's size "
                "(median of 200, ms; % of the off-arm step):"
            )
            for name, ms in isolated_costs(parameters, root / "isolated").items():
                print(f"  {name:40} {ms:8.3f} ms  {ms / off * 100:6.2f}%")
        print("\n" + CAVEATS)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
