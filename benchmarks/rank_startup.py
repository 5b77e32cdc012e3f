"""A CPU-runner launch start to finish, with the runner's garbage-collector threshold and with
Python's default, side by side.

``megatron_ext/cpu/run.py`` raises the young-generation threshold from 700 to 10,000 before
the rank imports torch, megatron-core and transformers. Arms, interleaved over ``--repeat``
rounds, each the demo's one-rank torchrun of the tiny model for ``--iters`` iterations from
scratch:

- ``runner``: as shipped;
- ``default gc``: the same, with ``gc.set_threshold`` made a no-op in the rank (a
  ``sitecustomize`` on ``PYTHONPATH``), so Python's 700 stays.

CPU time (user + system of torchrun and its rank, steadier on a shared machine) and wall
clock, median of the rounds, and their ratio.

    python benchmarks/rank_startup.py --repeat 5
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ext.demo import training_command  # noqa: E402


def _timed(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        raise SystemExit(
            f"failed: {' '.join(command)}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rank-startup-"))
    default_gc = root / "default-gc"
    default_gc.mkdir()
    (default_gc / "sitecustomize.py").write_text("import gc\ngc.set_threshold = lambda *a: None\n")
    workdir = root / "run"
    command = training_command(workdir, 1, options.iters, ["--save-interval", "1000000"])
    path = os.environ.get("PYTHONPATH", "")
    arms = {
        "runner": {**os.environ, "PYTHONPATH": f"{REPO}:{path}", "OMP_NUM_THREADS": "1"},
        "default gc": {
            **os.environ,
            "PYTHONPATH": f"{default_gc}:{REPO}:{path}",
            "OMP_NUM_THREADS": "1",
        },
    }
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    for _ in range(options.repeat):
        for name, env in arms.items():
            for made in ("checkpoints", "samples", "signals", "tensorboard"):
                shutil.rmtree(workdir / made, ignore_errors=True)
            figures[name].append(_timed(command, env, workdir))
    print(f"one-rank CPU-runner launch, {options.iters} iterations, {options.repeat} rounds:")
    medians = {}
    for name, runs in figures.items():
        medians[name] = [statistics.median(r[i] for r in runs) for i in (0, 1)]
        print(f"  {name:11s} wall {medians[name][0]:6.2f} s   CPU {medians[name][1]:6.2f} s")
    runner, default = medians["runner"], medians["default gc"]
    ratios = runner[0] / default[0], runner[1] / default[1]
    print(f"runner / default gc: wall {ratios[0]:.3f}, CPU {ratios[1]:.3f}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
