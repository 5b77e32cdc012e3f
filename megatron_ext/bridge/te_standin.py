"""A Transformer Engine import stand-in shown to exactly one Bridge module, which imports it
unguarded: a meta-path finder answers only while that module imports, with classes that refuse
to be built. Registry entry ``bridge-te-import``; docs/bridge.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import traceback
import types
from typing import Any

from megatron_ext.common.errors import StartupError

# The one module shown the stand-in, and the Transformer Engine modules it imports.
IMPORTER = "megatron.bridge.peft.lora_layers"
STANDS_IN_FOR = "transformer_engine"


class TransformerEngineAbsent(StartupError):
    """Code outside the stand-in's purpose used it: a Transformer Engine layer was built."""


def _absent_class(name: str) -> type:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TransformerEngineAbsent(
            f"transformer_engine.{name} is not installed: megatron-ext gave "
            f"{IMPORTER} an import stand-in so that Megatron-Bridge imports without "
            "Transformer Engine; LoRA and TE layers need the real package."
        )

    return type(name.rsplit(".", 1)[-1], (), {"__new__": refuse, "__module__": STANDS_IN_FOR})


class _StandIn(types.ModuleType):
    """A module whose unknown attributes are refusing classes (``te.Linear``) or, for the
    lower-case names Bridge reaches through (``te.ops``), stand-in submodules."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        value: Any = _StandIn(full) if attr[:1].islower() else _absent_class(full)
        setattr(self, attr, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``transformer_engine[.x]`` for :data:`IMPORTER` only."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] != STANDS_IN_FOR or not any(
            frame.f_globals.get("__name__") == IMPORTER
            for frame, _ in traceback.walk_stack(sys._getframe(1))
        ):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []  # a package: submodule imports come back here
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


FINDER = _Finder()


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` unless Transformer Engine is installed; import
    ``lora_layers`` through it now and drop the stand-ins from ``sys.modules``. Idempotent.
    True when the stand-in was used."""
    if IMPORTER in sys.modules or importlib.util.find_spec(STANDS_IN_FOR) is not None:
        return False
    sys.meta_path.insert(0, FINDER)
    try:
        importlib.import_module(IMPORTER)
    finally:
        sys.meta_path.remove(FINDER)
        for name in [n for n in sys.modules if n.split(".")[0] == STANDS_IN_FOR]:
            if isinstance(sys.modules[name], _StandIn):
                del sys.modules[name]
    return True
