"""The newcomer path, literally: every command README shows, in README's order, in a fresh
copy of the checkout, each exiting 0 with the output README promises.

"Fresh": the tracked and untracked-but-not-ignored files of this checkout copied to a temp dir
(no ``runs/``, no caches), with ``.venv`` a link to the virtualenv running this test (in CI:
the one ``tools/setup.sh`` just built), ``PYTHONPATH`` at the copy and the venv first on
``PATH``, as after ``source .venv/bin/activate``.

Commands are read from README itself: indented code blocks, and inline code that starts like a
command (``.venv/bin/``, ``python ``, ``bash ``, ``launch/``). Each one must be run below or
skipped with a stated reason, so a command added to README without a check fails here.

- ``bash tools/setup.sh``: CI's first step ran exactly this on the same machine seconds ago; a
  second run would re-resolve pip against the network and rewrite the venv under the running
  test. The test runs set-up's own final check (its last line) against the linked venv instead.
- the demo runs twice (README: "Run again ..."), then its printed next steps (plot, lookup).
- the sbatch header's ``--dry-run`` command (README points at it) runs after README's list, on a
  machine where ``scontrol`` may exist without a Slurm configuration.
- no C toolchain: stand-ins for ``cc``, ``gcc``, ``make`` and the like come first on ``PATH``
  (and ``CC``/``CXX``), and the test fails if any was called (#46: no command needs a compiler).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_ext.common.checkpoint_state import Opaque, read_common_state
from megatron_ext.data.corpus import write_tiny_corpus
from megatron_ext.loop import install as loop
from tests.support import toolchain

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
PROMPTS = (".venv/bin/", "python ", "bash ", "launch/")
SKIPPED = {
    ".venv/bin/python -m pytest": "this test runs inside it",
    "torchrun --nproc-per-node 8 pretrain_gpt_ext.py <": "8 GPUs and placeholder arguments",
    "bash tools/gpu_smoke.sh [--wheels": "needs a GPU machine; its CPU rehearsal is "
    "tests/e2e/test_gpu_smoke_rehearsal.py",
    "bash tools/compat_venv.sh 0.18.2": ".ci/run runs it for each compatibility tier, right "
    "after this suite, and runs the tier's tests in it",
}
WARNINGS = ("UserWarning", "No CUDA runtime", "Traceback")
ARGUMENT_DUMP = re.compile(r"^\s*\S+ \.{2,} ", re.M)

pytestmark = pytest.mark.timeout(1800)


def readme_commands() -> list[str]:
    """README's commands in order: code blocks (continuations joined), command-like inline code."""
    found: list[tuple[int, str]] = []
    for block in re.finditer(r"(?:^ {4,}\S.*\n)+", README, flags=re.M):
        text = re.sub(r"\\\n\s*", "", block.group(0))
        for line in text.splitlines():
            if line.strip() and not line.strip().startswith("#"):
                found.append((block.start(), " ".join(line.split())))
    for span in re.finditer(r"`([^`\n]+)`", README):
        if span.group(1).startswith(PROMPTS) and " " in span.group(1):
            found.append((span.start(), span.group(1)))
    return [command for _, command in sorted(found)]


def _copy_checkout(root: Path) -> Path:
    clone = root / "megatron-ext"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
    )
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (REPO / name).is_file():
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, clone / name)
    else:  # not a git checkout (a source tarball): everything but build outputs
        ignored = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info")
        shutil.copytree(REPO, clone, ignore=ignored)
    (clone / ".venv").symlink_to(sys.prefix)
    return clone


class Newcomer:
    """Runs shell commands in the fresh copy and keeps what each printed."""

    def __init__(self, clone: Path) -> None:
        self.clone = clone
        tools = clone / ".no-compiler"
        self.env = {
            **os.environ,
            "PATH": os.pathsep.join([str(clone / ".venv" / "bin"), str(tools), os.environ["PATH"]]),
            "PYTHONPATH": str(clone),
            **toolchain.stand_ins(tools, clone / ".compiler-called"),
        }

    def run(self, command: str, timeout: int = 900) -> str:
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=self.clone,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        print(f"{time.perf_counter() - start:6.1f} s wall {cpu:6.1f} s CPU  $ {command[:70]}")
        out = result.stdout + result.stderr
        assert result.returncode == 0, f"$ {command}\n(exit {result.returncode})\n{out[-5000:]}"
        return out


def _quiet(out: str, command: str) -> None:
    noise = [w for w in WARNINGS if w in out]
    assert not noise, f"$ {command} printed {noise}:\n{out[-3000:]}"


def _setup(n: Newcomer, command: str) -> None:
    check = (REPO / "tools" / "setup.sh").read_text().strip().splitlines()[-1]
    assert "megatron_ext" in check, check
    out = n.run(f"VENV=.venv; {check}")
    assert "megatron-ext ready:" in out


def _next_steps(out: str) -> list[str]:
    return [line.strip() for line in out.split("next steps:", 1)[1].splitlines() if "--" in line][
        :2
    ]


def _demo(n: Newcomer, command: str) -> None:
    first = n.run(command)
    _quiet(first, command)
    for promise in ("training a byte-level BPE tokenizer", "iteration       40/      40"):
        assert promise in first, promise
    assert not ARGUMENT_DUMP.search(first), "Megatron's argument dump passed the demo's filter"
    assert "exit status:    0" in first
    steps = _next_steps(first)
    assert all(step in README for step in steps), steps  # the demo and README say the same
    second = n.run(command)
    _quiet(second, command)
    assert "nothing left to train" in second and not re.search(r"^\+ ", second, re.M)
    assert _next_steps(second) == steps


def _plot(n: Newcomer, command: str) -> None:
    out = n.run(command)
    _quiet(out, command)
    png = n.clone / "runs" / "demo" / "signals" / "signals.png"
    assert f"wrote {png.relative_to(n.clone)}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _lookup(n: Newcomer, command: str) -> None:
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    out = n.run(command)
    _quiet(out, command)
    assert out.startswith("iteration 40: consumed_train_samples 312 -> 320"), out[:300]
    assert len(re.findall(r"^3[0-9]{2} +0 +[01] ", out, flags=re.M)) == 8, out  # 2 mb x mbs 4
    # The lookup read the checkpoint without Megatron: the same args Megatron reads.
    ckpt = n.clone / "runs" / "demo" / "checkpoints" / "iter_0000040"
    ours, theirs = read_common_state(ckpt), load_common_state_dict(str(ckpt))
    assert ours["iteration"] == theirs["iteration"] == 40
    for key, value in vars(theirs["args"]).items():
        mine = vars(ours["args"])[key]
        if not (isinstance(mine, Opaque) or (isinstance(mine, type) and issubclass(mine, Opaque))):
            assert (mine, type(mine)) == (value, type(value)), key


def _help(n: Newcomer, command: str) -> None:
    out = n.run(command)
    _quiet(out, command)
    group = out.split("\nmegatron-ext:\n", 1)
    assert len(group) == 2, "no megatron-ext group in --help"
    listed = re.split(r"^\S.*:$", group[1], maxsplit=1, flags=re.M)[0]  # up to the next group
    flags = loop.add_megatron_ext_args(argparse.ArgumentParser())._actions
    expected = [  # every flag but help and the hidden ones the entry point itself passes
        f
        for action in flags
        if action.help != argparse.SUPPRESS
        for f in action.option_strings
        if f not in ("-h", "--help")
    ]
    missing = [
        # An option's spellings share a line ("--hang-detect, --no-hang-detect").
        f
        for f in expected
        if not re.search(rf"^(\s+|\s+\S+, ){re.escape(f)}(?=[\s,]|$)", listed, re.M)
    ]
    assert "--z-loss-coeff" in expected and not missing, missing


def _single_node_help(n: Newcomer, command: str) -> None:
    out = n.run(command)
    assert "MAX_ROLLBACKS" in out and "exit" in out.lower()


def _preprocess(n: Newcomer, command: str) -> None:
    write_tiny_corpus(n.clone / "docs.jsonl")  # the newcomer's own data
    out = n.run(command)
    _quiet(out, command)
    assert "training a byte-level BPE tokenizer" in out and "tokenizer trained in" in out
    assert (n.clone / "data" / "corpus_text_document.idx").is_file()


def _train_cpu(n: Newcomer, command: str) -> None:
    out = n.run(command)
    assert "iteration       20/      20" in out, out[-3000:]
    assert (n.clone / "runs" / "mine" / "iter_0000020").is_dir()


def _sbatch_dry_run(n: Newcomer) -> None:
    """The command in the sbatch header ("Check the command first, on any machine")."""
    header = (REPO / "launch" / "pretrain_gpt_ext.sbatch").read_text().split("#SBATCH", 1)[0]
    lines = header.split("Check the command first", 1)[1].splitlines()[1:3]
    command = re.sub(r"\\\s*$", "", " ".join(line.lstrip("# ").rstrip() for line in lines))
    command = " ".join(command.replace("\\", "").split())
    assert command.endswith("bash launch/pretrain_gpt_ext.sbatch --dry-run"), command
    out = n.run(command)
    # The first host of the expanded list is the rendezvous endpoint (scontrol or Python).
    assert "--nnodes 5 " in out and "--rdzv-endpoint gpu001:" in out, out[-2000:]


STEPS: dict[str, Callable[[Newcomer, str], None]] = {
    "bash tools/setup.sh": _setup,
    ".venv/bin/megatron-ext demo": _demo,
    ".venv/bin/megatron-ext plot --signals-dir runs/demo/signals": _plot,
    ".venv/bin/megatron-ext lookup --from-checkpoint runs/demo/checkpoints --iteration 40 "
    "--dp-rank 0": _lookup,
    "python pretrain_gpt_ext.py --help": _help,
    "launch/run_single_node.sh --help": _single_node_help,
    "megatron-ext preprocess --input docs.jsonl": _preprocess,
    "megatron-ext train --cpu": _train_cpu,
}


def _step(command: str) -> Callable[[Newcomer, str], None] | None:
    for prefix, reason in SKIPPED.items():
        if command.startswith(prefix):
            print(f"skipped: {command[:60]} ({reason})")
            return None
    matches = [step for start, step in STEPS.items() if command.startswith(start)]
    assert len(matches) == 1, (
        f"README shows `{command}`, which the newcomer path does not cover: add a step or a "
        "SKIPPED reason in tests/e2e/test_newcomer.py"
    )
    return matches[0]


def test_every_readme_command_in_order_in_a_fresh_checkout(tmp_path: Path) -> None:
    n = Newcomer(_copy_checkout(tmp_path))
    commands = readme_commands()
    ran = []
    for command in commands:
        step = _step(command)
        if step is not None:
            step(n, command)
            ran.append(step)
    assert ran == list(dict.fromkeys(ran)) and set(ran) == set(STEPS.values()), "order/coverage"
    _sbatch_dry_run(n)
    called = n.clone / ".compiler-called"
    assert not called.exists(), f"README's commands called a C toolchain:\n{called.read_text()}"
