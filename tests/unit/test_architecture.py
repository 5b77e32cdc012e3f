"""The shape of the package: cores import no Megatron, the supervisor imports neither torch
nor Megatron, modules stay small, and README's feature table points at real folders."""

from __future__ import annotations

import ast
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
    for folder in ("zloss", "weight_decay", "telemetry", "spikes", "sample_log", "lookup"):
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


# -- the CPU runner (megatron_ext/cpu/) ------------------------------------------------------

CPU = "megatron_ext.cpu"


def _names_cpu(node: ast.AST) -> bool:
    """Whether an AST node imports, or names for a lazy import, the CPU runner package."""
    if isinstance(node, ast.Import):
        return any(a.name == CPU or a.name.startswith(CPU + ".") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        return (
            module == CPU
            or module.startswith(CPU + ".")
            or (module == "megatron_ext" and any(a.name == "cpu" for a in node.names))
        )
    spec = node.value if isinstance(node, ast.Constant) else None  # import_module, registry
    return isinstance(spec, str) and (spec == CPU or spec.startswith((CPU + ".", CPU + ":")))


def test_nothing_but_the_cpu_runner_imports_megatron_ext_cpu() -> None:
    """A GPU run never loads the shims: no module outside megatron_ext/cpu/ imports it (lazy
    imports and import_module strings included); the CLI only names the runner's file."""
    sources = [p for p in PACKAGE.rglob("*.py") if (PACKAGE / "cpu") not in p.parents] + [
        REPO / "pretrain_gpt_ext.py",
        *REPO.glob("tools/*.py"),
    ]
    offenders = [
        f"{p.relative_to(REPO)}:{node.lineno}"
        for p in sources
        for node in ast.walk(ast.parse(p.read_text()))
        if _names_cpu(node)
    ]
    assert not offenders, offenders
    # ... and at run time: the entry point, the loop and every feature load without it.
    gpu_run = ["pretrain_gpt_ext", *(m for m in _modules() if not m.startswith(CPU))]
    code = (
        "import importlib, sys, torch\n"
        f"for name in {gpu_run!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = [m for m in sys.modules if m.startswith({CPU!r})]\n"
        "assert not loaded, loaded\n"
        "assert not getattr(torch.cuda, '_megatron_ext_cpu_harness', False)\n"
        "assert torch.cuda.current_device.__module__ == 'torch.cuda'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_cpu_runner_is_importable_from_the_package() -> None:
    """The demo and ``train --cpu`` launch a file that ships with the package."""
    import importlib

    from setuptools import find_packages

    from megatron_ext.train import CPU_RUNNER

    run = importlib.import_module(f"{CPU}.run")  # nothing runs outside ``__main__``
    shims = importlib.import_module(f"{CPU}.shims")
    assert Path(run.__file__).resolve() == CPU_RUNNER
    assert callable(shims.install)
    assert not getattr(sys.modules["torch"].cuda, "_megatron_ext_cpu_harness", False)
    assert 'include=["megatron_ext", "megatron_ext.*"]' in (REPO / "setup.py").read_text()
    assert CPU in find_packages(str(REPO), include=["megatron_ext", "megatron_ext.*"])
