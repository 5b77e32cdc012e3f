"""`megatron-ext plot` and `megatron-ext skiplist` (the plan) on signals logs of real-run size,
old code against new, side by side: wall time and peak RSS of each as its own process.

    .venv/bin/python benchmarks/plot_planner_scale.py --compare 21904f3 --older-lines \\
        --sizes 1000000,5000000 --workdir /tmp/plot-planner-scale

The log is what a default run writes (``tests/support/default_run.py``: a real record of
``megatron-ext demo``, one dataset, so per-source fields in every line, the optional signals
null; ~590 bytes a line), checked byte for byte against ``JsonlAppender`` on its first lines:
attempt 1 trains 1..N-2000, attempt 2 resumes 1000 iterations back (a rollback) and trains to
N, with a loss spike 500 iterations before N that does not recover. A checkpoint directory
every 100 iterations (50 k at 5 M). Operations:

- ``plan``: ``skiplist --no-lookup`` with the spike ledger (each attempt's config line and the
  events the detector raised over the last stretch), as after a ``--spike-detect`` run;
- ``plot``: ``megatron-ext plot`` as after a default run, which has no ledger: the detector is
  replayed over every attempt;
- ``plot (ledger)``: with the ledger's marks (the tracker ran).

``--older-lines`` writes the lines without the fields appended to ``SignalRecord`` since
(``log_z``, ``update_skipped``), as a run of an older tree wrote them, so that older code reads
them as its own. ``--compare REV`` runs REV's code (``git archive`` into a temporary
directory, first on ``PYTHONPATH``; a REV with the C scanner runs without it, as on a machine
without a compiler) on the same files, under ``prlimit --as`` (``--old-limit-gib``): on a
shared machine a run past its limit fails (reported as such) instead of taking everyone's
memory.
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
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO))  # tests.support: the default-run record, loadable checkpoints

from megatron_ext.common.io import json_safe  # noqa: E402
from megatron_ext.common.records.ledger import config_record  # noqa: E402
from megatron_ext.common.records.spike_config import SpikeConfig  # noqa: E402
from megatron_ext.spikes.detector import SpikeDetector  # noqa: E402
from tests.support.checkpoints import write_loadable_checkpoint  # noqa: E402
from tests.support.default_run import lines, record  # noqa: E402


def _values(i: int, attempt: int, rng: random.Random, spike: bool) -> dict:
    """A line's moving values: a falling loss with noise (one DP rank, as the demo: the worst
    rank's loss is the loss), its one source's loss, a grad norm; a spike adds to both."""
    loss = 2.0 + 3.0 / (1 + i / 1000) + rng.gauss(0, 0.02) + (2.5 if spike else 0.0)
    return {
        "iteration": i,
        "attempt": attempt,
        "wall_time": 1.7e9 + i * 0.1,
        "consumed_samples": 8 * i,
        "lm_loss": loss,
        "max_local_loss": loss,
        "grad_norm": 0.4 + rng.gauss(0, 0.03) + (4.0 if spike else 0.0),
        "params_norm": 20.0 + i * 1e-5,
        "lr": 3e-4,
        "source_loss": loss * (1 + rng.gauss(0, 1e-8)),
    }


def write_run(root: Path, iterations: int, appended: bool = True) -> Path:
    """Signals log, ledger and checkpoints of the run described above; returns the log."""
    signals, ckpt = root / "signals", root / "ckpt"
    signals.mkdir(parents=True)
    rng, spike_at = random.Random(0), iterations - 500
    config = SpikeConfig(patience=50)
    detector = SpikeDetector(config)
    events = []
    stretches = ((1, 1, iterations - 2000), (2, iterations - 3000 + 1, iterations))

    def moving(attempt: int, first: int, last: int) -> Iterator[dict]:
        """The stretch's values, streamed; the detector sees the last stretch's."""
        for i in range(first, last + 1):
            values = _values(i, attempt, rng, spike=attempt == 2 and i >= spike_at)
            if attempt == 2 and i > iterations - 2500:
                events.extend(e.as_json() for e in detector.observe(record(**values)))
            yield values

    with open(signals / "signals.jsonl", "w") as out:
        for stretch in stretches:
            out.writelines(lines(moving(*stretch), appended))
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
    plot = [*python, "plot", "--signals-dir", str(root / "signals"), "--out", out]
    return {
        "plot": [*plot, "--ledger", str(root / "no-ledger.jsonl")],  # a default run's
        "plot (ledger)": plot,
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
    parser.add_argument("--old-plot-max", type=int, default=10**7, help="old plot sizes <=")
    parser.add_argument("--old-limit-gib", type=float, default=8.0, help="prlimit --as, old")
    parser.add_argument(
        "--older-lines", action="store_true", help="lines without the appended fields"
    )
    parser.add_argument("--new-limit-gib", type=float, default=4.0, help="prlimit --as, new")
    parser.add_argument(
        "--workdir", type=Path, help="kept, and its runs reused (default: a temporary one)"
    )
    parser.add_argument("--build", nargs=2, help=argparse.SUPPRESS)  # ROOT SIZE: the child
    args = parser.parse_args()
    if args.build:
        write_run(Path(args.build[0]), int(args.build[1]), appended=not args.older_lines)
        return 0
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
                # In a child: a child's peak RSS counts what it was forked from, and writing
                # the checkpoints imports torch here.
                build = [sys.executable, __file__, "--build", str(root), str(size)]
                subprocess.run(build + ["--older-lines"] * args.older_lines, check=True)
                log = root / "signals" / "signals.jsonl"
                (root / "written").touch()
            mib = log.stat().st_size / 2**20
            print(
                f"{size:,} iterations: {mib:,.0f} MiB log, "
                f"{len(list((root / 'ckpt').iterdir())):,} checkpoints "
                f"(written in {time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            for operation in ("plan", "plot", "plot (ledger)"):
                figures = {}
                for arm, code in arms.items():
                    too_big = operation.startswith("plot") and size > args.old_plot_max
                    if arm != "new" and too_big:
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
