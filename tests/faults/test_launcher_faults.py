"""The launchers with hostile settings: paths with spaces, a missing training script, a wrong
repository root. Real scripts, a real supervisor, a fake training interpreter that records
the argv it was given (tests/support/launcher_fakes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.faults import fault
from tests.support.launcher_fakes import FAKE_PYTHON, SBATCH, SINGLE, Harness, write_exe


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


@fault(
    "DATA_ARGS with a quoted path containing a space; PYTHON a path containing a space",
    "the training gets the path as one argument, and the interpreter runs from its path",
    area="launchers",
)
def test_paths_with_spaces_survive_the_launcher(h: Harness) -> None:
    spaced = h.tmp / "my python env"
    spaced.mkdir()
    python = write_exe(spaced / "python3", FAKE_PYTHON)
    result = h.run(
        SINGLE,
        "--seed",
        "5",
        LAUNCHER="python",
        PYTHON=str(python),
        FAKE_CODES="0",
        DATA_ARGS="--data-path '/data/my corpus/web_text_document' --split 99,1,0",
    )
    assert result.returncode == 0, result.stderr
    argv = h.argv(1)
    assert argv[argv.index("--data-path") + 1] == "/data/my corpus/web_text_document"
    assert argv[argv.index("--split") + 1] == "99,1,0" and argv[-2:] == ["--seed", "5"]


@fault(
    "TRAIN_SCRIPT naming a file that does not exist",
    "exit 2 before any launch, naming TRAIN_SCRIPT and MEGATRON_EXT_ROOT",
    area="launchers",
)
def test_a_missing_train_script_is_refused(h: Harness) -> None:
    h.fake_launcher("0")
    result = h.run(SINGLE, TRAIN_SCRIPT=str(h.tmp / "nowhere" / "pretrain.py"))
    assert result.returncode == 2, result.stderr
    assert "TRAIN_SCRIPT" in result.stderr and "does not exist" in result.stderr
    assert h.launches == 0


@pytest.mark.parametrize("script", [SINGLE, SBATCH], ids=["single-node", "sbatch"])
@fault(
    "MEGATRON_EXT_ROOT pointing at a directory that is not a megatron-ext checkout",
    "exit 2 with a message naming MEGATRON_EXT_ROOT (no raw bash error)",
    area="launchers",
)
def test_a_wrong_repository_root_is_refused(h: Harness, script: Path) -> None:
    h.slurm().fake_launcher("0")
    result = h.run(script, MEGATRON_EXT_ROOT=str(h.tmp / "not-a-checkout"))
    assert result.returncode == 2, result.stderr
    assert (
        "MEGATRON_EXT_ROOT" in result.stderr and "is not a megatron-ext checkout" in result.stderr
    )
    assert "No such file" not in result.stderr and "line " not in result.stderr
    assert h.launches == 0
