"""The rungs of the GPU check (see tools/gpu_smoke.py): each fills its :class:`Rung` with
figures and passes, fails with the reason, or skips. Standard library only at import."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ext.common.files import INCIDENTS_DIR
from megatron_ext.common.records.signals import latest_per_iteration, read_signals

if TYPE_CHECKING:
    from gpu_context import Context, Rung

REPO = Path(__file__).resolve().parents[1]


def setup(ctx: Context, rung: Rung) -> None:
    venv = ctx.work / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(venv)]]
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir"]
    source = ["--no-index", "--find-links", str(ctx.wheels)] if ctx.wheels else []
    steps += [
        [*pip, *source, "--no-deps", "megatron-core==0.19.2"],
        [*pip, *source, "--no-build-isolation", "--no-deps", "-e", str(REPO)],
    ]
    for step in steps:
        result = ctx.run(step, timeout=420)
        if result.returncode:
            return rung.fail(f"{' '.join(step[:5])}...: {_tail(result)}")
    ctx.python = str(venv / "bin" / "python")
    check = ctx.run(
        [
            ctx.python,
            "-c",
            "import torch, megatron.core, megatron_ext; "
            "print(torch.__version__, torch.cuda.is_available())",
        ],
        timeout=120,
    )
    rung.figures["torch"] = check.stdout.strip()
    if check.returncode or not check.stdout.strip().endswith("True"):
        rung.fail(f"the venv does not see torch with CUDA: {_tail(check)}")


def every_feature(ctx: Context, rung: Rung, te: bool = False) -> None:
    workdir = ctx.work / ("te" if te else "features")
    flags = [
        "--z-loss-coeff",
        "1e-4",
        "--embedding-weight-decay-mult",
        "0",
        "--log-bucket-grad-norms",
        "--signals-update-ratio",
        "--spike-detect",
        "--overlap-grad-reduce",
        "--ddp-bucket-size",
        "20000",
    ]
    if te:
        flags += ["--transformer-impl", "transformer_engine"]
    result = ctx.demo(workdir, ["--fresh", "--iters", "40"], flags)
    if result.returncode:
        return rung.fail(f"training exited {result.returncode}: {_tail(result)}")
    records = latest_per_iteration(read_signals(workdir / "signals" / "signals.jsonl"))
    bad_sums = [
        r.iteration
        for r in records
        if r.grad_norm
        and abs(sum(v * v for v in r.bucket_grad_norms.values()) - r.grad_norm**2)
        > 1e-4 * r.grad_norm**2
    ]
    rung.figures.update(
        iterations=len(records),
        buckets=len(records[-1].bucket_grad_norms),
        final_lm_loss=records[-1].lm_loss,
        final_z_loss=records[-1].z_loss,
    )
    if [r.iteration for r in records] != list(range(1, 41)):
        rung.fail(f"signals hold iterations {[r.iteration for r in records][:5]}..., not 1..40")
    elif any(r.nan_iter or r.lm_loss is None for r in records):
        rung.fail("a loss was not finite")
    elif bad_sums or not records[-1].bucket_grad_norms:
        rung.fail(f"sum of bucket norms^2 != grad norm^2 at iterations {bad_sums[:5]}")


def zloss(ctx: Context, rung: Rung) -> None:
    result = ctx.run([ctx.python, str(REPO / "tools" / "gpu_zloss.py")], timeout=420)
    if result.returncode:
        return rung.fail(_tail(result))
    rung.figures.update(json.loads(result.stdout.strip().splitlines()[-1]))
    if rung.figures["time_vs_fastest_megatron"] > 1.10 or rung.figures["memory_vs_megatron"] > 1.0:
        rung.fail("over target: <= 1.10x time and <= 1.0x peak memory of the faster Megatron CE")


def fused_output_loss(ctx: Context, rung: Rung) -> None:
    """tools/gpu_fused_loss.py: peak and time against Megatron's plain and fused CE."""
    command = [
        ctx.python,
        str(REPO / "tools" / "gpu_fused_loss.py"),
        *(["--cpu"] if ctx.cpu else []),
    ]
    result = ctx.run(command, timeout=420)
    if result.returncode:
        return rung.fail(_tail(result))
    rung.figures.update(json.loads(result.stdout.strip().splitlines()[-1]))
    # The target is on what training runs: the weight as Megatron DDP leaves it.
    if not ctx.cpu and rung.figures["ddp_memory_vs_megatron_ce"] > 0.25:
        rung.fail("over target: peak <= 1/4 of Megatron's output layer + CE (under DDP)")


def overhead(ctx: Context, rung: Rung) -> None:
    """Interleaved arms; the step times are Megatron's own per-iteration console figures."""
    model = (
        []
        if ctx.cpu
        else [
            "--num-layers",
            "24",
            "--hidden-size",
            "2048",
            "--num-attention-heads",
            "16",
            "--seq-length",
            "2048",
            "--max-position-embeddings",
            "2048",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "2",
        ]
    )
    instruments = [
        "--z-loss-coeff",
        "1e-4",
        "--log-bucket-grad-norms",
        "--signals-update-ratio",
        "--spike-detect",
    ]
    rounds = 1 if ctx.cpu else 2
    # CPU: only the orchestration is rehearsed (the ratio is not judged), 10 timed steps an arm.
    iters = str(20 if ctx.cpu else 40)
    times: dict[str, list[float]] = {"off": [], "on": []}
    syncs: list[float] = []
    for round_ in range(rounds):
        for arm in ("off", "on"):
            workdir = ctx.work / f"overhead-{arm}-{round_}"
            env = (
                {}
                if ctx.cpu
                else {  # tools/gpu_sync_count/sitecustomize.py counts them
                    "MEGATRON_EXT_COUNT_SYNCS": str(workdir / "syncs.json"),
                    "PYTHONPATH": f"{REPO / 'tools' / 'gpu_sync_count'}:{REPO}",
                }
            )
            saved = dict(ctx.env)
            ctx.env.update(env)
            result = ctx.demo(
                workdir,
                ["--fresh", "--iters", iters],
                [
                    *model,
                    *(instruments if arm == "on" else []),
                    "--log-interval",
                    "1",
                    "--save-interval",
                    "1000",
                ],
            )
            ctx.env = saved
            if result.returncode:
                return rung.fail(f"{arm} arm exited {result.returncode}: {_tail(result)}")
            times[arm] += _step_times(workdir / "train.log")
            counted = workdir / "syncs.json.rank0"
            if arm == "on" and counted.is_file():
                syncs.append(json.loads(counted.read_text())["per_step"])
    off, on = (sorted(t)[len(t) // 2] for t in (times["off"], times["on"]))
    rung.figures.update(
        step_ms_off=off,
        step_ms_on=on,
        ratio=round(on / off, 4),
        steps=len(times["on"]),
        overlay_host_syncs_per_step=max(syncs) if syncs else "n/a on CPU",
    )
    if not ctx.cpu and on / off > 1.01:
        rung.fail(f"overhead {100 * (on / off - 1):.2f} % > 1 % of step time")


def _step_times(log: Path) -> list[float]:
    pattern = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+)")
    return [float(ms) for it, ms in pattern.findall(log.read_text()) if int(it) > 10]


def drill(ctx: Context, rung: Rung) -> None:
    workdir = ctx.work / "drill"
    result = ctx.demo(
        workdir, ["--drill", "--nproc", "1"], ["--drill-corrupt-batch", CORRUPT_RANK0], timeout=1200
    )
    incidents = sorted((workdir / "checkpoints" / INCIDENTS_DIR).glob("incident-*.json"))
    rung.figures.update(exit=result.returncode, incidents=len(incidents))
    if result.returncode or not incidents:
        return rung.fail(
            f"drill exit {result.returncode}, {len(incidents)} incident(s): {_tail(result)}"
        )
    plan = json.loads(incidents[0].read_text())
    rung.figures.update(onset=plan["onset"], skip_window=plan["skip_window"])
    lookup = ctx.run(
        [
            ctx.python,
            "-m",
            "megatron_ext.cli",
            "lookup",
            "--from-checkpoint",
            str(workdir / "checkpoints"),
            "--iteration",
            str(plan["onset"]),
            "--dp-rank",
            "0",
        ],
        timeout=300,
    )
    rung.figures["lookup_exit"] = lookup.returncode
    if lookup.returncode or "iteration" not in lookup.stdout:
        rung.fail(f"lookup of the onset batch failed: {_tail(lookup)}")


ASYNC_FLAGS = ["--async-save", "--use-persistent-ckpt-worker", "--save-interval", "5"]
ASYNC_REFUSAL = "--async-save is refused on the CPU runner"


def async_save(ctx: Context, rung: Rung) -> None:
    """``--async-save`` on one GPU: train to 20 with a save every 5, resume to 30; every
    checkpoint must be one the rollback planner would accept (complete, loadable files). The
    CPU runner refuses the flag (its checkpoint worker cannot start there): the rehearsal
    checks that refusal instead, and that it comes at once."""
    from megatron_ext.common.checkpoint_state import checkpoint_problem
    from megatron_ext.common.files import CHECKPOINT_DIR, read_checkpoint_tracker

    workdir = ctx.work / "async-save"
    first = ctx.demo(workdir, ["--fresh", "--iters", "20"], ASYNC_FLAGS, timeout=600)
    if ctx.cpu:
        rung.figures.update(exit=first.returncode)
        log = workdir / "train.log"  # the demo keeps the training's own output there
        said = first.stdout + first.stderr + (log.read_text() if log.exists() else "")
        if first.returncode == 0 or ASYNC_REFUSAL not in said:
            rung.fail(f"the CPU runner did not refuse --async-save: {_tail(first)}")
        return
    if first.returncode:
        return rung.fail(f"training with --async-save exited {first.returncode}: {_tail(first)}")
    second = ctx.demo(workdir, ["--iters", "30"], ASYNC_FLAGS, timeout=600)
    ckpt = workdir / "checkpoints"
    saved = sorted(p for p in ckpt.iterdir() if CHECKPOINT_DIR.match(p.name))
    problems = {p.name: why for p in saved if (why := checkpoint_problem(p))}
    rung.figures.update(
        resume_exit=second.returncode,
        tracker=read_checkpoint_tracker(ckpt),
        checkpoints=len(saved),
        damaged=problems,
    )
    if second.returncode or rung.figures["tracker"] != 30:
        rung.fail(f"the resume with --async-save ended {second.returncode}: {_tail(second)}")
    elif problems or len(saved) < 6:
        rung.fail(f"async checkpoints not loadable or missing: {problems}, {len(saved)} saved")


def transformer_engine(ctx: Context, rung: Rung) -> None:
    probe = ctx.run([ctx.python, "-c", "import transformer_engine.pytorch"], timeout=120)
    if probe.returncode:
        rung.status, rung.detail = "skip", "skipped: TE not installed"
        return
    every_feature(ctx, rung, te=True)


CORRUPT_RANK0 = "40-45:0"


def _tail(result: subprocess.CompletedProcess, n: int = 1500) -> str:
    return (result.stdout + result.stderr)[-n:]
