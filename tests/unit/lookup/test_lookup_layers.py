"""The lookup's modules form layers (megatron_ext/lookup/__init__.py lists them): each imports
only modules of the layers below it, so a batch walk (session -> config -> data -> schedule)
goes down and never back up. Checked statically, from every import statement; the walk
itself, call by call: test_lookup_datasets.py::test_a_batch_walk_calls_only_down."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_ext.lookup

PACKAGE = "megatron_ext.lookup"
LOOKUP = Path(megatron_ext.lookup.__file__).parent
# Highest first; a module may import only modules of later layers (not its own layer's).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("crosscheck",),  # --sample-log, --worst
    ("session",),  # one invocation; a batch walked down to records
    ("history",),  # layout history and attempts
    ("mock",),  # --mock-data: megatron-core's MockGPTDataset built again
    ("config",),  # checkpoint args / flags -> RunConfig; tokenizer; rebuild
    ("data",),  # caches, .bin/.idx, a sample -> documents and back
    ("schedule",),  # iteration <-> sampler stream positions
    ("errors",),
)
RANK = {module: rank for rank, layer in enumerate(LAYERS) for module in layer}


def _imports(source: str) -> set[str]:
    """The lookup modules ``source`` imports: module level or in a function, absolute or
    relative, ``from megatron_ext.lookup import name`` included."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = PACKAGE.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            names += [f"{base}.{alias.name}" for alias in node.names]
    inside = [n[len(PACKAGE) + 1 :] for n in names if n.startswith(PACKAGE + ".")]
    return {n.split(".")[0] for n in inside}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module of the same or a higher layer (or of one placed nowhere)."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if target != module and RANK.get(target, -1) <= RANK[module]
    )


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p.read_text()) for p in LOOKUP.glob("*.py") if p.stem != "__init__"}


def test_every_lookup_module_is_placed_in_one_layer() -> None:
    placed = [module for layer in LAYERS for module in layer]
    assert len(placed) == len(set(placed)), placed
    assert set(_graph()) == set(placed), set(_graph()) ^ set(placed)


def test_no_lookup_module_imports_its_own_layer_or_a_higher_one() -> None:
    edges = _upward(_graph())
    assert not edges, f"lookup imports that go up (layers: {LAYERS}): {edges}"


def test_the_layer_check_sees_upward_imports_of_every_kind() -> None:
    bad = {
        "schedule": "from megatron_ext.lookup.data import TrainIndex\n",
        "data": "def find():\n    from . import session\n",
        "errors": "import megatron_ext.lookup.errors\nfrom .errors import DataChanged\n",
        "config": "from megatron_ext.lookup import history\n",
    }
    graph = {module: _imports(source) for module, source in bad.items()}
    assert graph["errors"] == {"errors"}
    assert _upward(graph) == ["config -> history", "data -> session", "schedule -> data"]
