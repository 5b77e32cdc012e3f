"""``megatron-ext train --cpu``: train on your own data on CPU, through the CPU runner.

The CPU runner (:mod:`megatron_ext.cpu`: shims for the few CUDA calls, gloo) runs the real
``pretrain_gpt_ext.py``; this points ``torchrun`` at it with :data:`CPU_FLAGS`, then yours::

    megatron-ext train --cpu --nproc-per-node 2 -- --data-path data/corpus_text_document \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model data/corpus_tokenizer ...

On GPUs: ``torchrun pretrain_gpt_ext.py ...`` or the launchers in ``launch/``.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# By path, not imported: torchrun runs it; only the processes it starts load the shims.
CPU_RUNNER = Path(__file__).resolve().parent / "cpu" / "run.py"
ENTRY_POINT = REPO / "pretrain_gpt_ext.py"
GPU_HINT = (
    "on GPUs run `torchrun --nproc-per-node N pretrain_gpt_ext.py <flags>` or "
    "launch/run_single_node.sh"
)

# Megatron's fused CUDA kernels are unavailable on CPU; dropout is off because CPU dropout
# draws from the same generator the data loader seeds from, which breaks exact resume there.
CPU_FLAGS = shlex.split(
    "--distributed-backend gloo --use-cpu-initialization --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion "
    "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --hidden-dropout 0 "
    "--attention-dropout 0"
)


def cpu_runner(command: str) -> Path:
    """The package's CPU runner script, or a clear refusal when the installation lacks it."""
    if not CPU_RUNNER.is_file():
        raise SystemExit(
            f"megatron-ext {command}: CPU training runs through the package's CPU runner "
            f"({CPU_RUNNER}), which this installation ({REPO}) lacks: reinstall megatron-ext "
            f"(`pip install -e .` in the repository); {GPU_HINT}"
        )
    return CPU_RUNNER


def torchrun(script: Path, nproc: int, args: list[str]) -> list[str]:
    """A single-node ``torchrun`` of ``script`` with ``nproc`` processes."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*run, f"--nproc-per-node={nproc}", str(script), *args]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-ext train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="train on CPU through the CPU runner (required: on GPUs use the entry point)",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="processes (data/tensor parallel ranks, gloo) (default: %(default)s)",
    )
    parser.add_argument(
        "--script",
        type=Path,
        help="a pretrain script of your own on megatron_ext.fork (docs/fork.md) to run "
        "instead of pretrain_gpt_ext.py",
    )
    parser.add_argument(
        "flags",
        nargs=argparse.REMAINDER,
        help="after --: Megatron and megatron-ext flags, as for pretrain_gpt_ext.py",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CPU training; its exit status is torchrun's."""
    parser = build_parser()
    args = parser.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if not args.cpu:
        parser.error(f"only --cpu is wrapped here; {GPU_HINT}")
    if args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be >= 1")
    if not flags:
        parser.error("give the training flags after --: model size, data, batch, iterations")
    if args.script is not None and not args.script.is_file():
        parser.error(f"--script {args.script}: no such file")
    script = [] if args.script is None else ["--script", str(args.script.resolve())]
    command = torchrun(cpu_runner("train"), args.nproc_per_node, [*script, *CPU_FLAGS, *flags])
    print(f"megatron-ext train: on CPU (gloo): {shlex.join(command)}", file=sys.stderr, flush=True)
    return subprocess.call(command)
