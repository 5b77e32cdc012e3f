"""The mechanism behind the registry of every touch of Megatron internals.

Two kinds of entries, both declared in :mod:`megatron_ext.registry`:

- a :class:`Patch` replaces a Megatron attribute (``module:attr`` or ``module:Class.attr``)
  with a wrapper. It names why, the megatron-core version it was verified on and the
  target's exact signature; :func:`verify` fails loudly when the target moved or its
  signature changed, :func:`apply` is idempotent.
- an :class:`Assumption` is a private Megatron name the overlay reads without replacing it
  (a bucket's ``grad_data``, a module-level queue). Its check looks at the installed code
  (attribute names that the class's ``__init__`` assigns, a module attribute, a private
  function's signature), so a refactor upstream stops the run at start-up instead of
  silently mis-measuring.

:func:`check_version` warns when the installed megatron-core is not the one the entries were
verified on; the entries' own checks then decide whether the run may start.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_ext import MEGATRON_CORE_VERSION
from megatron_ext.errors import Refusal

_MARK = "__megatron_ext_patch__"

Kind = Literal["bugfix", "feature", "hook"]


class PatchTargetError(Refusal, RuntimeError):
    """A registered target is missing or changed shape: the overlay must not start (exit 1,
    as ``megatron-ext patches`` and the entry point end)."""


def resolve(target: str) -> tuple[Any, str]:
    """``"pkg.module:Class.attr"`` -> (the object holding the attribute, its name)."""
    module_name, _, qual = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, attr = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _signature_of(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "<no signature>"


def _original(value: Any) -> Any:
    return getattr(value, _MARK, (None, value, None))[1]


def _target_error(name: str, target: str, verified_on: str, what: str) -> PatchTargetError:
    return PatchTargetError(
        f"megatron-ext {name!r}: {target} {what} (verified on megatron-core {verified_on}, "
        f"installed {installed_version()}). Re-verify it against the installed megatron-core "
        "before running; `megatron-ext patches` lists every entry."
    )


def _existing(name: str, target: str, verified_on: str) -> tuple[str, Any]:
    """``target``'s attribute name and current value, or the start-up refusal saying it is
    gone."""
    try:
        owner, attr = resolve(target)
        return attr, getattr(owner, attr)
    except (ImportError, AttributeError) as exc:
        raise _target_error(name, target, verified_on, f"not found ({exc})") from exc


def _check_signature(name: str, target: str, verified_on: str, fn: Any, expected: str) -> None:
    found = _signature_of(fn)
    if found != expected:
        raise _target_error(
            name, target, verified_on, f"changed signature: expected {expected}, found {found}"
        )


@dataclass(frozen=True)
class Patch:
    """One runtime replacement of a Megatron attribute.

    ``wrap`` is the wrapper itself (an imported function, so a reader and an IDE go from the
    registry straight to it): called with the original, and with what the patch is applied
    with (``apply(bound)``: the feature, or the installed feature set, whose state the
    replacement reads; nothing for a bug fix), it returns the replacement. ``target`` stays a
    ``module:qualname`` string, resolved only when verified or applied, so that a target
    Megatron moved is reported as a readable start-up refusal instead of an ImportError while
    the registry is imported. ``also_bound_in`` lists modules that did ``from target_module
    import name`` and hold their own reference that must be rebound too. ``hook`` is the
    :class:`~megatron_ext.features.Feature` hook a ``kind="hook"`` patch dispatches to;
    ``feature`` the feature class a ``kind="feature"`` patch belongs to.
    """

    name: str
    target: str
    reason: str
    signature: str
    wrap: Callable[..., Callable[..., Any]]
    kind: Kind = "feature"
    verified_on: str = MEGATRON_CORE_VERSION
    also_bound_in: tuple[str, ...] = field(default=())
    hook: Callable[..., Any] | None = None
    feature: type | None = None

    def verify(self) -> None:
        """Raise :class:`PatchTargetError` unless the target exists with the signature."""
        attr, current = _existing(self.name, self.target, self.verified_on)
        _check_signature(
            self.name, self.target, self.verified_on, _original(current), self.signature
        )
        for module_name in self.also_bound_in:
            module = importlib.import_module(module_name)
            if _original(getattr(module, attr, None)) is not _original(current):
                raise _target_error(
                    self.name,
                    f"{module_name}.{attr}",
                    self.verified_on,
                    f"no longer refers to {self.target}",
                )

    def _marker(self) -> tuple[str | None, Any, Any]:
        owner, attr = resolve(self.target)
        return getattr(getattr(owner, attr), _MARK, (None, None, None))

    def is_applied(self) -> bool:
        return self._marker()[0] == self.name

    def apply(self, bound: Any = None) -> None:
        """Install, with ``bound`` handed to the wrapper; applying again with the same
        ``bound`` is a no-op, with another one (a new run in the same process) rebinds."""
        self.verify()
        name, installed_over, already = self._marker()
        if name == self.name and already is bound:
            return
        owner, attr = resolve(self.target)
        original = installed_over if name == self.name else getattr(owner, attr)
        replacement = self.wrap(original) if bound is None else self.wrap(original, bound)
        try:
            setattr(replacement, _MARK, (self.name, original, bound))
        except AttributeError as exc:  # e.g. a bound builtin
            raise PatchTargetError(
                f"patch {self.name!r}: replacement cannot carry its marker"
            ) from exc
        setattr(owner, attr, replacement)
        for module_name in self.also_bound_in:
            setattr(importlib.import_module(module_name), attr, replacement)

    def remove(self) -> None:
        """Restore the original (tests use this to prove a patch is what made a difference)."""
        if not self.is_applied():
            return
        owner, attr = resolve(self.target)
        original = _original(getattr(owner, attr))
        setattr(owner, attr, original)
        for module_name in self.also_bound_in:
            setattr(importlib.import_module(module_name), attr, original)


@dataclass(frozen=True)
class HookCall:
    """A feature hook the entry point's own functions call, with no patch of Megatron:
    Megatron calls ``called_from`` (handed to it by ``pretrain_gpt_ext.py``), which calls
    ``hook`` on every installed feature that overrides it."""

    hook: Callable[..., Any]
    called_from: Callable[..., Any]
    where: str  # on which ranks, when

    def describe(self) -> str:
        fn = self.called_from
        return f"{fn.__module__}.{fn.__qualname__} ({self.where})"


@dataclass(frozen=True)
class Assumption:
    """A private Megatron name the overlay relies on without replacing it.

    ``target`` is a class, module attribute or function (``module:qualname``). The check:

    - ``assigned``: attribute names the class's ``__init__`` must assign (``self.x = ...``,
      read from its bytecode, so nothing is constructed); for a function, the names it
      assigns on the objects it builds (``obj.x = ...`` or ``setattr(obj, 'x', ...)``);
    - ``signature``: for a function, its exact signature;
    - neither: the target must exist.
    """

    name: str
    target: str
    reason: str
    used_by: str  # the megatron-ext module that relies on it
    assigned: tuple[str, ...] = field(default=())
    signature: str | None = None
    verified_on: str = MEGATRON_CORE_VERSION

    def verify(self) -> None:
        _, value = _existing(self.name, self.target, self.verified_on)
        if self.assigned:
            function = inspect.isfunction(value)
            body = value if function else getattr(value, "__init__", None)
            code = getattr(body, "__code__", None)
            names = set(getattr(code, "co_names", ()))
            if function:  # setattr(obj, "name", ...) keeps the name as a constant
                names |= {c for c in getattr(code, "co_consts", ()) if isinstance(c, str)}
            missing = [a for a in self.assigned if a not in names]
            if missing:
                where = "its body" if function else "__init__"
                raise _target_error(
                    self.name,
                    self.target,
                    self.verified_on,
                    f"no longer assigns {missing} in {where}",
                )
        if self.signature is not None:
            _check_signature(self.name, self.target, self.verified_on, value, self.signature)


Entry = Patch | Assumption


def installed_version() -> str:
    """The installed megatron-core's distribution version (``package_info`` adds a hash)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_version(warn: Callable[[str], None] = print) -> bool:
    """Warn (once, through ``warn``) when megatron-core is not the verified version."""
    found = installed_version()
    if found == MEGATRON_CORE_VERSION:
        return True
    warn(
        f"megatron-ext WARNING: megatron-core {found} is installed, but every patch and "
        f"assumption was verified on {MEGATRON_CORE_VERSION}; their start-up checks decide "
        "whether this run may start. Run `megatron-ext patches` to see each one."
    )
    return False
