"""The spike detector with and without per-source baselines, on real blend runs and on a
semi-synthetic mixture sweep; and what the per-source signals cost per training step.

    python benchmarks/detector_sources.py                  # the tables in BENCHMARKS.md
    python benchmarks/detector_sources.py --workdir /tmp/ds --step-reps 2

Real runs (the CPU harness, DP=2, the tiny model, 32 samples a step, on two real sources:
the demo's prose and Python's standard library source code; ``tests/e2e/test_sources.py``
runs the same three launches and checks them):

- **stage change**: prose 90 % / code 10 % for 30 iterations, then resumed with the weights
  inverted to 42: every incident is a false one;
- **bad source**: the same first stage resumed with the code source's samples replaced by
  garbage at 36-38 on every rank (10 % of the batch): its onset must be flagged within 2
  iterations, and the culprit named.

Each log is replayed (latest record per iteration) through the detector with the run's
thresholds, ``per_source`` on and off.

Semi-synthetic sweep (SEMI-SYNTHETIC: real per-source losses, synthetic mixing): the two
sources' real per-iteration losses of the stage-change run; the average is re-mixed from them
with the code share ``a`` before iteration 31 and ``b`` from it (every a != b of the grid: a
mixture change, any flag is false), and, at constant share ``s``, with the code loss times
``1 + j`` at 36-38 (a bad source: recall within 2 iterations, culprit named).

Cost: the detector's µs per ``observe()`` on blend records, per_source on vs off (best of
interleaved repetitions); the training step (Megatron's "elapsed time per iteration", median,
launches interleaved) with ``--signals-dir`` vs ``--signals-dir --no-signals-by-dataset``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the launch helpers: tests.support

from megatron_ext.common.records.signals import SignalRecord, latest_per_iteration, read_signals  # noqa: E402
from megatron_ext.common.records.spike_config import SpikeConfig  # noqa: E402
from megatron_ext.spikes.detector import SpikeDetector, replay  # noqa: E402
from tests.support.harness import launch  # noqa: E402
from tests.support.sources import CODE, PROSE, blend_args, prepare_sources  # noqa: E402

STAGE, END, BAD = 30, 42, (36, 38)
CONFIG = SpikeConfig(
    window=8, warmup=8, loss_rel=0.05, mad_k=3.0, large_rel=0.15, large_mad_k=6.0, patience=2
)
GRID = (0.1, 0.3, 0.5, 0.7, 0.9)
SHARES, JUMPS = (0.05, 0.1, 0.2, 0.3), (0.1, 0.2, 0.4, 0.8)
ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


def _flags(work: Path, data: list[str], tokenizer: list[str], *extra: str) -> list[str]:
    detector = [
        x
        for name in (
            "window",
            "warmup",
            "loss_rel",
            "mad_k",
            "large_rel",
            "large_mad_k",
            "patience",
        )
        for x in (f"--spike-{name.replace('_', '-')}", str(getattr(CONFIG, name)))
    ]
    return [
        *data,
        *tokenizer,
        "--global-batch-size", "32", "--micro-batch-size", "4", "--train-iters", "45",
        "--lr", "3e-3", "--min-lr", "1e-4", "--lr-decay-iters", "22",
        "--signals-dir", str(work / "signals"), "--spike-detect", *detector,
        "--save", str(work / "ckpt"), "--load", str(work / "ckpt"), *extra,
    ]  # fmt: skip


def real_runs(root: Path) -> dict[str, list[SignalRecord]]:
    """The stage-change and bad-source logs (launched unless ``root`` has them)."""
    prefixes, tokenizer = prepare_sources(root / "data")
    cache = root / "data" / "index-cache"
    stage1 = {PROSE: 0.9, CODE: 0.1}
    first = root / "stage1"
    if not (first / "ckpt" / "latest_checkpointed_iteration.txt").exists():
        data = blend_args(prefixes, stage1, cache)
        args = _flags(
            first, data, tokenizer, "--save-interval", str(STAGE), "--exit-interval", str(STAGE)
        )
        assert launch(first, args, nproc=2, sample_log=False).returncode == 0
    runs = {}
    drill = ["--drill-corrupt-batch", f"{BAD[0]}-{BAD[1]}:*", "--drill-corrupt-source", CODE]
    for name, weights, extra in (
        ("stage change", {PROSE: 0.1, CODE: 0.9}, []),
        ("bad source", stage1, drill),
    ):
        work = root / name.replace(" ", "-")
        log = work / "signals" / "signals.jsonl"
        if not log.exists():
            for part in ("ckpt", "signals"):
                shutil.copytree(first / part, work / part)
            data = blend_args(prefixes, weights, cache)
            args = _flags(
                work, data, tokenizer, "--save-interval", "100", "--exit-interval", str(END), *extra
            )
            launch(work, args, nproc=2, sample_log=False)  # the bad source exits 42
        runs[name] = latest_per_iteration(read_signals(log))
    return runs


def _flagged(events) -> list:
    return [e for e in events if e.kind in ("spike", "divergence")]


def judge_real(runs: dict[str, list[SignalRecord]]) -> None:
    print("\n### Real blend runs (prose + Python stdlib code, CPU loop, DP=2)\n")
    print("| run | per-source | incidents | first flag (onset) | culprit source |")
    print("|---|---|---:|---|---|")
    for name, records in runs.items():
        if name == "bad source":
            records = [r for r in records if r.iteration <= BAD[1]]  # the run stopped there
        for on in (True, False):
            flags = _flagged(replay(records, replace(CONFIG, per_source=on)))
            first = f"{flags[0].iteration} ({flags[0].onset})" if flags else "-"
            culprit = (flags[0].culprit_source or "-") if flags else "-"
            print(f"| {name} | {'on' if on else 'off'} | {len(flags)} | {first} | {culprit} |")


def _mix(base: list[SignalRecord], share, scale=lambda i: 1.0) -> list[SignalRecord]:
    """The real per-source losses of ``base``, re-mixed: code share ``share(i)``, code loss
    times ``scale(i)``; a batch without a member takes its last value."""
    out, last = [], {}
    for r in base:
        last |= r.lm_loss_by_dataset
        losses = {PROSE: last[PROSE], CODE: last[CODE] * scale(r.iteration)}
        s = share(r.iteration)
        tokens = {PROSE: round(2048 * (1 - s)), CODE: round(2048 * s)}
        mean = sum(losses[n] * t for n, t in tokens.items()) / sum(tokens.values())
        worst = None if r.max_local_loss is None else mean + r.max_local_loss - r.lm_loss
        out.append(
            replace(
                r,
                lm_loss=mean,
                max_local_loss=worst,  # the real worst-rank excess over the re-mixed average
                lm_loss_by_dataset=losses,
                tokens_by_dataset=tokens,
            )
        )
    return out


def sweep(base: list[SignalRecord]) -> None:
    base = [r for r in base if PROSE in r.lm_loss_by_dataset or r.iteration > 1]
    changes = [(a, b) for a in GRID for b in GRID if a != b]
    print("\n### Mixture sweep (SEMI-SYNTHETIC: the stage-change run's real per-source losses, ")
    print("re-mixed)\n")
    print("| case | per-source on | per-source off |")
    print("|---|---:|---:|")
    false = {True: 0, False: 0}
    for a, b in changes:
        records = _mix(base, lambda i, a=a, b=b: a if i <= STAGE else b)
        for on in (True, False):
            false[on] += bool(_flagged(replay(records, replace(CONFIG, per_source=on))))
    print(
        f"| mixture changes with a false incident (of {len(changes)}: code share a -> b at "
        f"{STAGE + 1}, a != b in {GRID}) | {false[True]} | {false[False]} |"
    )
    for s in SHARES:
        hits, named = {True: 0, False: 0}, 0
        for j in JUMPS:
            records = _mix(
                base, lambda i, s=s: s, lambda i, j=j: 1 + j if BAD[0] <= i <= BAD[1] else 1
            )
            for on in (True, False):
                flags = _flagged(replay(records, replace(CONFIG, per_source=on)))
                hit = [f for f in flags if BAD[0] <= f.iteration <= BAD[0] + 2]
                hits[on] += bool(hit) and not [f for f in flags if f.iteration < BAD[0]]
                named += on and bool(hit) and hit[0].culprit_source == CODE
        print(
            f"| bad source at share {s:.0%}, code loss +{'/+'.join(f'{j:.0%}' for j in JUMPS)}"
            f" at {BAD[0]}-{BAD[1]}: flagged within 2 (culprit named) | {hits[True]}/"
            f"{len(JUMPS)} ({named}) | {hits[False]}/{len(JUMPS)} |"
        )


def observe_cost(base: list[SignalRecord], reps: int) -> None:
    """µs per observe() on blend records, per_source on vs off, interleaved, best of reps."""
    records = (_mix(base, lambda i: 0.1) * 200)[:8000]
    records = [replace(r, iteration=i + 1) for i, r in enumerate(records)]
    best = {True: float("inf"), False: float("inf")}
    for _ in range(reps):
        for on in (False, True):
            detector = SpikeDetector(replace(CONFIG, window=100, warmup=100, per_source=on))
            start = time.perf_counter()
            for record in records:
                detector.observe(record)
                if detector.state == "rollback":
                    detector.resume()
            best[on] = min(best[on], (time.perf_counter() - start) / len(records) * 1e6)
    print("\n### Detector cost per observe() (blend records, best of interleaved reps)\n")
    print("| per-source | µs | ratio |")
    print("|---|---:|---:|")
    for on in (False, True):
        print(f"| {'on' if on else 'off'} | {best[on]:.2f} | {best[on] / best[False]:.2f} |")


def accumulator_cost(reps: int) -> None:
    """The per-source work of one step in isolation, on the step's shapes (4 micro-batches of
    4 x 64 tokens per rank, 2 members): on_loss's index_add per micro-batch and the read at
    the end (single process: the all-reduce of 4 float64 is not included)."""
    import torch

    from megatron_ext.telemetry.sources import SourceAccumulator

    accumulator = SourceAccumulator([PROSE, CODE], "cpu")
    per_token, mask = torch.rand(4, 64), torch.ones(4 * 64)
    ids = torch.tensor([0, 0, 1, 0])
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(200):
            for _ in range(4):
                accumulator.add(per_token, mask, ids)
            accumulator.reduce(None)
        best = min(best, (time.perf_counter() - start) / 200 * 1e6)
    print("\n### Per-source work per training step, isolated (CPU, best of reps)\n")
    print(f"{best:.1f} µs per step (4 x add + 1 read); collectives: 1 all-reduce of 2K float64")
    print("per step on the last stage's TP x DP x CP group; host syncs of its own: 0 (the read")
    print("is after Megatron's own logging has synchronised)")


def step_cost(root: Path, reps: int, iters: int) -> None:
    """Median training step with and without the per-source fields, launches interleaved."""
    prefixes, tokenizer = prepare_sources(root / "data")
    data = blend_args(prefixes, {PROSE: 0.9, CODE: 0.1}, root / "data" / "index-cache")
    common = [*data, *tokenizer, "--global-batch-size", "32", "--micro-batch-size", "4"]
    common += ["--train-iters", str(iters), "--log-interval", "1"]
    times: dict[str, list[float]] = {"on": [], "off": []}
    medians: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(reps):
        for arm in ("off", "on"):
            work = root / f"step-{arm}-{rep}"
            shutil.rmtree(work, ignore_errors=True)
            extra = ["--signals-dir", str(work / "signals")]
            if arm == "off":
                extra.append("--no-signals-by-dataset")
            run = launch(work, [*common, *extra], nproc=2, sample_log=False)
            assert run.returncode == 0, run.log[-2000:]
            steps = [float(ms) for it, ms in ELAPSED.findall(run.log) if int(it) > 3]
            times[arm] += steps
            medians[arm].append(statistics.median(steps))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"\n### Training step (CPU harness, DP=2, {reps} interleaved launches per arm)\n")
    print("| per-source signals | median ms/step | ratio | per-launch medians |")
    print("|---|---:|---:|---|")
    for arm, value in (("off (--no-signals-by-dataset)", off), ("on", on)):
        launches = ", ".join(f"{m:.0f}" for m in medians[arm.split()[0]])
        print(f"| {arm} | {value:.1f} | {value / off:.3f} | {launches} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/detector-sources-bench"))
    parser.add_argument("--reps", type=int, default=5, help="observe() timing repetitions")
    parser.add_argument("--step-reps", type=int, default=2, help="launches per step-time arm")
    parser.add_argument("--step-iters", type=int, default=30)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs = real_runs(args.workdir)
    judge_real(runs)
    sweep(runs["stage change"])
    observe_cost(runs["stage change"], args.reps)
    accumulator_cost(args.reps)
    if args.step_reps:
        step_cost(args.workdir, args.step_reps, args.step_iters)


if __name__ == "__main__":
    main()
