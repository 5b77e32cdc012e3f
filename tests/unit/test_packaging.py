"""Packaging: pyproject.toml builds with setuptools, and every third-party module the package
imports is a declared dependency (setup.py's list, with the megatron-core range from
versions.py) or an extra."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OURS = {"megatron_ext", "pretrain_gpt_ext"}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def _install_requires() -> list[ast.expr]:
    calls = [
        node
        for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    ]
    (requires,) = [k.value for k in calls[0].keywords if k.arg == "install_requires"]
    assert isinstance(requires, ast.List)
    return requires.elts


def _declared() -> set[str]:
    requires = _install_requires()
    literal = [ast.literal_eval(e) for e in requires if isinstance(e, ast.Constant)]
    assert ast.unparse(requires[0]) == "VERSIONS['REQUIREMENT']"  # megatron-core, from versions.py
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    return {"megatron-core", *map(_name, literal), *(_name(r) for e in extras.values() for r in e)}


def _imported() -> dict[str, str]:
    """Top-level third-party module -> one file importing it."""
    found: dict[str, str] = {}
    for path in [*REPO.joinpath("megatron_ext").rglob("*.py"), REPO / "pretrain_gpt_ext.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names} - OURS:
                if top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_pyproject_builds_with_setuptools_and_declares_the_entry_points() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    assert project["project"]["dynamic"] == ["dependencies"]  # setup.py's list
    assert project["project"]["scripts"] == {"megatron-ext": "megatron_ext.cli:main"}
    assert project["tool"]["setuptools"]["py-modules"] == ["pretrain_gpt_ext"]


def test_every_third_party_import_is_a_declared_dependency() -> None:
    distributions = importlib.metadata.packages_distributions()
    declared = _declared()
    undeclared = {
        module: (path, distributions.get(module))
        for module, path in _imported().items()
        if not {_name(d) for d in distributions.get(module, [module])} & declared
    }
    assert not undeclared, f"imported but not declared in setup.py or an extra: {undeclared}"
    assert {"pyyaml", "numpy", "torch", "megatron-core"} <= declared
