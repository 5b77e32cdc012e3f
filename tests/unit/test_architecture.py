"""The shape of the package: cores import no Megatron, the supervisor imports neither torch
nor Megatron, modules stay small, and README's feature table points at real folders."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import megatron_ext

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_ext"
# The only modules allowed to import Megatron at load time: the feature adapters and the
# GPT step that the entry point hands to Megatron's loop.
MEGATRON_FACING = {"gpt_step"}
MAX_LINES = 400


def _modules() -> list[str]:
    found = pkgutil.walk_packages(megatron_ext.__path__, "megatron_ext.")
    return sorted(m.name for m in found if not m.name.endswith("__main__"))


def _import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    """Import ``modules`` in a fresh interpreter where importing ``blocked`` fails."""
    code = (
        "import importlib, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError(f'{name} is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {blocked!r})\n"
        "assert not loaded, loaded\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)


def test_every_core_imports_with_megatron_blocked() -> None:
    cores = [
        m
        for m in _modules()
        if m.rsplit(".", 1)[-1] != "adapter" and m.rsplit(".", 1)[-1] not in MEGATRON_FACING
    ]
    assert "megatron_ext.zloss.core" in cores and "megatron_ext.spikes.detector" in cores
    result = _import_with_blocked(cores, ["megatron"])
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_supervisor_imports_neither_torch_nor_megatron() -> None:
    supervise = [m for m in _modules() if m.startswith("megatron_ext.supervise")]
    result = _import_with_blocked(supervise, ["megatron", "torch", "numpy"])
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_feature_folder_has_a_core_and_an_adapter() -> None:
    for folder in ("zloss", "weight_decay", "telemetry", "spikes", "sample_log"):
        files = {p.name for p in (PACKAGE / folder).glob("*.py")}
        assert "adapter.py" in files, folder
        assert len(files - {"adapter.py", "__init__.py"}) >= 1, f"{folder} has no core"


def test_no_module_is_longer_than_the_limit() -> None:
    sources = [*PACKAGE.rglob("*.py"), REPO / "pretrain_gpt_ext.py", *REPO.glob("tools/*.py")]
    long = {
        str(p.relative_to(REPO)): n
        for p in sources
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_readme_feature_table_points_to_one_folder_per_feature() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Features", 1)[1].split("\n\n", 2)[1]
    folders = re.findall(r"`(megatron_ext/[a-z_]+)/`", table)
    assert len(folders) >= 6, table
    for folder in folders:
        assert (REPO / folder).is_dir(), folder
