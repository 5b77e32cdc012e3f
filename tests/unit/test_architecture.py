"""The shape of the package: cores import no Megatron, the supervisor imports neither torch
nor Megatron, README's feature table points at real folders, the
import graph is layered (no feature folder imports another, no cycle, no lower layer
importing a higher one), patched code reads no module globals, and every deliberate error
is a MegatronExtError with its code."""

from __future__ import annotations

import ast
import dis
import functools
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import megatron_ext

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_ext"
# The only modules allowed to import Megatron at load time, besides the feature adapters: the
# GPT step and model that the entry point hands to Megatron's loop, the entry point's wiring
# and the installer, and the registry's table (it imports the wrappers it names).
MEGATRON_FACING = {
    "megatron_ext.loop.gpt_step",
    "megatron_ext.loop.gpt_model",
    "megatron_ext.loop.entry",
    "megatron_ext.loop.install",
    "megatron_ext.registry.table",
}


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
        m for m in _modules() if m.rsplit(".", 1)[-1] != "adapter" and m not in MEGATRON_FACING
    ]
    assert "megatron_ext.zloss.core" in cores and "megatron_ext.spikes.detector" in cores
    result = _import_with_blocked(cores, ["megatron"])
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_supervisor_imports_neither_torch_nor_megatron() -> None:
    supervise = [m for m in _modules() if m.startswith("megatron_ext.supervise")]
    result = _import_with_blocked(supervise, ["megatron", "torch", "numpy"])
    assert result.returncode == 0, result.stderr[-3000:]


# Feature folders whose whole core is an on-disk format that another folder reads, and so
# lives in the record core (megatron_ext/common/records/) instead.
CORE_IN_RECORDS = {"sample_log": "sample_log.py"}


def test_every_feature_folder_has_a_core_and_an_adapter() -> None:
    for folder in ("zloss", "weight_decay", "telemetry", "spikes", "sample_log"):
        files = {p.name for p in (PACKAGE / folder).glob("*.py")}
        assert "adapter.py" in files, folder
        if folder in CORE_IN_RECORDS:
            assert (PACKAGE / "common" / "records" / CORE_IN_RECORDS[folder]).is_file(), folder
        else:
            assert len(files - {"adapter.py", "__init__.py"}) >= 1, f"{folder} has no core"


MAX_FUNCTION_LINES = 80  # with C901/PLR09xx in ruff.toml: the size limit is per function


def test_no_function_is_longer_than_the_limit() -> None:
    sources = [*PACKAGE.rglob("*.py"), REPO / "pretrain_gpt_ext.py", *REPO.glob("tools/*.py")]
    long = [
        f"{p.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for p in sources
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_readme_feature_table_points_to_one_folder_per_feature() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Features", 1)[1].split("\n\n", 2)[1]
    folders = re.findall(r"`(megatron_ext/[a-z_]+)/`", table)
    assert len(folders) >= 6, table
    for folder in folders:
        assert (REPO / folder).is_dir(), folder


# -- the import graph ------------------------------------------------------------------------
# Computed statically from every import statement (module level, function level and
# TYPE_CHECKING blocks alike; one parse per session, no module imported), so these tests are
# fast and name the offending edge. Names resolved at run time from strings (importlib) are
# not edges: the registry's wrapper names, cli.py's subcommand table.

# The layers, highest first, by folder of megatron_ext/ ("." holds the top-level modules, which
# are all commands; pretrain_gpt_ext.py and tools/ count as commands too). Every folder is in
# exactly one layer, docs/architecture.md's layer table lists the same folders (both checked
# below), and an import goes to its own layer or a lower one. In the layers marked ISOLATED, a
# folder may not import another folder of its layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("commands", (".", "cpu", "plot", "supervise")),
    ("integrations", ("fork", "bridge")),
    ("offline tools", ("lookup", "incidents")),
    ("loop and registry", ("loop", "registry")),
    (
        "feature folders",
        (
            "zloss",
            "weight_decay",
            "telemetry",
            "spikes",
            "sample_log",
            "data",
            "runlock",
            "fsdp",
            "hang",
            "recovery",
        ),
    ),
    ("lower layer", ("common",)),
)
ISOLATED = {"offline tools", "feature folders", "lower layer"}
FEATURE_FOLDERS = dict(LAYERS)["feature folders"]
LAYER_OF = {folder: layer for layer, folders in LAYERS for folder in folders}
RANK = {layer: rank for rank, (layer, _) in enumerate(LAYERS)}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of this repository it imports (megatron_ext/, the entry point and
    tools/*.py, whose scripts import each other by bare name from their own folder); parsed
    once per session, never modified by the checks."""
    paths = [*PACKAGE.rglob("*.py"), REPO / "pretrain_gpt_ext.py", *REPO.glob("tools/*.py")]
    known = {_module_name(p): p for p in paths}

    def resolve(name: str, importer: str) -> str | None:
        """The longest known module that ``name`` starts with (a function, class or constant
        imported by name belongs to its module)."""
        while name:
            for candidate in (name, f"tools.{name}" if importer.startswith("tools.") else ""):
                if candidate in known:
                    return candidate
            name = name.rpartition(".")[0]
        return None

    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {resolve(alias.name, module) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets |= {resolve(f"{base}.{alias.name}", module) for alias in node.names}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _folder(module: str) -> str:
    """The folder of megatron_ext/ a module belongs to ("." for a top-level module and for the
    commands outside the package: the entry point and tools/)."""
    parts = module.split(".")
    if parts[0] != "megatron_ext" or len(parts) == 1:
        return "."
    return parts[1] if (PACKAGE / parts[1]).is_dir() else "."


def _layer(module: str) -> str:
    return LAYER_OF[_folder(module)]


def _sideways_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports between two folders of one isolated layer (two features, two offline tools)."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if _layer(a) in ISOLATED and _layer(a) == _layer(b) and _folder(a) != _folder(b)
    )


def _upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} -> {b} ({_layer(a)} -> {_layer(b)})"
        for a, targets in graph.items()
        for b in targets
        if RANK[_layer(b)] < RANK[_layer(a)]
    )


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph.get(root, ()))))]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                path = [n for n, _ in stack]
                return [*path[path.index(child) :], child]
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_the_import_graph_sees_every_kind_of_import() -> None:
    graph = _import_graph()
    adapter = graph["megatron_ext.spikes.adapter"]
    assert "megatron_ext.common.records.signals" in adapter  # module
    assert "megatron_ext.incidents.cli" in graph["megatron_ext.demo"]  # inside a function
    assert "tools.gpu_context" in graph["tools.gpu_rungs"]  # TYPE_CHECKING, by bare name
    assert "megatron_ext.incidents.transaction" in graph["megatron_ext.incidents.cli"]  # from pkg
    # The checks below catch what they are for, on a graph made to break them.
    bad = {
        "megatron_ext.common.io": {"megatron_ext.loop.install"},
        "megatron_ext.loop.install": {"megatron_ext.spikes.adapter"},
        "megatron_ext.spikes.adapter": {"megatron_ext.telemetry.core", "megatron_ext.common.io"},
        "megatron_ext.lookup.cli": {"megatron_ext.incidents.report", "megatron_ext.loop.install"},
        "megatron_ext.zloss.core": {"megatron_ext.lookup.cli"},
    }
    assert _sideways_edges(bad) == [
        "megatron_ext.lookup.cli -> megatron_ext.incidents.report",
        "megatron_ext.spikes.adapter -> megatron_ext.telemetry.core",
    ]
    assert _upward_edges(bad) == [
        "megatron_ext.common.io -> megatron_ext.loop.install (lower layer -> loop and registry)",
        "megatron_ext.zloss.core -> megatron_ext.lookup.cli (feature folders -> offline tools)",
    ]
    assert _find_cycle(bad) == [
        "megatron_ext.common.io",
        "megatron_ext.loop.install",
        "megatron_ext.spikes.adapter",
        "megatron_ext.common.io",
    ]


def test_every_folder_is_in_one_layer() -> None:
    """A new folder must be placed: the tree and the layer table cannot drift apart."""
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    placed = [folder for _, layer_folders in LAYERS for folder in layer_folders]
    assert len(placed) == len(set(placed)), placed
    assert folders | {"."} == set(placed), set(placed) ^ (folders | {"."})


def test_docs_layer_table_is_the_tests_layer_table() -> None:
    """docs/architecture.md's table names, row by row, the folders this test layers (top-level
    modules as `name.py`, all commands)."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    table = doc.split("| layer | folders | imports |", 1)[1].split("\n\n", 1)[0]
    rows = {
        cells[0]: cells[1]
        for line in table.splitlines()[2:]
        if (cells := [c.strip() for c in line.strip("|").split("|")])
    }
    assert list(rows) == [layer for layer, _ in LAYERS], rows
    for layer, folders in LAYERS:
        named = set(re.findall(r"`([a-z_]+)/`", rows[layer]))
        assert named == {f for f in folders if f != "."}, (layer, named)
    top_level = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert set(re.findall(r"`([a-z_]+\.py)`", rows["commands"])) >= top_level, rows["commands"]


def test_no_feature_folder_or_offline_tool_imports_another() -> None:
    edges = _sideways_edges(_import_graph())
    assert not edges, (
        "a folder imports another folder of its layer (move what both need to the record core "
        f"or the lower layer): {edges}"
    )


def test_the_import_graph_has_no_cycle() -> None:
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_layer_imports_a_higher_one() -> None:
    edges = _upward_edges(_import_graph())
    assert not edges, f"an import goes up the layers ({[layer for layer, _ in LAYERS]}): {edges}"


# -- state on its feature; one exception base ---------------------------------------------

_IMMUTABLE = (int, float, str, bytes, bool, frozenset, tuple)


def _code_objects(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and every function, closure and comprehension nested in it."""
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return [code, *(inner for c in nested for inner in _code_objects(c))]


def _globals_read(fn: Any) -> dict[str, Any]:
    """Module globals ``fn`` (and the functions nested in it) read, with their values."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    names = {
        ins.argval
        for code in _code_objects(fn.__code__)
        for ins in dis.get_instructions(code)
        if ins.opname == "LOAD_GLOBAL"
    }
    return {n: fn.__globals__[n] for n in names if n in fn.__globals__}


def _mutable_globals(fn: Any) -> list[str]:
    """Globals ``fn`` reads that are state (not a module, class, function or constant)."""
    return [
        f"{fn.__module__}.{fn.__qualname__} reads {name} ({type(value).__name__})"
        for name, value in _globals_read(fn).items()
        if not (
            inspect.ismodule(value)
            or inspect.isclass(value)
            or callable(value)
            or (isinstance(value, _IMMUTABLE) and value is not None)
        )
    ]


def _patched_code() -> list[Any]:
    """Every function Megatron ends up calling into: the registry's wrappers, the entry
    point's hook callers, what a script of the user's own calls (megatron_ext.fork) and every
    hook each feature overrides."""
    from megatron_ext.common.features import HOOKS
    from megatron_ext.fork import overlay
    from megatron_ext.loop.install import all_features
    from megatron_ext.registry import hooks
    from megatron_ext.registry import table as registry

    functions: list[Any] = [p.wrap for p in registry.PATCHES]
    functions += [call.called_from for call in registry.ENTRY_POINT_HOOKS]
    functions += [hooks.pre_wrap_hook, gpt_step_forward()]
    functions += [overlay.Overlay.forward, overlay.Forward.read, overlay.observed_loss]
    for feature in all_features():
        functions += [getattr(type(feature), h.__name__) for h in HOOKS if feature.implements(h)]
    return functions


def gpt_step_forward() -> Any:
    from megatron_ext.loop import gpt_step

    return gpt_step.forward_step


def test_the_global_check_finds_a_singleton_and_a_global_statement() -> None:
    """The check below is not vacuous: it flags both shapes it forbids."""
    namespace: dict[str, Any] = {}
    exec(
        "class Set: pass\n"
        "ACTIVE = Set()\n"
        "_FEATURE = None\n"
        "def wrap(original):\n"
        "    def replacement(*a):\n"
        "        return ACTIVE, _FEATURE, original(*a)\n"
        "    return replacement\n",
        namespace,
    )
    found = _mutable_globals(namespace["wrap"])
    assert any("ACTIVE (Set)" in f for f in found) and any("_FEATURE" in f for f in found)


def test_no_wrapper_or_hook_reads_a_module_global() -> None:
    """Patched code reads the feature (or feature set) bound into it when the patch was
    applied, never a module-level singleton, and no hook asks Megatron for its args."""
    functions = _patched_code()
    assert len(functions) > 20, functions
    problems = [p for fn in functions for p in _mutable_globals(fn)]
    for fn in functions:
        code = inspect.unwrap(getattr(fn, "__func__", fn)).__code__
        if any("get_args" in c.co_names for c in _code_objects(code)):
            problems.append(f"{fn.__module__}.{fn.__qualname__} calls get_args()")
    modules = {inspect.getmodule(fn) for fn in functions}
    for module in modules:
        tree = ast.parse(inspect.getsource(module))
        if any(isinstance(node, ast.Global) for node in ast.walk(tree)):
            problems.append(f"{module.__name__} has a `global` statement")
    assert not problems, problems


def _exception_classes() -> list[type]:
    classes = []
    for name in _modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == name
            ):
                classes.append(value)
    return classes


def test_every_deliberate_error_is_a_megatron_ext_error_with_its_exit_code() -> None:
    """One base: each exception class of the package is a MegatronExtError whose exit code is
    one of megatron_ext.common.exit_codes, or says in its docstring that it is an internal
    control-flow signal."""
    from megatron_ext.common import exit_codes
    from megatron_ext.common.errors import MegatronExtError

    codes = {v for k, v in vars(exit_codes).items() if k.isupper() and isinstance(v, int)}
    classes = _exception_classes()
    assert len(classes) >= 15, classes
    problems = []
    for cls in classes:
        if not issubclass(cls, MegatronExtError):
            if "control-flow signal" not in (cls.__doc__ or ""):
                problems.append(f"{cls.__module__}.{cls.__name__} is not a MegatronExtError")
        elif cls.exit_code not in codes:
            problems.append(f"{cls.__name__}.exit_code {cls.exit_code} is not in exit_codes")
    assert not problems, problems


def test_every_megatron_ext_error_is_raised_with_a_message() -> None:
    """``raise SomeError()`` would print an empty line instead of what to do."""
    from megatron_ext.common.errors import MegatronExtError

    ours = {c.__name__ for c in _exception_classes() if issubclass(c, MegatronExtError)}
    bare = []
    for path in [*PACKAGE.rglob("*.py"), REPO / "pretrain_gpt_ext.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call | ast.Name):
                call = node.exc
                name = getattr(getattr(call, "func", call), "id", None) or getattr(
                    getattr(call, "func", call), "attr", None
                )
                if name in ours and (isinstance(call, ast.Name) or not call.args):
                    bare.append(f"{path.relative_to(REPO)}:{node.lineno} raises {name}")
    assert not bare, bare


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
    import tomllib

    from setuptools import find_packages

    from megatron_ext.train import CPU_RUNNER

    run = importlib.import_module(f"{CPU}.run")  # nothing runs outside ``__main__``
    shims = importlib.import_module(f"{CPU}.shims")
    assert Path(run.__file__).resolve() == CPU_RUNNER
    assert callable(shims.install)
    assert not getattr(sys.modules["torch"].cuda, "_megatron_ext_cpu_harness", False)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["megatron_ext", "megatron_ext.*"]
    assert CPU in find_packages(str(REPO), include=include)
