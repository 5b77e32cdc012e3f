"""Recovery options after a rollback (issue #47), each driven through real rollbacks.

Every (scenario, arm) is a run of the CPU runner (torchrun, the tiny demo model) driven as the
supervisor drives one: launch; on exit 42 ``megatron-ext skiplist --apply`` (a window too short
to reach the incident is widened to what the planner names) and relaunch; until the run
finishes, the planner refuses, or ``--max-attempts``. Scenarios: ``organic@SEED``, the
instability benchmark's model and recipe (hidden 128; AdamW beta2 0.95, clip 1, no weight
decay, 60 warm-up iterations then cosine) at lr 1, where it blows up by itself near the end
of the warm-up (BENCHMARKS.md "Instabilities");
``drill@SEED``, garbage tokens at iterations 40-45 (the demo's drill, DP 1). Arms: ``none``
and each ``--recovery-*`` option over ``--recovery-iters`` updates.

Per run: incidents (attempts that ended in exit 42), repeats (resumed attempts after a
rollback that ended in exit 42 again, of the rollbacks applied), recovery lengths (updates
from each resume, skipped iterations not counted, until the lm loss is back within
``--margin`` of its mean over the 5 iterations before the onset; None: never in that
attempt), final loss (mean of the last 5 iterations; None: the run did not finish), clipped
(updates the clip scaled down).
Each run writes ``OUT/results/SCENARIO~ARM.json``; a run whose JSON exists is not rerun::

    .venv/bin/python benchmarks/recovery.py --out /tmp/recovery_out   # BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ext.common import exit_codes  # noqa: E402
from megatron_ext.common.files import applied_incidents_file  # noqa: E402
from megatron_ext.common.io import atomic_write, atomic_write_json, read_jsonl  # noqa: E402
from megatron_ext.common.records.signals import read_signals  # noqa: E402
from megatron_ext.demo import TINY_MODEL, prepare_tiny_dataset  # noqa: E402
from tests.support.harness import launch, run_skiplist  # noqa: E402

WINDOW = "20"  # --recovery-iters of every option arm
ARMS: dict[str, list[str]] = {
    "none": [],
    "lr-mult 0.1": ["--recovery-iters", WINDOW, "--recovery-lr-mult", "0.1"],
    "reset-moments": ["--recovery-iters", WINDOW, "--recovery-reset-moments"],
    "clip-update 2": ["--recovery-iters", WINDOW, "--recovery-clip-update", "2"],
    # The clip as the reset's guard: Adam's first step after it is lr x sign(g) per element.
    "reset + clip 2": ["--recovery-iters", WINDOW, "--recovery-reset-moments",
                       "--recovery-clip-update", "2"],
}  # fmt: skip
PRE_ONSET = 5  # iterations before the onset whose mean loss is the level to come back to


def training(iters: int, warmup: int, lr: float, seed: int) -> list[str]:
    """The instability benchmark's optimizer (no weight decay, beta2 0.95, clip 1)."""
    return [
        *("--micro-batch-size", "8", "--global-batch-size", "8"),
        *("--train-iters", str(iters), "--lr-warmup-iters", str(warmup)),
        *("--lr", str(lr), "--min-lr", "1e-5", "--lr-decay-style", "cosine"),
        *("--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8"),
        *("--weight-decay", "0", "--clip-grad", "1.0", "--seed", str(seed)),
        *("--log-interval", "10", "--eval-iters", "0", "--eval-interval", "100000"),
    ]


def scenario_flags(scenario: str, iters: int) -> tuple[list[str], list[str], list[str]]:
    """(training flags, extra flags, planner flags) of ``KIND@SEED``."""
    kind, seed = scenario.split("@")
    detector = ["--spike-detect", "--spike-window", "10", "--spike-warmup", "10"]
    if kind == "organic":
        extra = [*detector, "--spike-patience", "5"]
        return training(iters, 60, 1.0, int(seed)), extra, ["--skip-batches", "15"]
    if kind == "drill":
        extra = [*detector, "--spike-warmup", "20", "--spike-mad-k", "3"]
        extra += ["--spike-grad-factor", "1.5", "--spike-patience", "3"]
        extra += ["--drill-corrupt-batch", "40-45:0"]
        flags = training(iters, 5, 1e-3, int(seed))
        return flags, extra, ["--skip-batches", "12"]
    raise SystemExit(f"unknown scenario {scenario!r}: organic@SEED or drill@SEED")


def drive(work: Path, data: list[str], scenario: str, arm: str, args: Any) -> dict[str, Any]:
    """Launch, plan + apply on exit 42, relaunch: the supervisor's loop, to the end."""
    train, extra, plan = scenario_flags(scenario, args.iterations)
    model = list(TINY_MODEL)
    if scenario.startswith("organic"):  # the instability sweep's model
        model[model.index("--hidden-size") + 1] = "128"
    ckpt = work / "ckpt"
    flags = [*data, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "5"]
    flags += ["--signals-dir", str(work / "signals"), "--signals-update-ratio", *extra]
    flags += ARMS[arm]
    codes = []
    for _ in range(args.max_attempts):
        shutil.rmtree(work / "counts", ignore_errors=True)  # the last attempt's exit codes
        run = launch(work, flags, model=model, training=train, sample_log=False, timeout=900)
        chosen = {e.get("exit_code") for e in run.exits().values()}  # torchrun's own is 1
        codes.append(
            exit_codes.SPIKE_ROLLBACK if exit_codes.SPIKE_ROLLBACK in chosen else run.returncode
        )
        (work / f"log-{len(codes)}.txt").write_text(run.log)
        if codes[-1] != exit_codes.SPIKE_ROLLBACK:
            break
        planned = run_skiplist(work, "--rollback-iters", "5", *plan, "--no-lookup", "--apply")
        if wider := re.search(r"--skip-batches >= (\d+)", planned.stderr):  # as a user would
            skip = ["--skip-batches", wider[1]]
            planned = run_skiplist(work, "--rollback-iters", "5", *skip, "--no-lookup", "--apply")
        if planned.returncode != 0:
            codes.append(f"planner {planned.returncode}")
            break
    return {"codes": codes}


def summarize(work: Path, iters: int, margin: float) -> dict[str, Any]:
    """Rollbacks, recovery lengths and the final loss, from the run's own files."""
    records = read_signals(work / "signals" / "signals.jsonl")
    path = applied_incidents_file(work / "ckpt")
    applied = read_jsonl(path).records if path.exists() else []
    lengths = []
    for n, plan in enumerate(applied):
        before = [r for r in records if r.attempt == n + 1 and r.lm_loss is not None]
        level = [
            r.lm_loss for r in before if plan["onset"] - PRE_ONSET <= r.iteration < plan["onset"]
        ]
        after = [r for r in records if r.attempt == n + 2 and r.lm_loss is not None]
        back = [
            k
            for k, r in enumerate(after, 1)
            if level and r.lm_loss <= statistics.fmean(level) + margin
        ]
        lengths.append(back[0] if back else None)
    last = [r for r in records if r.attempt == len(applied) + 1 and r.lm_loss is not None]
    finished = bool(last) and last[-1].iteration == iters
    return {
        "rollbacks": len(applied),
        "recovery_lengths": lengths,
        "final_loss": statistics.fmean(r.lm_loss for r in last[-5:]) if finished else None,
        "clipped": sum(1 for r in records if r.recovery.get("clip_scale", 1.0) < 1.0),
        "onsets": [p["onset"] for p in applied],
        "targets": [p["rollback_to"] for p in applied],
    }


def run_one(args: Any, data: list[str], scenario: str, arm: str) -> dict[str, Any]:
    name = f"{scenario}~{arm.replace(' ', '_')}"
    result_path = args.out / "results" / f"{name}.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    work = args.out / "runs" / name
    if work.exists():  # a killed earlier try: start over
        shutil.rmtree(work)
    started = time.monotonic()
    driven = drive(work, data, scenario, arm, args)
    result = {
        "scenario": scenario,
        "arm": arm,
        **driven,
        **summarize(work, args.iterations, args.margin),
    }
    rolled = [c == exit_codes.SPIKE_ROLLBACK for c in driven["codes"]]
    result |= {"incidents": sum(rolled), "repeats": sum(rolled[1:])}
    result["seconds"] = round(time.monotonic() - started, 1)
    atomic_write_json(result_path, result)
    return result


def fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | arm | incidents | repeats / rollbacks | recovery lengths | final loss "
        "| clipped | attempts |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in results:
        lengths = ", ".join(fmt(n) for n in r["recovery_lengths"]) or "-"
        lines.append(
            f"| {r['scenario']} | {r['arm']} | {r['incidents']} | {r['repeats']} / "
            f"{r['rollbacks']} | {lengths} | {fmt(r['final_loss'])} | {r['clipped']} | "
            f"{len(r['codes'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scenarios", default="organic@1234,organic@1,drill@1234")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--iterations", type=int, default=120)
    p.add_argument("--max-attempts", type=int, default=4)
    p.add_argument("--margin", type=float, default=0.1, help="nats above the pre-onset level")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    document, tokenizer = prepare_tiny_dataset(args.out)
    data = ["--data-path", str(document), "--split", "100,0,0", *tokenizer]
    data += ["--data-cache-path", str(args.out / "cache")]
    results = []
    for scenario in args.scenarios.split(","):
        for arm in args.arms.split(","):
            r = run_one(args, data, scenario, arm)
            results.append(r)
            print(f"{scenario} / {arm}: {r['codes']} incidents {r['incidents']} repeats "
                  f"{r['repeats']} lengths {r['recovery_lengths']} final {fmt(r['final_loss'])} "
                  f"({r['seconds']} s)", flush=True)  # fmt: skip
    text = table(results)
    atomic_write(args.out / "table.md", text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
