"""``CUDA_DEVICE_MAX_CONNECTIONS`` as the launchers set it: 1 for tensor/context/sequence
parallelism, more than 1 for an FSDP (Megatron asserts each), a user's value kept, and the
one combination Megatron refuses (1 with an FSDP flag) refused before any attempt starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.common import cuda_connections
from tests.support.launcher_fakes import SBATCH, SINGLE, Harness, dry_run_words


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


@pytest.mark.parametrize("script", [SBATCH, SINGLE])
def test_the_launchers_set_what_the_layout_needs(h: Harness, script: Path) -> None:
    if script == SBATCH:
        h.slurm()
    cases = {
        ("--tensor-model-parallel-size", "2", "--sequence-parallel"): "1",
        ("--context-parallel-size", "2"): "1",
        ("--use-torch-fsdp2",): "8",
        ("--use-megatron-fsdp",): "8",
    }
    for flags, value in cases.items():
        words = dry_run_words(h.run(script, "--dry-run", *flags))
        assert f"CUDA_DEVICE_MAX_CONNECTIONS={value}" in words, flags
    # The flag may come from any knob; a user's own value (not 1) is kept.
    words = dry_run_words(
        h.run(script, "--dry-run", EXTRA_ARGS="--use-torch-fsdp2", CUDA_DEVICE_MAX_CONNECTIONS="4")
    )
    assert "CUDA_DEVICE_MAX_CONNECTIONS=4" in words


@pytest.mark.parametrize("flag", cuda_connections.FSDP_FLAGS)
def test_fsdp_with_one_connection_is_refused_before_any_attempt(h: Harness, flag: str) -> None:
    r = h.run(SINGLE, "--dry-run", flag, CUDA_DEVICE_MAX_CONNECTIONS="1")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert f"CUDA_DEVICE_MAX_CONNECTIONS=1 with {flag}: Megatron asserts" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_rule_reads_exact_flags() -> None:
    assert cuda_connections.default_for(["--use-torch-fsdp2-x"]) == "1"  # no abbreviations
    assert cuda_connections.problem(["--use-torch-fsdp2"], None) is None  # unset is CUDA's 8
    assert cuda_connections.problem(["--use-torch-fsdp2"], "2") is None
    assert cuda_connections.problem(["--tensor-model-parallel-size", "2"], "1") is None
