"""`megatron-ext plot` and `megatron-ext skiplist` (the plan) on signals logs of real-run size,
old code against new, side by side: wall time and peak RSS of each as its own process.

    .venv/bin/python benchmarks/plot_planner_scale.py --compare 24f31e7
    .venv/bin/python benchmarks/plot_planner_scale.py --compare 24f31e7 --sizes 1000000 \\
        --old-plot-max 1000000 --old-limit-gib 8

The log (the writer's exact format, checked line for line against ``JsonlAppender`` on a
sample): attempt 1 trains 1..N-2000, attempt 2 resumes 1000 iterations back (a rollback) and
trains to N, with a loss spike 500 iterations before N that does not recover; 4 gradient
buckets, every signal recorded (~560 bytes a line). The spike ledger holds each attempt's
config line (the run had ``--spike-detect``) and the events the detector raised over the last
stretch; a checkpoint directory every 100 iterations (50 k at 5 M). The plan runs with
``--no-lookup`` (no sample log); the plot with the ledger's marks.

``--compare REV`` runs REV's code (``git archive`` into a temporary directory, first on
``PYTHONPATH``) on the same files. The old plot held every record (3.1 GiB at 1 M, killed at
14 GiB at 5 M), so old runs go only up to ``--old-plot-max`` iterations and under ``prlimit
--as`` (``--old-limit-gib``): on a shared machine a run past its limit fails (reported as
such) instead of taking everyone's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO))  # the loadable-checkpoint helper: tests.support

from megatron_ext.io import json_safe  # noqa: E402
from megatron_ext.records.ledger import config_record  # noqa: E402
from megatron_ext.records.signals import SignalRecord  # noqa: E402
from megatron_ext.records.spike_config import SpikeConfig  # noqa: E402
from megatron_ext.spikes.detector import SpikeDetector  # noqa: E402
from tests.support.checkpoints import write_loadable_checkpoint  # noqa: E402

BUCKETS = 4
LINE = (
    '{{"iteration":{i},"attempt":{a},"job_id":"bench","wall_time":{w!r},'
    '"consumed_samples":{c},"skipped_samples":0,"lm_loss":{loss!r},"z_loss":null,'
    '"max_local_loss":{worst!r},"max_loss_dp_rank":{rank},"grad_norm":{grad!r},'
    '"bucket_grad_norms":{{{buckets}}},"params_norm":{params!r},"update_ratio":0.0001,'
    '"lr":0.0003,"loss_scale":1.0,"num_zeros":0.0,"max_attention_logit":{logit!r},'
    '"skipped_iter":false,"nan_iter":false}}\n'
)


def _record(i: int, attempt: int, rng: random.Random, spike: bool) -> SignalRecord:
    loss = 2.0 + 3.0 / (1 + i / 1000) + rng.gauss(0, 0.02) + (2.5 if spike else 0.0)
    grad = 0.4 + rng.gauss(0, 0.03) + (4.0 if spike else 0.0)
    return SignalRecord(
        iteration=i,
        attempt=attempt,
        job_id="bench",
        wall_time=1.7e9 + i,
        consumed_samples=1024 * i,
        skipped_samples=0,
        lm_loss=loss,
        max_local_loss=loss + 0.1,
        max_loss_dp_rank=i % 64,
        grad_norm=grad,
        bucket_grad_norms={f"b{j}:layers{j}": grad / BUCKETS for j in range(BUCKETS)},
        params_norm=300.0 + i * 1e-5,
        update_ratio=1e-4,
        lr=3e-4,
        loss_scale=1.0,
        num_zeros=0.0,
        max_attention_logit=20.0 + rng.random(),
    )


def _line(r: SignalRecord) -> str:
    buckets = ",".join(f'"{k}":{v!r}' for k, v in r.bucket_grad_norms.items())
    return LINE.format(
        i=r.iteration,
        a=r.attempt,
        w=r.wall_time,
        c=r.consumed_samples,
        loss=r.lm_loss,
        worst=r.max_local_loss,
        rank=r.max_loss_dp_rank,
        grad=r.grad_norm,
        buckets=buckets,
        params=r.params_norm,
        logit=r.max_attention_logit,
    )


def write_run(root: Path, iterations: int) -> Path:
    """Signals log, ledger and checkpoints of the run described above; returns the log."""
    signals, ckpt = root / "signals", root / "ckpt"
    signals.mkdir(parents=True)
    rng, spike_at = random.Random(0), iterations - 500
    config = SpikeConfig(patience=50)
    detector = SpikeDetector(config)
    events = []
    stretches = ((1, 1, iterations - 2000), (2, iterations - 3000 + 1, iterations))
    with open(signals / "signals.jsonl", "w") as out:
        for attempt, first, last in stretches:
            for i in range(first, last + 1):
                record = _record(i, attempt, rng, spike=attempt == 2 and i >= spike_at)
                line = _line(record)
                if i - first < 3:  # the template is the writer's format, byte for byte
                    expected = json.dumps(json_safe(record.as_json()), separators=(",", ":"))
                    assert line == expected + "\n", (line, expected)
                out.write(line)
                if attempt == 2 and i > iterations - 2500:
                    events += [e.as_json() for e in detector.observe(record)]
    with open(signals / "spikes.jsonl", "w") as ledger:
        for attempt, first, _ in stretches:
            line = config_record(first, attempt, config, str(ckpt), None)
            ledger.write(json.dumps(json_safe(line)) + "\n")
        for event in events:
            ledger.write(json.dumps(json_safe(event), separators=(",", ":")) + "\n")
    assert any(e["kind"] == "rollback" for e in events), "the spike did not cause a rollback"
    for it in range(100, iterations - 1000, 100):
        # Loadable (hard-linked) checkpoints: the planner verifies its rollback target.
        write_loadable_checkpoint(ckpt / f"iter_{it:07d}", link=True)
    return signals / "signals.jsonl"


def measure(
    command: list[str], code: Path, limit_gib: float | None
) -> tuple[float, float, float, str]:
    """Wall seconds, CPU seconds (user + system: steadier than wall on a shared machine) and
    peak RSS (GiB) of ``command``, run with ``code`` first on the path."""
    if limit_gib:
        command = ["prlimit", f"--as={int(limit_gib * 2**30)}", *command]
    env = {**os.environ, "PYTHONPATH": str(code)}
    start = time.perf_counter()
    process = subprocess.Popen(
        command, env=env, cwd=code, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = process.stdout.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    cpu, gib = usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20
    code_ = os.waitstatus_to_exitcode(status)
    if code_ != 0:
        last = (output.strip().splitlines() or ["?"])[-1][:120]
        return elapsed, cpu, gib, f"FAILED ({code_}): {last}"
    return elapsed, cpu, gib, "ok"


def commands(root: Path, out: str) -> dict[str, list[str]]:
    python = [sys.executable, "-W", "ignore", "-m", "megatron_ext.cli"]
    return {
        "plot": [*python, "plot", "--signals-dir", str(root / "signals"), "--out", out],
        "plan": [
            *python,
            "skiplist",
            "--ckpt-dir",
            str(root / "ckpt"),
            "--signals-dir",
            str(root / "signals"),
            "--train-iters",
            str(10**9),
            "--skip-batches",
            "1000",
            "--no-lookup",
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,2000000,5000000", help="iterations, comma")
    parser.add_argument("--compare", metavar="REV", help="the old code's git revision")
    parser.add_argument("--old-plot-max", type=int, default=1_000_000, help="old plot sizes <=")
    parser.add_argument("--old-limit-gib", type=float, default=8.0, help="prlimit --as, old")
    parser.add_argument("--new-limit-gib", type=float, default=4.0, help="prlimit --as, new")
    parser.add_argument(
        "--workdir", type=Path, help="kept, and its runs reused (default: a temporary one)"
    )
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="plot-planner-scale-"))
    arms = {"new": REPO}
    rows = []
    try:
        if args.compare:
            old = work / f"code-{args.compare}"
            old.mkdir(parents=True, exist_ok=True)
            archive = subprocess.run(
                ["git", "archive", args.compare, "megatron_ext"],
                cwd=REPO,
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            arms = {args.compare: old, "new": REPO}
        for size in [int(s) for s in args.sizes.split(",")]:
            root = work / f"run-{size}"
            start = time.perf_counter()
            if (root / "written").exists():  # a --workdir kept from an earlier run
                log = root / "signals" / "signals.jsonl"
            else:
                shutil.rmtree(root, ignore_errors=True)
                log = write_run(root, size)
                (root / "written").touch()
            mib = log.stat().st_size / 2**20
            print(
                f"{size:,} iterations: {mib:,.0f} MiB log, "
                f"{len(list((root / 'ckpt').iterdir())):,} checkpoints "
                f"(written in {time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            for operation in ("plan", "plot"):
                figures = {}
                for arm, code in arms.items():
                    if arm != "new" and operation == "plot" and size > args.old_plot_max:
                        figures[arm] = None
                        continue
                    shutil.rmtree(root / "ckpt" / "megatron_ext_incidents", ignore_errors=True)
                    command = commands(root, str(root / f"{arm}.png"))[operation]
                    limit = args.new_limit_gib if arm == "new" else args.old_limit_gib
                    figures[arm] = measure(command, code, limit)
                    seconds, cpu, gib, status = figures[arm]
                    print(
                        f"  {operation} {arm:>8}: {seconds:7.2f} s wall {cpu:7.2f} s CPU "
                        f"{gib:6.2f} GiB {status}",
                        flush=True,
                    )
                rows.append((size, mib, operation, figures))
        head = " | ".join(f"{a} wall s | {a} CPU s | {a} GiB" for a in arms)
        ratios = " | CPU ratio | memory ratio" if len(arms) > 1 else ""
        print(f"\n| iterations | log MiB | operation | {head}{ratios} |")
        print("|" + "---|" * (3 + 3 * len(arms) + (2 if len(arms) > 1 else 0)))
        for size, mib, operation, figures in rows:
            cells = []
            for arm in arms:
                f = figures[arm]
                failed = "" if f is None or f[3] == "ok" else " (failed)"
                cells += (
                    ["not run"] * 3
                    if f is None
                    else [
                        f"{f[0]:.2f}{failed}",
                        f"{f[1]:.2f}",
                        f"{f[2]:.2f}",
                    ]
                )
            if len(arms) > 1:
                old, new = figures[args.compare], figures["new"]
                if old is None or old[3] != "ok":
                    cells += ["-", "-"]
                else:
                    cells += [f"{old[1] / new[1]:.1f}x", f"{old[2] / new[2]:.1f}x"]
            print(f"| {size:,} | {mib:,.0f} | {operation} | " + " | ".join(cells) + " |")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
