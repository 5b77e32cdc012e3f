"""The GPU check as a ladder of rungs, for a bare one-GPU Hopper machine, in about 10 minutes.

    bash tools/gpu_smoke.sh                    # on the GPU machine, from the repository root
    bash tools/gpu_smoke.sh --cpu-rehearsal    # rungs 2, 4, 5, 7-10 through the CPU harness (CI)

Each rung prints one JSON line (rung, name, status pass|fail|skip, seconds, the estimate of its
GPU time and the basis of that estimate, figures, detail); a failing rung does not stop the
ones after it unless they need what it built. The run ends with a summary line and exits 1 if
any rung failed.

1. set-up from bare: a venv (``--system-site-packages``: the machine's own torch), then
   megatron-core and this package from pip; from ``--wheels DIR`` when the machine has no
   registry (carry ``pip download megatron-core==0.19.2 --no-deps`` with the tree);
2. every feature on one GPU: one rank, ``--transformer-impl local``, bf16, z-loss, weight-decay
   overrides, bucket norms, signals with the update ratio, the spike detector and the sample
   log: losses finite, Σ bucket² = grad-norm² every step, one signals record per iteration;
3. z-loss on CUDA against Megatron's CE, plain and fused (``tools/gpu_zloss.py``);
4. overlay overhead: every instrument on vs off, interleaved, on a model whose step takes
   >= ~100 ms; the host syncs per step the overlay adds (``tools/gpu_sync_count.py``);
5. the drill on one GPU (DP=1, bad batch on rank 0) -> plan -> apply -> restart -> lookup;
6. Transformer Engine, only when it imports (its torch extension is source-only on PyPI);
7. ``--fused-output-loss`` against Megatron's output layer + CE, plain and fused
   (``tools/gpu_fused_loss.py``): peak CUDA memory and time (CPU rehearsal: a tiny size);
8. ``--async-save``: train with a save every 5 iterations, resume, every checkpoint complete
   and loadable as the rollback planner checks it (CPU rehearsal: the CPU runner refuses it);
9. context parallelism (CP=2) and 10. TP=2 + ``--sequence-parallel``: every feature against the
   same run on one rank (``tools/gpu_rungs_parallel.py``); they need 2 GPUs and Transformer
   Engine and skip, saying so, on a one-GPU machine (CPU rehearsal: the layout's refusal, and
   the comparison on TP=2 without SP);
11. Megatron-Bridge at CP=2: every feature against Bridge alone, the Bridge tier's GPU row
   (``tools/gpu_rungs_parallel.py``); it needs rung 9's GPUs and TE and megatron-bridge
   (``tools/bridge_venv.sh``), and skips, saying which is missing, elsewhere.

Only the standard library is imported here: this runs before the venv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "tools"))
from gpu_context import Context, Rung  # noqa: E402
from gpu_rungs import (  # noqa: E402
    async_save,
    drill,
    every_feature,
    fused_output_loss,
    overhead,
    setup,
    transformer_engine,
    zloss,
)
from gpu_rungs_parallel import bridge_layout, parallel_layout  # noqa: E402

REHEARSAL = (2, 4, 5, 7, 8, 9, 10)  # what the CPU rehearsal runs (the rest need CUDA or a venv)


# -- rungs ----------------------------------------------------------------------------------


RUNGS: dict[int, tuple[str, Callable[[Context, Rung], None]]] = {
    1: ("set-up from bare", setup),
    2: ("every feature on one GPU", every_feature),
    3: ("z-loss vs Megatron CE on CUDA", zloss),
    4: ("overlay overhead", overhead),
    5: ("drill on one GPU", drill),
    6: ("Transformer Engine", transformer_engine),
    7: ("fused output loss vs Megatron CE on CUDA", fused_output_loss),
    8: ("async save on one GPU", async_save),
    9: ("context parallelism CP=2 vs one rank", parallel_layout),
    10: ("TP=2 + sequence parallelism vs one rank", parallel_layout),
    11: ("Bridge at CP=2 vs Bridge alone", bridge_layout),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="rungs 2, 4, 5, 7-10 on the tiny model through the CPU harness",
    )
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "gpu-smoke")
    parser.add_argument(
        "--wheels",
        type=Path,
        help="pip --find-links DIR for a machine without a package registry (rung 1)",
    )
    options = parser.parse_args(argv)
    work = options.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    # The launches get the caller's PATH (the CPU rehearsal: the tests' C toolchain stand-ins).
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    }
    if options.cpu_rehearsal:  # the tiny model on one intra-op thread: more only spin
        env["OMP_NUM_THREADS"] = "1"
    ctx = Context(options.cpu_rehearsal, work, sys.executable, options.wheels, env)
    results = []
    for number, (name, body) in RUNGS.items():
        rung = Rung(number, name)
        if options.cpu_rehearsal and number not in REHEARSAL:
            rung.status, rung.detail = "skip", "not in the CPU rehearsal (needs CUDA or a venv)"
        elif number > 1 and results and results[0].status == "fail":
            rung.status, rung.detail = "skip", "set-up failed"
        else:
            try:
                body(ctx, rung)
            except Exception as exc:  # a rung's crash is its failure, not the ladder's
                rung.fail(f"{type(exc).__name__}: {exc}")
        results.append(rung)
        print(rung.line(), flush=True)
    failed = [r.number for r in results if r.status == "fail"]
    print(
        json.dumps(
            {
                "summary": {r.number: r.status for r in results},
                "failed": failed,
                "mode": "cpu-rehearsal" if options.cpu_rehearsal else "gpu",
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
