"""``megatron-ext demo``: a tiny corpus and model made on the fly, trained by the real loop.

On a GPU machine it runs ``pretrain_gpt_ext.py`` directly. Without a GPU it runs the same
entry point through the repository's CPU harness (``tests/cpu_harness/run.py``), which the
installed package never imports: the demo only points ``torchrun`` at it, so the CPU demo
needs a source checkout.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from megatron_ext.data import preprocess
from megatron_ext.data.corpus import write_tiny_corpus
from megatron_ext.data.tokenizer import megatron_tokenizer_args
from megatron_ext.files import SPIKE_LEDGER_FILE, incident_stem
from megatron_ext.io import read_jsonl

REPO = Path(__file__).resolve().parents[1]
CPU_RUNNER = REPO / "tests" / "cpu_harness" / "run.py"
ENTRY_POINT = REPO / "pretrain_gpt_ext.py"

# A tiny Llama-style GPT (RoPE, RMSNorm, SwiGLU, untied output layer).
TINY_MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]
# Megatron's fused CUDA kernels are unavailable on CPU; dropout is off because CPU dropout
# draws from the same generator the data loader seeds from, which breaks exact resume there.
CPU_FLAGS = [
    "--distributed-backend",
    "gloo",
    "--use-cpu-initialization",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]


def prepare_tiny_dataset(workdir: Path) -> tuple[Path, list[str]]:
    """Write a synthetic corpus, train a BPE on it and preprocess it (reused when present).

    Returns the Megatron data prefix and the tokenizer flags that load the tokenizer.
    """
    data_dir = workdir / "data"
    prefix = data_dir / "tiny"
    document = Path(f"{prefix}_text_document")
    tokenizer_dir = data_dir / "tiny_tokenizer"
    if not document.with_suffix(".idx").exists():
        shutil.rmtree(data_dir, ignore_errors=True)
        data_dir.mkdir(parents=True)
        corpus = write_tiny_corpus(data_dir / "corpus.jsonl")
        status = preprocess.main(
            [
                "--input",
                str(corpus),
                "--output-prefix",
                str(prefix),
                "--train-tokenizer",
                "--vocab-size",
                "1024",
                "--tokenizer-out",
                str(tokenizer_dir),
                "--workers",
                "2",
            ]
        )
        if status != 0:
            raise RuntimeError("preprocessing the demo corpus failed (see the message above)")
    return document, megatron_tokenizer_args(tokenizer_dir)


def training_command(workdir: Path, nproc: int, iters: int, extra: list[str]) -> list[str]:
    """The torchrun command the demo runs (GPU: entry point; CPU: through the harness)."""
    document, tokenizer_args = prepare_tiny_dataset(workdir)
    on_gpu = torch.cuda.is_available()
    script = ENTRY_POINT if on_gpu else CPU_RUNNER
    if not script.exists():
        raise SystemExit(
            f"megatron-ext demo: {script} not found; the demo runs from a source checkout "
            "(git clone, then pip install -e .)"
        )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *TINY_MODEL,
        *([] if on_gpu else CPU_FLAGS),
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        str(8 * nproc),
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "5",
        "--weight-decay",
        "0.1",
        "--clip-grad",
        "1.0",
        "--seed",
        "1234",
        "--log-interval",
        "5",
        "--eval-interval",
        str(iters),
        "--eval-iters",
        "2",
        "--data-path",
        str(document),
        "--split",
        "98,2,0",
        *tokenizer_args,
        "--data-cache-path",
        str(workdir / "index-cache"),
        "--save",
        str(workdir / "checkpoints"),
        "--load",
        str(workdir / "checkpoints"),
        "--save-interval",
        str(max(1, iters // 2)),
        "--tensorboard-dir",
        str(workdir / "tensorboard"),
        "--sample-log-dir",
        str(workdir / "samples"),
        *extra,
    ]


# The incident drill: garbage tokens on DP rank 1 for iterations 40-45, caught by a detector
# tuned for a 60-iteration run (short window, low MAD factor: the tiny model's loss is still
# falling steeply), then a rollback to a checkpoint >= 5 iterations before the onset and a
# 12-batch skip window.
DRILL_FLAGS = [
    "--z-loss-coeff",
    "1e-4",
    "--log-bucket-grad-norms",
    "--spike-detect",
    "--spike-window",
    "10",
    "--spike-warmup",
    "20",
    "--spike-mad-k",
    "3",
    "--spike-grad-factor",
    "1.5",
    "--spike-patience",
    "3",
    "--drill-corrupt-batch",
    "40-45:1",
    "--save-interval",
    "5",
]
DRILL_PLAN = ["--rollback-iters", "5", "--skip-batches", "12"]
MAX_DRILL_ROLLBACKS = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-ext demo", description=__doc__)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("runs/demo"),
        help="where data, checkpoints and logs go (default: %(default)s)",
    )
    parser.add_argument(
        "--iters", type=int, default=None, help="training iterations (default 40; 60 with --drill)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes, data parallel (default 1; 2 with --drill)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="delete checkpoints and logs from an earlier demo first",
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
        for line in process.stdout:
            log.write(line)
            if " iteration " in line or "megatron-ext" in line or "error" in line.lower():
                print(line.rstrip(), flush=True)
        return process.wait()


def _rollback_requests(workdir: Path) -> int:
    ledger = workdir / "signals" / SPIKE_LEDGER_FILE
    if not ledger.exists():
        return 0
    return sum(e.get("kind") == "rollback" for e in read_jsonl(ledger).records)


def main(argv: list[str] | None = None) -> int:
    """Prepare data, train (drill: plan, apply and restart), print where everything went."""
    args = build_parser().parse_args(argv)
    workdir = args.workdir.resolve()
    if args.fresh or args.drill:
        for sub in ("checkpoints", "tensorboard", "samples", "signals", "train.log"):
            shutil.rmtree(workdir / sub, ignore_errors=True)
            (workdir / sub).unlink(missing_ok=True)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    iters = args.iters or (60 if args.drill else 40)
    nproc = args.nproc or (2 if args.drill else 1)
    extra = [
        *(DRILL_FLAGS if args.drill else []),
        "--signals-dir",
        str(workdir / "signals"),
        *extra,
    ]
    command = training_command(workdir, nproc, iters, extra)
    log_path = workdir / "train.log"
    status = _train(command, workdir, log_path)
    rollbacks = 0
    while args.drill and status != 0 and _rollback_requests(workdir) > rollbacks:
        rollbacks += 1
        if rollbacks > MAX_DRILL_ROLLBACKS:
            print(f"demo: more than {MAX_DRILL_ROLLBACKS} rollbacks; stopping")
            break
        print(f"\ndemo: spike exit -> megatron-ext skiplist --apply (rollback {rollbacks})")
        from megatron_ext.spikes.cli import main as skiplist

        if (
            skiplist(
                [
                    "--ckpt-dir",
                    str(workdir / "checkpoints"),
                    "--signals-dir",
                    str(workdir / "signals"),
                    "--apply",
                    *DRILL_PLAN,
                ]
            )
            != 0
        ):
            break
        status = _train(command, workdir, log_path)
    incidents = sorted(incident_stem(workdir / "checkpoints", 1).parent.glob("*.md"))
    print(
        f"\ntraining log:   {log_path}\ncheckpoints:    {workdir / 'checkpoints'}\n"
        f"tensorboard:    {workdir / 'tensorboard'}\nsample log:     {workdir / 'samples'}\n"
        f"signals:        {workdir / 'signals'}\n"
        + "".join(f"incident:       {p}\n" for p in incidents)
        + f"exit status:    {status}"
    )
    return status
