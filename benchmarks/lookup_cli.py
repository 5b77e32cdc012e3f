"""``megatron-ext lookup`` as a user runs it: a new process answering one micro-batch of one
DP rank from a checkpoint, start to finish, side by side with an older checkout.

The answer itself takes milliseconds (``benchmarks/lookup.py``); what a user waits for is the
process: interpreter start, imports, reading the checkpoint's saved args, parsing the run's
flags, opening the caches. Arms, interleaved over ``--repeat`` rounds (median and best):

- ``python -c pass``: the interpreter alone, the floor;
- ``import torch`` and ``import megatron.core``: what any Megatron import costs;
- ``lookup``: this checkout (``PYTHONPATH`` = this checkout);
- ``lookup --text``: also decodes the tokens (builds the run's tokenizer with Megatron);
- ``lookup --from-sample-log``: the same micro-batch from the run's sample log alone (sample
  ids, token SHA-1s, losses; no Megatron, no torch);
- with ``--baseline DIR``: the same lookup run by another checkout of megatron-ext, e.g. the
  one before this change: ``git archive cea90f0 | tar -x -C /tmp/base``.

Wall clock, and CPU time (user + system of the child, steadier on a shared machine). The run
looked up is the demo's tiny model, trained into a temp dir first (``--workdir`` reuses one).

    python benchmarks/lookup_cli.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ITERS = 10


def _timed(command: list[str], pythonpath: Path) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # cwd too: `python -m` puts the working directory first on sys.path.
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=pythonpath)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(
            f"failed: {' '.join(command)}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _prepare(workdir: Path) -> None:
    if (workdir / "checkpoints" / "latest_checkpointed_iteration.txt").is_file():
        return
    command = [sys.executable, "-m", "megatron_ext.cli", "demo", "--workdir", str(workdir)]
    print(f"training the demo model for {ITERS} iterations into {workdir} ...", flush=True)
    subprocess.run(
        [*command, "--iters", str(ITERS)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        capture_output=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="an existing demo run (default: a temp dir)")
    parser.add_argument("--baseline", type=Path, help="another megatron-ext checkout to compare")
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lookup-cli-") as scratch:
        workdir = (options.workdir or Path(scratch) / "demo").resolve()
        _prepare(workdir)
        ckpt = workdir / "checkpoints"
        iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
        query = [
            "lookup",
            "--from-checkpoint",
            str(ckpt),
            "--iteration",
            str(iteration),
            "--dp-rank",
            "0",
            "--microbatch",
            "0",
        ]
        cli = [sys.executable, "-m", "megatron_ext.cli", *query]
        arms: dict[str, tuple[list[str], Path]] = {
            "python -c pass": ([sys.executable, "-c", "pass"], REPO),
            "import torch": ([sys.executable, "-c", "import torch"], REPO),
            "import megatron.core": (
                [sys.executable, "-W", "ignore", "-c", "import megatron.core"],
                REPO,
            ),
            "lookup (this checkout)": (cli, REPO),
            "lookup --text (this checkout)": ([*cli, "--text"], REPO),
            "lookup --from-sample-log (this checkout)": ([*cli, "--from-sample-log"], REPO),
        }
        if options.baseline:
            arms["lookup (baseline)"] = (cli, options.baseline.resolve())
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        for _ in range(options.repeat):
            for name, (command, path) in arms.items():
                times[name].append(_timed(command, path))
    reference = "lookup (baseline)" if options.baseline else "import megatron.core"
    ref_wall = statistics.median(w for w, _ in times[reference])
    ref_cpu = statistics.median(c for _, c in times[reference])
    print(f"\n{options.repeat} rounds; ratios to '{reference}'")
    print("| arm | wall median s | wall best s | CPU median s | wall × | CPU × |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, samples in times.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        best = min(w for w, _ in samples)
        print(
            f"| {name} | {wall:.2f} | {best:.2f} | {cpu:.2f} | "
            f"{wall / ref_wall:.3f} | {cpu / ref_cpu:.3f} |"
        )


if __name__ == "__main__":
    main()
