"""Learning-rate sensitivity of small GPTs in the real Megatron loop on CPU, per stability arm.

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities") show that the two large-scale failures, attention-logit growth and output-logit
divergence, appear in small models at high learning rates, and that qk-layernorm and an
output z-loss of 1e-4 remove them. This benchmark repeats that protocol at CPU scale: each
(arm, rate) is one real ``torchrun`` of the CPU runner on the tiny demo corpus (a Llama-style
GPT, untied output layer) with the paper's optimizer (AdamW, beta2 0.95, eps 1e-8, clip 1,
linear warm-up then cosine decay to 1e-5) and no weight decay (the paper's output-logit
divergence needs it off). Arms add one intervention each to that baseline: ``z-loss``
(``--z-loss-coeff 1e-4``), ``qk-layernorm`` (``--qk-layernorm``) and ``skip``
(``--spike-skip-update``, the adaptive update skip, armed after 20 steps, with the detector
only watching); ``qk-layernorm+z-loss`` is the paper's output-logit experiment (z-loss with
the attention failure already removed).

It prints, in markdown, the paper's learning-rate-sensitivity table (final loss per rate per
arm, and the sensitivity E_lr[min(final, initial) - best final]), where each run blew up and
diverged, and log Z / max-attention-logit trajectories where the runner logs them
(``--log-output-z``, ``--signals-attention-logit``: used when this megatron-ext has them).
Definitions (margin ``--margin``, 1 nat): a run *blows up* at the first iteration whose lm loss
is non-finite or exceeds the lowest loss so far by the margin; it *diverged* when it ends
non-finite or early, above its initial loss, or above its own lowest loss by the margin, and
then diverged *at* the first iteration after which it never came back within the margin; it
*failed* (✗) when its final loss is above the sweep's best final loss by the margin.

Each run writes ``OUT/results/ARM@RATE.json`` (per-iteration lm_loss, grad_norm, log_z,
max_attention_logit, z_loss, lr, skip flags, and the summary above); a run whose JSON exists
is not rerun, so a killed sweep resumes. ``OUT/table.md`` and ``OUT/sweep.json`` hold the
tables and all summaries. One training at a time, one intra-op thread::

    .venv/bin/python benchmarks/instability.py --out /tmp/instability_out   # BENCHMARKS.md
    .venv/bin/python benchmarks/instability.py --iterations 300 --rates 0.1,1 \\
        --arms baseline,z-loss --out /tmp/inst_small
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from megatron_ext.common.io import atomic_write, atomic_write_json, from_json
from megatron_ext.common.records.signals import latest_per_iteration, read_signals
from megatron_ext.demo import prepare_tiny_dataset
from megatron_ext.train import CPU_FLAGS, cpu_runner

ARMS: dict[str, list[str]] = {
    "baseline": [],
    "z-loss": ["--z-loss-coeff", "1e-4"],
    "qk-layernorm": ["--qk-layernorm"],
    # The paper's output-logit experiment: z-loss with the attention failure already removed.
    "qk-layernorm+z-loss": ["--qk-layernorm", "--z-loss-coeff", "1e-4"],
    # The gate arms after --spike-warmup steps: the detector's default (100) is past the
    # warm-up peak where these runs blow up. Patience and streak as long as any run: the
    # detector only watches (a rollback needs a supervisor); the skip alone is measured.
    "skip": ["--spike-detect", "--spike-skip-update", "--spike-window", "20",
             "--spike-warmup", "20", "--spike-patience", "1000000",
             "--spike-skip-streak", "1000000"],
}  # fmt: skip
# Observability only (the same in every arm); left out where this megatron-ext lacks them.
SIGNAL_FLAGS = ["--log-output-z", "--signals-attention-logit"]
RATES = "1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1"
TRACES = ("lm_loss", "grad_norm", "log_z", "max_attention_logit", "z_loss", "lr")
LONG_BLOWUP = 10  # iterations above the margin that make a recovered blow-up worth marking
POINTS = 5  # trajectory samples per run in the markdown (start, quarters, end)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iterations", type=int, default=600)
    p.add_argument("--rates", default=RATES, help="comma-separated peak learning rates")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="global = micro (one rank)")
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--margin", type=float, default=1.0, help="nats; see the definitions")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.arms = args.arms.split(",")
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        p.error(f"unknown arm(s) {unknown}: choose from {list(ARMS)}")
    return args


def supported(flags: list[str]) -> list[str]:
    """The flags of ``flags`` that this megatron-ext's features accept (all store_true)."""
    with warnings.catch_warnings():  # importing Megatron warns of every missing CUDA kernel
        warnings.simplefilter("ignore")
        from megatron_ext.loop.install import add_megatron_ext_args
    parser = add_megatron_ext_args(argparse.ArgumentParser(add_help=False))
    return [f for f in flags if not parser.parse_known_args([f])[1]]


def run_name(arm: str, rate: float) -> str:
    """The run's folder and result name: the resume key."""
    return f"{arm}@{rate:g}"


def command(
    args: argparse.Namespace, data: tuple[Path, list[str]], arm: str, rate: float, workdir: Path
) -> list[str]:
    """The torchrun command of one (arm, rate): the paper's recipe on the tiny model."""
    document, tokenizer = data
    seq, iters = str(args.seq_length), args.iterations
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
        str(cpu_runner("instability benchmark")),
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", seq, "--max-position-embeddings", seq,
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", *CPU_FLAGS,
        "--micro-batch-size", str(args.batch_size), "--global-batch-size", str(args.batch_size),
        "--train-iters", str(iters), "--lr", f"{rate:g}", "--min-lr", "1e-5",
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, round(args.warmup_fraction * iters))),
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
        "--weight-decay", f"{args.weight_decay:g}", "--clip-grad", "1.0",
        "--seed", str(args.seed), "--log-interval", "10",
        "--eval-iters", "0", "--eval-interval", str(10 * iters),
        "--data-path", str(document), "--split", "100,0,0", *tokenizer,
        "--data-cache-path", str(args.out / "cache"),
        "--signals-dir", str(workdir / "signals"),
        *args.signal_flags, *ARMS[arm],
    ]  # fmt: skip


def finite(value: float | None) -> bool:
    """A measured, finite number (signals hold None where a value was not measured)."""
    return value is not None and math.isfinite(value)


def peak(values: list[float | None]) -> float | None:
    """The largest finite value (None: not measured, or never finite)."""
    return max((v for v in values if finite(v)), default=None)


def summarize(
    losses: list[float | None], iterations: list[int], planned: int, margin: float
) -> dict[str, Any]:
    """Final loss, blow-up and divergence iterations of one run (definitions: module doc)."""
    tail = losses[-max(1, planned // 20) :]
    complete = bool(iterations) and iterations[-1] == planned and all(map(finite, tail))
    final = sum(tail) / len(tail) if complete else math.nan
    initial = losses[0] if losses and finite(losses[0]) else math.nan
    lowest, back = math.inf, 0  # back: the last iteration within the margin of the lowest
    excursions: list[list[int]] = []  # [first, last] iterations of each stretch above it
    for iteration, loss in zip(iterations, losses):
        if finite(loss) and loss <= lowest + margin:
            back, lowest = iteration, min(lowest, loss)
        elif excursions and excursions[-1][1] == iteration - 1:
            excursions[-1][1] = iteration
        else:
            excursions.append([iteration, iteration])
        if not finite(loss):
            break  # nothing after a non-finite loss means anything
    blowup = excursions[0][0] if excursions else None
    diverged = not complete or final >= initial or final > lowest + margin
    # A run that never left the margin (flat at its initial loss) has no divergence onset.
    onset = back + 1 if back < (iterations[-1] if complete else planned) else blowup
    return {
        "initial_loss": initial,
        "final_loss": final,
        "lowest_loss": lowest if math.isfinite(lowest) else math.nan,
        "completed_iterations": iterations[-1] if iterations else 0,
        "blowup_iteration": blowup,
        "blowups": excursions,
        "diverged": diverged,
        "diverged_at": onset if diverged else None,
    }


def run_one(
    args: argparse.Namespace, data: tuple[Path, list[str]], arm: str, rate: float
) -> dict[str, Any]:
    """Train one (arm, rate), or load its result when an earlier sweep finished it."""
    result_path = args.out / "results" / f"{run_name(arm, rate)}.json"
    if result_path.exists():  # summaries recomputed: the definitions may have changed since
        result = from_json(json.loads(result_path.read_text()))
        planned = int(result["command"][result["command"].index("--train-iters") + 1])
        return {**result, **summarize(result["lm_loss"], result["iteration"], planned, args.margin)}
    workdir = args.out / "runs" / run_name(arm, rate)
    (workdir / "signals").mkdir(parents=True, exist_ok=True)
    (workdir / "signals" / "signals.jsonl").unlink(missing_ok=True)  # a killed earlier try
    cmd = command(args, data, arm, rate, workdir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    with open(workdir / "log.txt", "w") as log:
        try:
            rc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=args.timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.monotonic() - started
    signals = workdir / "signals" / "signals.jsonl"
    records = latest_per_iteration(read_signals(signals)) if signals.exists() else []
    traces = {name: [getattr(r, name) for r in records] for name in TRACES}
    result = {
        "arm": arm, "rate": rate, "returncode": rc, "seconds": round(seconds, 1),
        "command": cmd,
        "iteration": [r.iteration for r in records],
        **traces,
        "update_skipped": [r.iteration for r in records if r.update_skipped],
        "skipped_iter": [r.iteration for r in records if r.skipped_iter],
        "peak_attention_logit": peak(traces["max_attention_logit"]),
        "peak_abs_log_z": peak([abs(v) if finite(v) else None for v in traces["log_z"]]),
        **summarize(traces["lm_loss"], [r.iteration for r in records], args.iterations,
                    args.margin),
    }  # fmt: skip
    atomic_write_json(result_path, result)
    return result


def fmt(value: float | None, spec: str = ".3f") -> str:
    """A table cell: ``—`` for not measured."""
    return "—" if value is None else format(value, spec)


def sensitivity(results: list[dict[str, Any]]) -> float:
    """The paper's LR sensitivity: mean over rates of min(final, initial) - best final."""
    capped = [min(r["final_loss"], r["initial_loss"]) if finite(r["final_loss"])
              else r["initial_loss"] for r in results]  # fmt: skip
    return sum(capped) / len(capped) - min(capped)


def loss_table(
    runs: dict[tuple[str, float], dict[str, Any]],
    arms: list[str],
    rates: list[float],
    margin: float,
) -> list[str]:
    """Final loss per rate (rows) and arm (columns); ``✗``: more than ``margin`` above the
    sweep's best; ``†N``: diverged, never recovered from N; ``↑N``: a blow-up of at least
    ``LONG_BLOWUP`` iterations from N, recovered from."""
    lines = ["| peak lr | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    best = min((r["final_loss"] for r in runs.values() if finite(r["final_loss"])), default=0)
    for rate in rates:
        cells = []
        for arm in arms:
            r = runs[arm, rate]
            cell = fmt(r["final_loss"]) if finite(r["final_loss"]) else "nan"
            cell += " ✗" if not r["final_loss"] <= best + margin else ""
            long = [a for a, b in r["blowups"] if b - a + 1 >= LONG_BLOWUP]
            if r["diverged"]:
                cell += f" †{r['diverged_at']}"
            elif long:
                cell += f" ↑{long[0]}"
            cells.append(cell)
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    lines.append(
        "| **LR sensitivity** | "
        + " | ".join(fmt(sensitivity([runs[arm, rate] for rate in rates])) for arm in arms)
        + " |"
    )
    return lines


def at_points(values: list[float | None], spec: str) -> str:
    """A trajectory in one cell: ``POINTS`` evenly spaced values, start and end included."""
    if not values or all(v is None for v in values):
        return "—"
    picks = [values[min(len(values) - 1, k * (len(values) - 1) // (POINTS - 1))]
             for k in range(POINTS)]  # fmt: skip
    return " → ".join(fmt(v, spec) for v in picks)


def stretches(blowups: list[list[int]]) -> str:
    """The first blow-up and the longest, as iteration ranges, and how many there were."""
    if not blowups:
        return "—"
    first, longest = blowups[0], max(blowups, key=lambda e: e[1] - e[0])
    shown = [first] if longest is first else [first, longest]
    text = ", longest ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in shown)
    return text + (f" ({len(blowups)} in all)" if len(blowups) > 1 else "")


def run_table(
    runs: dict[tuple[str, float], dict[str, Any]], arms: list[str], rates: list[float]
) -> list[str]:
    """Per run: blow-up / divergence iterations and trajectories (start, quarters, end)."""
    lines = [
        "| arm | peak lr | blow-ups (iterations) | diverged at | skipped updates | lm loss | "
        "log Z | max attention logit | grad norm | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        for rate in rates:
            r = runs[arm, rate]
            lines.append(
                f"| {arm} | {rate:g} | {stretches(r['blowups'])} | "
                f"{r['diverged_at'] or '—'} | {len(r['update_skipped'])} | "
                f"{at_points(r['lm_loss'], '.2f')} | {at_points(r['log_z'], '.3g')} | "
                f"{at_points(r['max_attention_logit'], '.3g')} | "
                f"{at_points(r['grad_norm'], '.2g')} | {r['seconds']:.0f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.signal_flags = supported(SIGNAL_FLAGS)
    missing = [f for f in SIGNAL_FLAGS if f not in args.signal_flags]
    if "skip" in args.arms and not supported(["--spike-skip-update"]):
        print("this megatron-ext has no --spike-skip-update: the skip arm is left out")
        args.arms.remove("skip")
    if missing:
        print(f"this megatron-ext lacks {missing}: those trajectories stay empty")
    args.out = args.out.resolve()
    data = prepare_tiny_dataset(args.out)
    runs = {}
    for arm in args.arms:
        for rate in args.rates:
            r = run_one(args, data, arm, rate)
            runs[arm, rate] = r
            print(f"{run_name(arm, rate)}: final {fmt(r['final_loss'])}, blow-up at "
                  f"{r['blowup_iteration']}, diverged at {r['diverged_at']} ({r['seconds']} s, "
                  f"rc {r['returncode']})", flush=True)  # fmt: skip
    setup = (
        f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} "
        f"heads, seq {args.seq_length}, batch {args.batch_size}, {args.iterations} iterations, "
        f"warm-up {args.warmup_fraction:g}, weight decay {args.weight_decay:g}, "
        f"margin {args.margin:g} nats"
    )
    text = "\n".join([
        f"Setup: {setup}.", "",
        "Final lm loss (mean of the last 5% of iterations); ✗: above the sweep's best by more "
        f"than the margin; †N: diverged, for good from iteration N; ↑N: blew up for "
        f"{LONG_BLOWUP}+ iterations from N and recovered.", "",
        *loss_table(runs, args.arms, args.rates, args.margin), "",
        "Per run (trajectories: start → quarters → end):", "",
        *run_table(runs, args.arms, args.rates), "",
    ])  # fmt: skip
    print(text)
    atomic_write(args.out / "table.md", text)
    summary_keys = (
        "arm",
        "rate",
        "returncode",
        "seconds",
        "initial_loss",
        "final_loss",
        "lowest_loss",
        "completed_iterations",
        "blowup_iteration",
        "blowups",
        "diverged",
        "diverged_at",
        "peak_attention_logit",
        "peak_abs_log_z",
    )
    atomic_write_json(args.out / "sweep.json", {
        "setup": setup, "signal_flags": args.signal_flags,
        "runs": [{k: r[k] for k in summary_keys} for r in runs.values()],
        "sensitivity": {arm: sensitivity([runs[arm, rate] for rate in args.rates])
                        for arm in args.arms},
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
