"""The one place where megatron-ext changes Megatron behaviour at runtime.

Each :class:`Patch` names its target symbol (``module:attr`` or ``module:Class.attr``), why
it exists, the megatron-core version it was verified on and the target's expected signature.
:func:`verify` runs at start-up and fails loudly if a target moved or its signature changed
(the patch may no longer be correct); :func:`apply` is idempotent. Feature modules register
their patches here; nothing else in the package assigns to a Megatron attribute.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from megatron_ext import MEGATRON_CORE_VERSION

_MARK = "__megatron_ext_patch__"


class PatchTargetError(RuntimeError):
    """A registered target is missing or changed shape: the overlay must not start."""


@dataclass(frozen=True)
class Patch:
    """One runtime change to Megatron.

    ``wrap`` receives the original attribute and returns its replacement. ``also_bound_in``
    lists modules that did ``from target_module import name`` and therefore hold their own
    reference that must be rebound too.
    """

    name: str
    target: str
    reason: str
    signature: str
    wrap: Callable[[Any], Any]
    kind: Literal["bugfix", "feature"] = "feature"
    verified_on: str = MEGATRON_CORE_VERSION
    also_bound_in: tuple[str, ...] = field(default=())

    def owner_and_attr(self) -> tuple[Any, str]:
        """Resolve the object that holds the attribute (module or class) and its name."""
        module_name, _, qual = self.target.partition(":")
        owner: Any = importlib.import_module(module_name)
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, attr


_REGISTRY: dict[str, Patch] = {}


def register(patch: Patch) -> Patch:
    """Add a patch to the registry (re-registering the same name is an error)."""
    if patch.name in _REGISTRY and _REGISTRY[patch.name] is not patch:
        raise ValueError(f"patch {patch.name!r} registered twice")
    _REGISTRY[patch.name] = patch
    return patch


def registry() -> list[Patch]:
    """All registered patches, in registration order."""
    return list(_REGISTRY.values())


def _original(value: Any) -> Any:
    return getattr(value, _MARK, (None, value))[1]


def _signature_of(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "<no signature>"


def verify(patch: Patch) -> None:
    """Raise :class:`PatchTargetError` unless the target exists with the expected signature."""
    try:
        owner, attr = patch.owner_and_attr()
        current = getattr(owner, attr)
    except (ImportError, AttributeError) as exc:
        raise PatchTargetError(
            f"megatron-ext patch {patch.name!r}: target {patch.target} not found ({exc}). "
            f"It was verified on megatron-core {patch.verified_on}; re-verify the patch "
            "against the installed megatron-core before running."
        ) from exc
    found = _signature_of(_original(current))
    if found != patch.signature:
        raise PatchTargetError(
            f"megatron-ext patch {patch.name!r}: {patch.target} changed signature: "
            f"expected {patch.signature}, found {found} (verified on megatron-core "
            f"{patch.verified_on}). Re-verify the patch before running."
        )
    for module_name in patch.also_bound_in:
        module = importlib.import_module(module_name)
        if _original(getattr(module, attr, None)) is not _original(current):
            raise PatchTargetError(
                f"megatron-ext patch {patch.name!r}: {module_name}.{attr} no longer refers "
                f"to {patch.target}; re-verify the patch."
            )


def verify_all() -> None:
    """Verify every registered patch (called at start-up, before any is applied)."""
    for patch in registry():
        verify(patch)


def is_applied(patch: Patch) -> bool:
    """Whether ``patch`` is currently installed in this process."""
    owner, attr = patch.owner_and_attr()
    return getattr(getattr(owner, attr), _MARK, (None, None))[0] == patch.name


def apply(name: str) -> Patch:
    """Install the named patch once; a second call is a no-op."""
    patch = _REGISTRY[name]
    verify(patch)
    if is_applied(patch):
        return patch
    owner, attr = patch.owner_and_attr()
    original = getattr(owner, attr)
    replacement = patch.wrap(original)
    try:
        setattr(replacement, _MARK, (patch.name, original))
    except AttributeError as exc:  # e.g. a bound builtin
        raise PatchTargetError(f"patch {name!r}: replacement cannot carry its marker") from exc
    setattr(owner, attr, replacement)
    for module_name in patch.also_bound_in:
        setattr(importlib.import_module(module_name), attr, replacement)
    return patch


def applied() -> list[Patch]:
    """Patches installed in this process."""
    return [p for p in registry() if is_applied(p)]
