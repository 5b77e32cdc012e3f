"""Rungs 9 and 10 of the GPU check (tools/gpu_smoke.py): context parallelism (CP=2) and tensor
parallelism with sequence parallelism (TP=2 + SP), every feature against the same run on one
rank. Standard library only at import.

What they need, and why the lent machine skips them: two GPUs (NCCL refuses two ranks on one
GPU, "Duplicate GPU detected"; gloo cannot carry TE's CUDA-tensor collectives) and Transformer
Engine (CP needs TEDotProductAttention, SP TE's or Apex's norms; TE's torch extension is
source-only on PyPI). On such a machine the tiny model trains 10 iterations on one rank, and
each layout resumes that run's checkpoint of iteration 5 (optimizer included: a fresh TP=2
model is initialised otherwise) and trains 6-10, with the same global batch and padded
vocabulary, every feature on (z-loss and log Z, fused output loss, weight-decay multipliers,
bucket norms, update ratio, per-source signals, spike detector, sample log; not
--signals-attention-logit, which reads the local attention only) and
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron asserts it for TP/CP); every signal and sample
record of 6-10 is compared with the one-rank run's (:func:`compare`).

The CPU rehearsal cannot run CP or SP (no TE, no Apex): it runs the comparison on a layout the
CPU runs with the same data (TP=2 without SP) against the same one-rank run, so the
orchestration and the comparison cannot rot between GPU loans. That the CPU runner refuses CP
and SP at start-up, with the reason, is tests/e2e/test_layouts.py's
``test_sequence_and_context_parallelism_are_refused_without_transformer_engine`` (the
rehearsal launched the same refusals again until 2026-12-03).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ext.common.files import CHECKPOINT_TRACKER_FILE, checkpoint_dir
from megatron_ext.common.records.sample_log import read_records
from megatron_ext.common.records.signals import latest_per_iteration, read_signals

if TYPE_CHECKING:
    from gpu_context import Context, Rung

ITERS = 10
START = ITERS // 2  # the demo saves every ITERS // 2: the layouts start from there
LAYOUTS = {
    9: ["--context-parallel-size", "2"],
    10: ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
}
STAND_IN = ["--tensor-model-parallel-size", "2"]  # what the CPU rehearsal compares instead
FEATURES = [
    "--z-loss-coeff",
    "1e-4",
    "--log-output-z",
    "--fused-output-loss",
    "--embedding-weight-decay-mult",
    "0",
    "--log-bucket-grad-norms",
    "--signals-update-ratio",
    "--spike-detect",
    "--global-batch-size",
    "8",  # the demo's default grows with --nproc: one global batch for every arm
    "--make-vocab-size-divisible-by",
    "64",  # Megatron pads to 128 x TP: TP=2 would be another model
    "--log-interval",
    "1",
]
# DP=1 in every arm: the worst DP rank's loss is the whole batch's (under CP: all CP ranks').
SIGNALS = (
    "lm_loss",
    "z_loss",
    "log_z",
    "max_local_loss",
    "grad_norm",
    "params_norm",
    "update_ratio",
)


def requirement_missing(ctx: Context) -> str | None:
    """Why this machine cannot run the layouts (None: it can)."""
    probe = (
        "import importlib.util as u, torch; "
        "print(torch.cuda.device_count(), u.find_spec('transformer_engine') is not None)"
    )
    found = ctx.run([ctx.python, "-c", probe], timeout=120).stdout.split()
    gpus, te = (int(found[0]), found[1] == "True") if len(found) == 2 else (0, False)
    if gpus >= 2 and te:
        return None
    return (
        "needs 2 GPUs (NCCL refuses two ranks on one GPU) and Transformer Engine (CP needs "
        f"TEDotProductAttention, SP TE's norms): found {gpus} GPU(s), TE "
        f"{'importable' if te else 'not importable'}"
    )


def _train(ctx: Context, name: str, nproc: int, layout: list[str]) -> Path:
    """One arm, cached for the ladder's run (rungs 9 and 10 share the one-rank run). A layout
    arm starts from the one-rank run's checkpoint of START, optimizer included (torch_dist
    reshards it): a fresh TP=2 model is initialised otherwise than a TP=1 one."""
    workdir = ctx.work / f"parallel-{name}"
    if name in ctx.cache:
        return workdir
    options = ["--iters", str(ITERS), "--nproc", str(nproc)]
    flags = [*FEATURES, *([] if ctx.cpu else ["--transformer-impl", "transformer_engine"])]
    if layout:
        shutil.rmtree(workdir, ignore_errors=True)
        start = checkpoint_dir(ctx.work / "parallel-one-rank" / "checkpoints", START)
        shutil.copytree(start, workdir / "checkpoints" / start.name)
        (workdir / "checkpoints" / CHECKPOINT_TRACKER_FILE).write_text(str(START))
        flags += [*layout, "--no-load-rng"]
    else:
        options.append("--fresh")
    saved = dict(ctx.env)
    ctx.env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    ctx.cache[name] = ctx.demo(workdir, options, flags, timeout=900)
    ctx.env = saved
    return workdir


def _failure(ctx: Context, name: str) -> str | None:
    result: subprocess.CompletedProcess = ctx.cache[name]
    if result.returncode:
        return f"{name} exited {result.returncode}: {(result.stdout + result.stderr)[-1200:]}"
    return None


def compare(reference: Path, candidate: Path, rtol: float) -> tuple[dict, list[str]]:
    """Every signal and sample record of ``candidate`` (iterations START + 1..ITERS, from the
    reference's checkpoint of START) against ``reference`` (the same iterations on one rank):
    figures and the differences found (empty: they agree)."""
    ref_runs, got_runs = (
        latest_per_iteration(read_signals(d / "signals" / "signals.jsonl"))
        for d in (reference, candidate)
    )
    problems: list[str] = []
    ref_runs = [r for r in ref_runs if r.iteration > START]
    if [r.iteration for r in got_runs] != list(range(START + 1, ITERS + 1)):
        problems.append(f"iterations {[r.iteration for r in got_runs]}, not {START + 1}..{ITERS}")
    worst = _compare_signals(ref_runs, got_runs, problems)
    problems += [f"{k} differs by {v:.2e} (> {rtol})" for k, v in worst.items() if v > rtol]
    micro_batches = _compare_samples(reference, candidate, rtol, problems)
    figures = {f"max_rel_diff_{k}": float(f"{v:.3g}") for k, v in worst.items()}
    figures |= {"iterations": len(got_runs), "micro_batches": micro_batches}
    return figures, problems


def _compare_signals(ref_runs: list, got_runs: list, problems: list[str]) -> dict[str, float]:
    """The largest relative difference per signal; adds missing values, other token counts and
    a bucket-norm sum off the grad norm to ``problems``."""
    worst = dict.fromkeys(SIGNALS, 0.0)
    for ref, got in zip(ref_runs, got_runs):
        pairs = [(f, getattr(ref, f), getattr(got, f)) for f in SIGNALS]
        pairs += [
            ("lm_loss", v, got.lm_loss_by_dataset.get(k)) for k, v in ref.lm_loss_by_dataset.items()
        ]
        for field, a, b in pairs:
            if a is None or b is None:
                if (a is None) != (b is None):
                    problems.append(f"iteration {ref.iteration}: {field} {b} vs {a}")
                continue
            worst[field] = max(worst[field], abs(b - a) / max(abs(a), 1e-12))
        if got.tokens_by_dataset != ref.tokens_by_dataset:
            problems.append(f"iteration {ref.iteration}: tokens {got.tokens_by_dataset}")
        squares = sum(v * v for v in got.bucket_grad_norms.values())
        if not got.bucket_grad_norms or abs(squares - got.grad_norm**2) > 1e-4 * got.grad_norm**2:
            problems.append(f"iteration {ref.iteration}: sum of bucket norms^2 != grad norm^2")
    return worst


def _compare_samples(reference: Path, candidate: Path, rtol: float, problems: list[str]) -> int:
    """The candidate's sample records against the reference's past START (differences added to
    ``problems``); returns how many micro-batches the candidate logged."""
    (ref_samples, _), (samples, twice) = _samples(reference), _samples(candidate)
    ref_samples = {k: v for k, v in ref_samples.items() if k[0] > START}
    if twice or samples.keys() != ref_samples.keys():
        problems.append(f"the sample log holds other micro-batches ({twice} written twice)")
    for key in samples.keys() & ref_samples.keys():
        (ids, digests, tokens, losses), mine = ref_samples[key], samples[key]
        if (ids, digests, tokens) != mine[:3]:
            problems.append(f"micro-batch {key}: other samples, digests or token count")
        elif any(abs(y - x) > rtol * abs(x) for x, y in zip(losses, mine[3])):
            problems.append(f"micro-batch {key}: per-sample losses differ")
    return len(samples)


def _samples(workdir: Path) -> tuple[dict[tuple[int, int, int], tuple], int]:
    """Sample records by (iteration, DP rank, micro-batch), and how many came twice."""
    records: dict[tuple[int, int, int], tuple] = {}
    twice = 0
    for path in sorted((workdir / "samples").glob("samples-dp*.jsonl")):
        for r in read_records(path):
            key = (r.iteration, r.dp_rank, r.microbatch)
            twice += key in records
            records[key] = (r.sample_ids, r.token_sha1, r.num_tokens, r.sample_losses)
    return records, twice


def parallel_layout(ctx: Context, rung: Rung) -> None:
    """Rung 9 or 10 (by ``rung.number``): the layout against the one-rank run."""
    layout = LAYOUTS[rung.number]
    if not ctx.cpu and (missing := requirement_missing(ctx)):
        rung.status, rung.detail = "skip", f"skipped: {missing}"
        return
    reference = _train(ctx, "one-rank", 1, [])
    if failed := _failure(ctx, "one-rank"):
        return rung.fail(failed)
    if ctx.cpu:
        candidate, name = _train(ctx, "stand-in", 2, STAND_IN), "stand-in"
    else:
        name = f"layout-{rung.number}"
        candidate = _train(ctx, name, 2, layout)
    if failed := _failure(ctx, name):
        return rung.fail(failed)
    figures, problems = compare(reference, candidate, rtol=1e-4 if ctx.cpu else 3e-2)
    rung.figures.update(figures, compared=" ".join(STAND_IN if ctx.cpu else layout))
    if problems:
        rung.fail("; ".join(problems[:5]))


BRIDGE_ROW = "tests/bridge/test_bridge_layouts.py::test_the_overlay_at_a_bridge_layout[cp2-gpu]"


def bridge_layout(ctx: Context, rung: Rung) -> None:
    """Rung 11: Megatron-Bridge's ``pretrain`` at CP=2 with every feature against Bridge alone,
    the Bridge tier's GPU row (tests/bridge/test_bridge_layouts.py: first-iteration loss and
    grad norm, Σ bucket² = grad-norm², per-source mean, sample log, lookup, validation). The row
    itself says what it needs (two GPUs and TE) when it skips; megatron-bridge must be in this
    interpreter (tools/bridge_venv.sh)."""
    probe = "import importlib.util as u; print(u.find_spec('megatron.bridge') is not None)"
    if ctx.run([ctx.python, "-c", probe], timeout=120).stdout.strip() != "True":
        rung.status, rung.detail = "skip", "skipped: megatron-bridge is not importable here"
        return
    pytest = [ctx.python, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rs"]
    result = ctx.run([*pytest, "-m", "bridge", BRIDGE_ROW], timeout=1500)
    lines = result.stdout.strip().splitlines() or [""]
    rung.figures.update(pytest=lines[-1])
    skipped = [line.split(": ", 1)[-1] for line in lines if line.startswith("SKIPPED")]
    if result.returncode == 0 and skipped:
        rung.status, rung.detail = "skip", f"skipped: {skipped[0]}"
    elif result.returncode or " passed" not in lines[-1]:
        rung.fail((result.stdout + result.stderr)[-1500:])
