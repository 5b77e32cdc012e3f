"""Spike detector costs: detector time per step (flat in run length) and planner time on a
synthetic 1,000,000-iteration signals log (target < 5 s).

    .venv/bin/python benchmarks/spikes.py [--iterations 1000000]
    .venv/bin/python benchmarks/spikes.py --compare cea90f0 --iterations 0   # detector only

``--compare REV``: the detector of git revision REV (its ``megatron_ext`` package, imported
from a ``git archive`` of REV) and today's, timed on the same records, interleaved, best of
``--reps``: the per-step cost ratio. Ratios are measured side by side in one run; absolute
times depend on the machine.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the loadable-checkpoint helper: tests.support

from megatron_ext.common.records.signals import SignalRecord  # noqa: E402
from megatron_ext.common.records.spike_config import SpikeConfig  # noqa: E402
from megatron_ext.spikes.detector import SpikeDetector  # noqa: E402
from tests.support.checkpoints import write_loadable_checkpoint  # noqa: E402


def _record(i: int, rng: random.Random, spike: bool = False) -> SignalRecord:
    loss = 2.0 + 3.0 / (1 + i / 1000) + rng.gauss(0, 0.02) + (2.5 if spike else 0.0)
    grad = 0.4 + rng.gauss(0, 0.03) + (4.0 if spike else 0.0)
    return SignalRecord(
        iteration=i,
        attempt=1,
        job_id="bench",
        wall_time=float(i),
        consumed_samples=1024 * i,
        skipped_samples=0,
        lm_loss=loss,
        grad_norm=grad,
        max_local_loss=loss + 0.1,
        max_loss_dp_rank=i % 64,
        params_norm=300.0,
        update_ratio=1e-4,
        lr=3e-4,
        loss_scale=1.0,
        bucket_grad_norms={f"b{j}": grad / 4 for j in range(4)},
    )


def detector_cost(steps: int) -> float:
    """Seconds per observe() over ``steps`` healthy iterations."""
    rng, detector = random.Random(0), SpikeDetector(SpikeConfig())
    records = [_record(i, rng) for i in range(1, steps + 1)]
    start = time.perf_counter()
    for r in records:
        detector.observe(r)
    return (time.perf_counter() - start) / steps


def _detector_of(revision: str, directory: Path):
    """``megatron_ext.spikes.detector`` as of ``revision``: that revision's whole package
    (``git archive``), imported in place of today's for the import only (its modules keep
    their own globals), then today's put back."""
    archive = subprocess.run(
        ["git", "archive", revision, "megatron_ext"],
        capture_output=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    today = {name: sys.modules.pop(name) for name in list(sys.modules) if _ours(name)}
    sys.path.insert(0, str(directory))
    try:
        return importlib.import_module("megatron_ext.spikes.detector")
    finally:
        sys.path.remove(str(directory))
        for name in [name for name in sys.modules if _ours(name)]:
            del sys.modules[name]
        sys.modules.update(today)


def _ours(module: str) -> bool:
    return module == "megatron_ext" or module.startswith("megatron_ext.")


def compare(revision: str, steps: int, reps: int) -> None:
    """Per-step cost of REV's detector and today's on the same records, interleaved."""
    rng = random.Random(0)
    records = [_record(i, rng) for i in range(1, steps + 1)]
    # The same records without the worst DP rank's loss: what the second signal costs.
    no_worst = [replace(r, max_local_loss=None) for r in records]
    with tempfile.TemporaryDirectory() as tmp:
        old = _detector_of(revision, Path(tmp))
        arms = {
            revision: (lambda: old.SpikeDetector(old.SpikeConfig()), records),
            "today": (lambda: SpikeDetector(SpikeConfig()), records),
            "today, no worst-rank loss": (lambda: SpikeDetector(SpikeConfig()), no_worst),
        }
        best = {name: float("inf") for name in arms}
        for _ in range(reps):
            for name, (make, replayed) in arms.items():
                detector, start = make(), time.perf_counter()
                for record in replayed:
                    detector.observe(record)
                best[name] = min(best[name], (time.perf_counter() - start) / steps)
    print(f"detector per step, best of {reps} interleaved runs over {steps:,} records:")
    for name, seconds in best.items():
        print(
            f"  {name:28} {seconds * 1e6:6.2f} us  (x{seconds / best[revision]:.2f} of {revision})"
        )


def write_log(directory: Path, iterations: int, spike_at: int) -> None:
    """A signals log plus a ledger with one unrecovered spike near its end, and checkpoints."""
    rng = random.Random(1)
    detector = SpikeDetector(SpikeConfig(patience=50))
    with (
        open(directory / "signals.jsonl", "w") as signals,
        open(directory / "spikes.jsonl", "w") as ledger,
    ):
        for i in range(1, iterations + 1):
            record = _record(i, rng, spike=i >= spike_at)
            record.attempt = 1
            signals.write(json.dumps(record.as_json(), separators=(",", ":")) + "\n")
            for event in detector.observe(record):
                ledger.write(json.dumps(event.as_json(), separators=(",", ":")) + "\n")
    ckpt = directory / "ckpt"
    for it in range(0, iterations + 1, 100):
        # Loadable (hard-linked) checkpoints: the planner verifies its rollback target.
        write_loadable_checkpoint(ckpt / f"iter_{it:07d}", link=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--iterations", type=int, default=1_000_000, help="planner log size; 0: no planner run"
    )
    parser.add_argument("--compare", metavar="REV", help="also time REV's detector (git)")
    parser.add_argument("--reps", type=int, default=7, help="runs per detector for --compare")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare, 50_000, args.reps)
    short, long = detector_cost(10_000), detector_cost(200_000)
    print(
        f"detector: {short * 1e6:.2f} us/step over 10k steps, {long * 1e6:.2f} us/step over "
        f"200k steps (ratio {long / short:.2f}: flat = O(1) amortised per step)"
    )
    if args.iterations <= 0:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        write_log(root, args.iterations, spike_at=args.iterations - 500)
        size = (root / "signals.jsonl").stat().st_size / 2**20
        print(
            f"synthetic log: {args.iterations:,} iterations, {size:.0f} MiB "
            f"(written in {time.perf_counter() - start:.1f} s)"
        )
        command = [
            sys.executable,
            "-m",
            "megatron_ext.cli",
            "skiplist",
            "--ckpt-dir",
            str(root / "ckpt"),
            "--signals-dir",
            str(root),
            "--train-iters",
            str(args.iterations + 1000),
            "--no-lookup",
        ]
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        if result.returncode != 0:
            print(result.stderr)
            return 1
        print(result.stdout.splitlines()[0])
        print(f"planner: {elapsed:.2f} s end to end (process start included; target < 5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
