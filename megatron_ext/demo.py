"""``megatron-ext demo``: a tiny corpus and model made on the fly, trained by the real loop
(``pretrain_gpt_ext.py`` on a GPU, else through the CPU runner).

Each mode has its own work directory (``runs/demo``, ``runs/demo-drill``). A plain demo resumes
from its checkpoints; ``--fresh`` starts over, as the drill always does.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

import torch

from megatron_ext.common.checkpoint_state import UnreadableState, read_saved_args
from megatron_ext.common.files import (
    CHECKPOINT_TRACKER_FILE,
    SPIKE_LEDGER_FILE,
    checkpoint_dir,
    incident_stem,
)
from megatron_ext.common.io import read_jsonl
from megatron_ext.data import preprocess
from megatron_ext.data.corpus import write_tiny_corpus
from megatron_ext.data.tokenizer import megatron_tokenizer_args
from megatron_ext.train import CPU_FLAGS, ENTRY_POINT, cpu_runner, torchrun

WORKDIRS = {False: Path("runs/demo"), True: Path("runs/demo-drill")}  # by --drill
# A tiny Llama-style GPT (RoPE, RMSNorm, SwiGLU, untied output layer).
TINY_MODEL = shlex.split(
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --position-embedding-type rope --normalization RMSNorm "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights"
)
WARMUP_ITERS = 5  # the demo's --lr-warmup-iters (Megatron asserts warmup < train iters)
# The incident drill: garbage tokens on DP rank 1 for iterations 40-45, caught by a detector
# tuned for a 60-iteration run of this tiny model (also the Slurm drills' in tests/e2e), then
# a rollback to a checkpoint >= 5 iterations before the onset and a 12-batch skip window.
TINY_DETECTOR = shlex.split(
    "--spike-detect --spike-window 10 --spike-warmup 20 --spike-mad-k 3 "
    "--spike-grad-factor 1.5 --spike-patience 3"
)
DRILL_FLAGS = [
    *shlex.split("--z-loss-coeff 1e-4 --log-bucket-grad-norms"),
    *TINY_DETECTOR,
    *shlex.split("--drill-corrupt-batch 40-45:1 --save-interval 5"),
]
DRILL_PLAN = ["--rollback-iters", "5", "--skip-batches", "12"]
MAX_DRILL_ROLLBACKS = 2

# What the console shows of a launch (train.log gets every line): not Megatron's argument
# dump ("  name ........ value"), nor anything from torchrun's report of a failed worker on
# (the worker's own message above it already says what went wrong).
_ARGUMENT_DUMP = re.compile(r"^\s*\S+ \.{2,} ")
_LAUNCHER_FAILED = re.compile(r"elastic.*\bfailed \(exitcode")


def shown(line: str) -> bool:
    """Iteration and validation lines, megatron-ext messages and errors; not Megatron's
    argument dump or its per-checkpoint memory report."""
    if _ARGUMENT_DUMP.match(line) or "memory (MB)" in line:
        return False
    return " iteration " in line or "megatron-ext" in line or "error" in line.lower()


def console(lines: Iterable[str], log: TextIO) -> Iterator[str]:
    """Every line into ``log``; the :func:`shown` ones back, until torchrun reports a failed
    worker."""
    reported = False
    for line in lines:
        log.write(line)
        reported = reported or bool(_LAUNCHER_FAILED.search(line))
        if not reported and shown(line):
            yield line.rstrip()


def prepare_tiny_dataset(workdir: Path) -> tuple[Path, list[str]]:
    """Write a synthetic corpus with ids, train a BPE on it and preprocess it with a
    provenance sidecar (reused when present); the data prefix and the tokenizer flags."""
    data_dir = workdir / "data"
    prefix = data_dir / "tiny"
    document = Path(f"{prefix}_text_document")
    tokenizer_dir = data_dir / "tiny_tokenizer"
    if not document.with_suffix(".idx").exists():
        shutil.rmtree(data_dir, ignore_errors=True)
        data_dir.mkdir(parents=True)
        corpus = write_tiny_corpus(data_dir / "corpus.jsonl", ids=True)
        flags = shlex.split("--train-tokenizer --vocab-size 1024 --workers 2 --provenance-key id")
        status = preprocess.main(
            [
                *("--input", str(corpus), "--output-prefix", str(prefix)),
                *("--tokenizer-out", str(tokenizer_dir), *flags),
            ]
        )
        if status != 0:
            raise RuntimeError("preprocessing the demo corpus failed (see the message above)")
    return document, megatron_tokenizer_args(tokenizer_dir)


def training_command(workdir: Path, nproc: int, iters: int, extra: list[str]) -> list[str]:
    """The torchrun command the demo runs (GPU: entry point; CPU: through the CPU runner)."""
    document, tokenizer_args = prepare_tiny_dataset(workdir)
    on_gpu = torch.cuda.is_available()
    script = ENTRY_POINT if on_gpu else cpu_runner("demo")
    schedule = (
        f"--micro-batch-size 4 --global-batch-size {8 * nproc} --train-iters {iters} --lr 3e-3 "
        f"--min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters {WARMUP_ITERS} "
        "--weight-decay 0.1 --clip-grad 1.0 --seed 1234 --log-interval 5 "
        f"--eval-interval {iters} --eval-iters 2"
    )
    where = {"checkpoints": workdir / "checkpoints", "cache": workdir / "index-cache"}
    return torchrun(
        script,
        nproc,
        [
            *TINY_MODEL,
            *([] if on_gpu else CPU_FLAGS),
            *schedule.split(" "),
            *("--data-path", str(document), "--split", "98,2,0", *tokenizer_args),
            *("--data-cache-path", str(where["cache"])),
            *("--save", str(where["checkpoints"]), "--load", str(where["checkpoints"])),
            *("--save-interval", str(max(1, iters // 2))),
            *("--tensorboard-dir", str(workdir / "tensorboard")),
            *("--sample-log-dir", str(workdir / "samples")),
            *extra,
        ],
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-ext demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help=f"where data, checkpoints and logs go (default: {WORKDIRS[False]}; "
        f"{WORKDIRS[True]} with --drill)",
    )
    parser.add_argument(
        "--iters", type=int, help="training iterations (default 40; 60 with --drill)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        help="processes, data parallel (default 1; 2 with --drill)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="delete checkpoints and logs from an earlier demo first (the drill always does)",
    )
    parser.add_argument(
        "--drill",
        action="store_true",
        help="the incident drill: bad batch on DP rank 1 -> spike exit -> "
        "megatron-ext skiplist --apply -> restart past the spike",
    )
    parser.add_argument(
        "extra", nargs=argparse.REMAINDER, help="after --: more Megatron / megatron-ext flags"
    )
    return parser


def _train(command: list[str], workdir: Path, log_path: Path) -> int:
    """Run one launch, echoing iteration lines and megatron-ext messages."""
    print("+ " + " ".join(command), flush=True)
    with open(log_path, "a") as log:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir
        )
        assert process.stdout is not None
        for line in console(process.stdout, log):
            print(line, flush=True)
        return process.wait()


def _rollback_requests(workdir: Path) -> int:
    ledger = workdir / "signals" / SPIKE_LEDGER_FILE
    if not ledger.exists():
        return 0
    return sum(e.get("kind") == "rollback" for e in read_jsonl(ledger).records)


def _given(extra: list[str], iters: int, global_batch: int) -> tuple[int, int]:
    """``--train-iters`` and ``--global-batch-size`` as the training will parse them."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--train-iters", type=int, default=iters)
    parser.add_argument("--global-batch-size", type=int, default=global_batch)
    known, _ = parser.parse_known_args(extra)
    return known.train_iters, known.global_batch_size


def _left_to_train(workdir: Path, iters: int, global_batch: int) -> int | None:
    """Iterations a resume would train: None for a fresh start, 0 when the checkpoints are
    complete. Exits with a hint when they belong to another schedule (Megatron refuses to
    resume a changed --train-iters or global batch: the LR schedule would not match)."""
    ckpt = workdir / "checkpoints"
    tracker = ckpt / CHECKPOINT_TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise SystemExit(
            f"megatron-ext demo: {tracker} holds {text!r}, not an iteration number (a save cut "
            "short?). Add --fresh to start over, or --workdir DIR to train elsewhere."
        )
    done = int(text)
    try:
        saved = read_saved_args(checkpoint_dir(ckpt, done))
    except (UnreadableState, OSError):
        return iters - done  # let Megatron read it and decide
    if (saved.train_iters, saved.global_batch_size) != (iters, global_batch):
        raise SystemExit(
            f"megatron-ext demo: {ckpt} holds a run of {saved.train_iters} iterations at global "
            f"batch {saved.global_batch_size}; this demo asks for {iters} at {global_batch}, "
            "which Megatron refuses to resume (the LR schedule would change). Add --fresh to "
            "start over, or --workdir DIR to train elsewhere."
        )
    return iters - done


def _summary(workdir: Path, shown: Path, log_path: Path, status: int, iters: int) -> str:
    incidents = sorted(incident_stem(workdir / "checkpoints", 1).parent.glob("*.md"))
    # How the user invoked us (.venv/bin/megatron-ext), for copy-pasteable next steps.
    tool = sys.argv[0] if Path(sys.argv[0]).name == "megatron-ext" else "megatron-ext"
    return (
        f"\ntraining log:   {log_path}\ncheckpoints:    {workdir / 'checkpoints'}\n"
        f"tensorboard:    {workdir / 'tensorboard'}\nsample log:     {workdir / 'samples'}\n"
        f"signals:        {workdir / 'signals'}\n"
        + "".join(f"incident:       {p}\n" for p in incidents)
        + f"exit status:    {status}\n"
        + (
            "\nnext steps:\n"
            f"  {tool} plot --signals-dir {shown / 'signals'}\n"
            f"  {tool} lookup --from-checkpoint {shown / 'checkpoints'} --iteration {iters} "
            "--dp-rank 0\n"
            "  (plot draws loss, grad norm, params norm and spike candidates to a PNG; lookup "
            "says which documents and tokens DP rank 0 trained on at that iteration: add "
            "--text to decode them)"
            if status == 0
            else ""
        )
    )


def _drill_rollback(workdir: Path, number: int) -> bool:
    """The drill's expected spike exit: plan and apply the rollback (skiplist --apply)."""
    print(
        "\ndemo: as expected, the spike detector ended training with exit code 42 to request "
        "a rollback (torchrun's report of it is in train.log)"
    )
    print(f"demo: spike exit -> megatron-ext skiplist --apply (rollback {number})")
    from megatron_ext.incidents.cli import main as skiplist

    dirs = ["--ckpt-dir", str(workdir / "checkpoints"), "--signals-dir", str(workdir / "signals")]
    return skiplist([*dirs, "--apply", *DRILL_PLAN]) == 0


def _run(args: argparse.Namespace, command: list[str], workdir: Path, log_path: Path) -> int:
    """Train; in the drill, roll back and train again after each expected spike exit."""
    status = _train(command, workdir, log_path)
    rollbacks = 0
    while args.drill and status != 0 and _rollback_requests(workdir) > rollbacks:
        rollbacks += 1
        if rollbacks > MAX_DRILL_ROLLBACKS:
            print(f"demo: more than {MAX_DRILL_ROLLBACKS} rollbacks; stopping")
            break
        if not _drill_rollback(workdir, rollbacks):
            break
        status = _train(command, workdir, log_path)
    return status


def _settings(args: argparse.Namespace, shown: Path, workdir: Path) -> tuple[int, int]:
    """``--iters`` and ``--nproc`` (their defaults when not given); refuses values that cannot
    train and a ``--workdir`` that is, or lies under, a file."""
    error = build_parser().error
    taken = next((p for p in (workdir, *workdir.parents) if p.exists() and not p.is_dir()), None)
    if taken is not None:
        error(f"--workdir {shown}: {taken} is a file; give a folder (made if missing)")
    iters = (60 if args.drill else 40) if args.iters is None else args.iters
    if iters <= WARMUP_ITERS:
        error(
            f"--iters {iters}: the demo warms the learning rate up over {WARMUP_ITERS} "
            f"iterations (--lr-warmup-iters), so it needs at least {WARMUP_ITERS + 1}"
        )
    nproc = (2 if args.drill else 1) if args.nproc is None else args.nproc
    if nproc < 1:
        error(f"--nproc {nproc}: give at least 1 process")
    return iters, nproc


def main(argv: list[str] | None = None) -> int:
    """Prepare data, train (drill: plan, apply and restart), print where everything went."""
    args = build_parser().parse_args(argv)
    shown = args.workdir or WORKDIRS[args.drill]
    workdir = shown.resolve()
    iters, nproc = _settings(args, shown, workdir)
    if args.fresh or args.drill:
        for sub in ("checkpoints", "tensorboard", "samples", "signals", "train.log"):
            shutil.rmtree(workdir / sub, ignore_errors=True)
            (workdir / sub).unlink(missing_ok=True)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    extra = [
        *(DRILL_FLAGS if args.drill else []),
        "--log-layer-norms",
        "--signals-dir",
        str(workdir / "signals"),
        *extra,
    ]
    log_path = workdir / "train.log"
    # A flag after -- wins over the demo's own (argparse takes the last): compare a resume
    # with what the training will run with.
    left = _left_to_train(workdir, *_given(extra, iters, 8 * nproc))
    if left is not None and left <= 0:
        print(
            f"demo: {shown} already trained all {iters} iterations; nothing left to train. "
            "--fresh starts over, --workdir DIR trains elsewhere."
        )
        print(_summary(workdir, shown, log_path, 0, iters))
        return 0
    status = _run(args, training_command(workdir, nproc, iters, extra), workdir, log_path)
    print(_summary(workdir, shown, log_path, status, iters))
    return status
