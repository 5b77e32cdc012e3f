"""The entry point's first contact: Megatron's ``--help`` works (the registered ``%`` fix), and
a CPU-only machine is refused with the command that trains on CPU. The full ``--help`` listing
of the megatron-ext group is checked on the newcomer path (tests/e2e/test_newcomer.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.lookup.config import megatron_parser
from megatron_ext.registry import table as registry

REPO = Path(__file__).resolve().parents[2]


def test_megatrons_help_formats_only_with_the_percent_fix() -> None:
    fix = registry.patch("help-percent-in-docstrings")
    fix.remove()
    try:
        with pytest.raises(ValueError, match="unsupported format character"):
            megatron_parser().format_help()
        fix.apply()
        text = " ".join(megatron_parser().format_help().split())
    finally:
        fix.remove()
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text and "(e.g. 1.10 = 10%)" in text
    # Help written as a template in field metadata keeps its meaning.
    parser = argparse.ArgumentParser()
    parser.add_argument("--x", default=3, help="x (default: %(default)s)")
    assert "(default: 3)" in parser.format_help()


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only without CUDA")
def test_without_cuda_the_entry_point_names_the_cpu_command() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt_ext.py"), "--num-layers", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 1
    assert "Megatron requires CUDA" in result.stderr
    assert "megatron-ext train --cpu" in result.stderr
    assert "Traceback" not in result.stderr
