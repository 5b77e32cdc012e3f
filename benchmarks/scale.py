"""Start-up, lookup, plot and planner at the size of a real run, side by side at two scales.

Builds the setting of ``benchmarks/scale_setting.py`` from scratch at each ``--scales`` value
(default 1/100 and 1, the full 50 M documents / 30 B tokens / 102.4 M samples), then runs
each operation as a user runs it, a new process of the installed CLI or the real entry point
through the CPU harness, and measures that child alone: wall time and peak RSS
(``os.wait4``: the child's and its waited-for descendants' ``ru_maxrss``, so torchrun's worker
is included) and minor page faults (pages the child touched, file mappings included: a
count that does not depend on the machine's speed). The last table gives each operation's
ratio between the largest and the smallest scale, so growth is visible.

Operations (each needs the previous ones' files):

- ``megatron cache build``: the first start-up of plain Megatron, which builds the blend's
  index caches (megatron-core's ``BlendedMegatronDatasetBuilder``), then one iteration;
- ``start-up plain`` / ``start-up overlay``: the entry point with no megatron-ext flag, then
  with every overlay flag, caches present, one iteration of one sample (the start-up, not
  the first iteration's compute; the 1024-sample iteration's memory is
  ``tests/e2e/test_microbatch_memory.py`` and BENCHMARKS.md). The overlay run resumes a
  signals log as long as the benchmark's (a restart late in a run);
- ``data checks``: the overlay's start-up checks alone (``.bin``/``.idx`` pair fingerprint
  and split sizes of the 3 prefixes), in both start-ups above;
- ``lookup``: ``--iteration N --dp-rank 17``; ``--sample-log`` for the whole batch;
  ``--worst 8 --dp-rank 17``; inverse (``--document D --dataset P``), each from the DP=64
  checkpoint's args;
- ``plot``: ``megatron-ext plot`` of the signals log; ``skiplist``: the planner's plan for
  the spike at its end (``--no-lookup``).

    python benchmarks/scale.py --root /tmp/scale                  # 1/100 and full scale
    python benchmarks/scale.py --root /tmp/scale --scales 0.01,0.1
    python benchmarks/scale.py --root /tmp/scale --build-only     # build now, measure later
    python benchmarks/scale.py --root /tmp/scale --reuse          # measure what was built
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import scale_setting as setting_mod
from scale_setting import Setting

from megatron_ext.train import CPU_RUNNER

REPO = Path(__file__).resolve().parents[1]
RUNNER = CPU_RUNNER
ALL_FLAGS = [
    "--z-loss-coeff",
    "1e-4",
    "--embedding-weight-decay-mult",
    "0",
    "--output-layer-weight-decay-mult",
    "0",
    "--log-bucket-grad-norms",
    "--signals-update-ratio",
    "--spike-detect",
]


@dataclass
class Measured:
    operation: str
    seconds: float
    peak_rss: int  # bytes
    minor_faults: int
    returncode: int


def run_child(operation: str, command: list[str], log: Path, env: dict[str, str]) -> Measured:
    """Run one operation as its own process; wall time, peak RSS and faults of that child."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    result = Measured(operation, seconds, usage.ru_maxrss * 1024, usage.ru_minflt, child.returncode)
    print(
        f"  {operation}: {seconds:.1f} s, {result.peak_rss / 2**30:.2f} GiB, rc {child.returncode}",
        flush=True,
    )
    if child.returncode != 0:
        print(f"    failed, see {log}:\n{log.read_text()[-1500:]}", flush=True)
    return result


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_ext.cli", *args]


def _training(setting: Setting, built: dict, extra: list[str]) -> list[str]:
    """The entry point through the CPU harness, one rank: the run's data and sample count,
    a tiny model, one iteration of one sample (``--train-samples`` keeps the count)."""
    flags = setting_mod.training_flags(setting, built["tokenizer"])
    at = flags.index("--train-iters")
    samples = setting.train_iters * setting_mod.GLOBAL_BATCH
    flags[at : at + 2] = ["--train-samples", str(samples)]
    for name, value in (("--global-batch-size", "1"), ("--micro-batch-size", "1")):
        flags[flags.index(name) + 1] = value
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"),
        str(RUNNER),
        *built["model_flags"],
        *flags,
        *("--lr", "1e-4", "--seed", "1234", "--log-interval", "1", "--exit-interval", "1"),
        *extra,
    ]


def build(setting: Setting, tokenizer: list[str]) -> dict[str, object]:
    """Everything an operation reads, from scratch; returns what was built."""
    shutil.rmtree(setting.root, ignore_errors=True)
    setting.root.mkdir(parents=True)
    start = time.perf_counter()
    built: dict[str, object] = {"tokenizer": tokenizer, **setting_mod.build_corpus(setting)}
    flags = setting_mod.training_flags(setting, tokenizer)
    args = setting_mod.write_checkpoint_args(
        setting.root / "ckpt", setting.train_iters // 2, [*flags, "--micro-batch-size", "4"]
    )
    built["sample_log_iterations"] = setting_mod.build_sample_logs(setting, args)
    built["signals_iterations"], built["onset"] = setting_mod.build_signals(setting)
    template = setting.root / "ckpt" / f"iter_{setting.train_iters // 2:07d}" / "common.pt"
    built["planner_checkpoints"] = setting_mod.planner_checkpoints(
        setting.root / "planner-ckpt", template, int(built["signals_iterations"]) - 100
    )
    built["build_seconds"] = round(time.perf_counter() - start, 1)
    return built


def _data_checks(setting: Setting) -> list[str]:
    code = (
        "import sys\n"
        "from megatron_ext.common.records.pair import check_pair\n"
        "from megatron_ext.data.checks import split_sizes\n"
        "for prefix in sys.argv[1:]:\n"
        "    check_pair(prefix)\n"
        "    split_sizes(prefix, [(0.0, 1.0), None, None])\n"
    )
    return [sys.executable, "-c", code, *setting.prefixes]


def _trainings(setting: Setting, built: dict[str, object], start_ups: bool) -> list[Measured]:
    """The cache build and (``start_ups``) the two start-ups (plain Megatron, every overlay
    flag)."""
    root, env = setting.root, _env()
    logs = root / "logs"
    build = run_child(
        "megatron cache build", _training(setting, built, []), logs / "cache-build.txt", env
    )
    results = [build]
    if not start_ups:
        return results
    results.append(
        run_child("start-up plain", _training(setting, built, []), logs / "plain.txt", env)
    )
    overlay = root / "overlay"
    shutil.rmtree(overlay, ignore_errors=True)
    shutil.copytree(root / "signals", overlay / "signals")
    (overlay / "signals" / "spikes.jsonl").unlink()
    flags = [*ALL_FLAGS, "--signals-dir", str(overlay / "signals")]
    flags += ["--sample-log-dir", str(overlay / "samples")]
    results.append(
        run_child(
            "start-up overlay",
            _training(setting, built, flags),
            logs / "overlay.txt",
            {**env, "MEGATRON_EXT_HARNESS_COUNTS": str(overlay / "counts")},
        )
    )
    return results


def operations(
    setting: Setting,
    built: dict[str, object],
    trainings: bool = True,
    start_ups: bool = True,
    only: tuple[str, ...] | None = None,
) -> list[Measured]:
    """Run every operation once at this scale (``trainings=False``: all but the three
    training launches, on caches an earlier run built; ``start_ups=False``: the cache build
    but not the two start-ups; ``only``: of the rest, just these)."""
    root, env = setting.root, _env()
    logs = root / "logs"
    results = _trainings(setting, built, start_ups) if trainings else []
    for name, command in _queries(setting, built).items():
        if only is None or name in only:
            log = logs / f"{name.replace(' ', '_')}.txt"
            results.append(run_child(name, command, log, env))
    return results


def _queries(setting: Setting, built: dict[str, object]) -> dict[str, list[str]]:
    """The operations after the trainings, by name: the data checks, the lookups, the plot
    and the planner's plan."""
    root = setting.root
    ckpt = ["--from-checkpoint", str(root / "ckpt")]
    iteration = str(min(int(built["sample_log_iterations"]), setting.train_iters) // 2 + 1)
    samples = ["--sample-log", str(root / "samples")]
    document = str(round(setting.count("documents") * setting_mod.WEIGHTS[2]) // 2)
    # Without the sample log's layout history the lookup asks for the layout.
    layout = ["--data-parallel-size", str(setting_mod.DP)]
    layout += ["--micro-batch-size", str(setting_mod.MICRO_BATCH)]
    layout += ["--global-batch-size", str(setting_mod.GLOBAL_BATCH)]
    lookups = {
        "lookup --iteration --dp-rank": ["--iteration", iteration, "--dp-rank", "17", *layout],
        "lookup --sample-log (batch)": ["--iteration", iteration, *samples],
        "lookup --worst 8 --dp-rank": [
            *("--iteration", iteration, "--worst", "8", "--dp-rank", "17", *samples)
        ],
        "lookup inverse": ["--document", document, "--dataset", setting.prefixes[2]],
    }
    queries = {"data checks": _data_checks(setting)}
    for name, query in lookups.items():
        queries[name] = _cli("lookup", *ckpt, *query, "--out", str(root / "lookup.jsonl"))
    plot = ["plot", "--signals-dir", str(root / "signals"), "--out", str(root / "plot.png")]
    queries["plot"] = _cli(*plot)
    planner_ckpt = root / "planner-ckpt"
    shutil.rmtree(planner_ckpt / "megatron_ext_incidents", ignore_errors=True)
    plan = ["skiplist", "--ckpt-dir", str(planner_ckpt), "--signals-dir", str(root / "signals")]
    plan += ["--train-iters", str(int(built["signals_iterations"]) * 2), "--no-lookup"]
    # The spike is 80 iterations after a checkpoint boundary: the skip window must reach it
    # from the rollback target, a whole checkpoint interval back at full scale.
    interval = setting_mod.checkpoint_interval(int(built["signals_iterations"]) - 100)
    plan += ["--skip-batches", str(max(300, interval))]
    queries["skiplist (plan)"] = _cli(*plan)
    return queries


def table(by_scale: dict[float, list[Measured]]) -> str:
    """Markdown: each operation's time and peak RSS per scale, and largest/smallest ratios
    (between the smallest and largest scale that ran it; ``-`` where a scale did not)."""
    scales = sorted(by_scale)
    head = "| operation | " + " | ".join(f"{s:g}: s | {s:g}: GiB" for s in scales)
    head += " | time × | RSS × | faults × |"
    rows = [head, "|---|" + "---:|" * (2 * len(scales) + 3)]
    names = list(dict.fromkeys(m.operation for s in scales for m in by_scale[s]))
    for name in names:
        ran = [next((m for m in by_scale[s] if m.operation == name), None) for s in scales]
        cells = []
        for m in ran:
            failed = "" if m is None or m.returncode == 0 else f" (rc {m.returncode})"
            cells += (
                ["-", "-"]
                if m is None
                else [f"{m.seconds:.1f}{failed}", f"{m.peak_rss / 2**30:.2f}"]
            )
        present = [m for m in ran if m is not None]
        first, last = present[0], present[-1]
        ratios = (
            last.seconds / first.seconds,
            last.peak_rss / first.peak_rss,
            last.minor_faults / max(1, first.minor_faults),
        )
        rows.append(
            f"| {name} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{r:.2f}" for r in ratios)
            + " |"
        )
    return "\n".join(rows)


def measure_scales(
    root: Path,
    scales: list[float],
    reuse: bool = False,
    build_only: bool = False,
    trainings: bool = True,
    start_ups: bool = True,
    only: tuple[str, ...] | None = None,
) -> dict[float, list[Measured]]:
    """Build each scale under ``root`` and run every operation on it, smallest first.

    Building runs in a child: a child's peak RSS includes the memory of the process it was
    forked from (Linux records the pre-exec high-water mark), so this process stays small
    (no torch) and every figure is the operation's own. ``reuse``: a scale built before
    (its ``built.json``) is not built again (full scale takes long to build; its operations
    are what is measured; ``only``: see :func:`operations`)."""
    by_scale: dict[float, list[Measured]] = {}
    for scale in sorted(scales):
        setting = Setting(root / f"scale-{scale:g}", scale)
        print(f"scale {scale:g} in {setting.root}", flush=True)
        record = setting.root / "built.json"
        if reuse and record.is_file():
            built = json.loads(record.read_text())
        else:
            command = [sys.executable, __file__, "--root", str(root), "--build", str(root)]
            command.append(f"{scale!r}")
            output = subprocess.run(command, env=_env(), capture_output=True, text=True, check=True)
            built = json.loads(output.stdout.splitlines()[-1])
            record.write_text(json.dumps(built))
        if build_only:
            continue
        shown = {k: v for k, v in built.items() if k not in ("tokenizer", "model_flags")}
        print(f"  built: {json.dumps(shown)}", flush=True)
        by_scale[scale] = operations(setting, built, trainings, start_ups, only)
    return by_scale


def _build_main(root: Path, scale: float) -> None:
    """The ``--build`` child: the demo's BPE (reused), the setting, the model flags."""
    from megatron_ext.demo import TINY_MODEL, prepare_tiny_dataset
    from megatron_ext.train import CPU_FLAGS

    _, tokenizer = prepare_tiny_dataset(root / "tokenizer")
    built = build(Setting(root / f"scale-{scale:g}", scale), tokenizer)
    print(json.dumps({**built, "model_flags": [*TINY_MODEL, *CPU_FLAGS]}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="where each scale is built")
    parser.add_argument("--scales", default="0.01,1", help="comma-separated, e.g. 0.01,0.1")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--reuse", action="store_true", help="do not rebuild a built scale")
    parser.add_argument("--build-only", action="store_true", help="build, measure nothing")
    parser.add_argument(
        "--no-trainings", action="store_true", help="with --reuse: skip the three launches"
    )
    parser.add_argument("--build", nargs=2, metavar=("ROOT", "SCALE"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.build:
        _build_main(Path(options.build[0]), float(options.build[1]))
        return 0
    scales = [float(s) for s in options.scales.split(",")]
    by_scale = measure_scales(
        options.root, scales, options.reuse, options.build_only, not options.no_trainings
    )
    if options.build_only:
        return 0
    print(table(by_scale))
    if options.json:
        options.json.write_text(
            json.dumps({f"{s:g}": [vars(m) for m in ms] for s, ms in by_scale.items()}, indent=1)
        )
    return 1 if any(m.returncode for ms in by_scale.values() for m in ms) else 0


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.exit(main())
