"""The registry's mechanism: a :class:`Patch` replaces a Megatron attribute with a wrapper, an
:class:`Assumption` is a private name read without replacing it. Each names its target
(``module:qualname``), why, and the versions it was verified on, with a :class:`Variant` per
other megatron-core line. Verification fails loudly when a target changed; applying is
idempotent; :func:`check_version` refuses a megatron-core outside the supported range.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Self

from megatron_ext.common import versions
from megatron_ext.common.errors import Refusal, StartupError

_MARK = "__megatron_ext_patch__"

Kind = Literal["bugfix", "feature", "hook", "entry", "cpu"]


class PatchTargetError(Refusal, RuntimeError):
    """A registered target is missing or changed shape: the overlay must not start (exit 1)."""


def resolve(target: str) -> tuple[Any, str]:
    """``"pkg.module:Class.attr"`` -> (the object holding the attribute, its name)."""
    module_name, _, qual = target.partition(":")
    holder, _, attr = qual.rpartition(".")
    return pkgutil.resolve_name(f"{module_name}:{holder}"), attr  # "module:" is the module


def _original(value: Any) -> Any:
    return getattr(value, _MARK, (None, value, None))[1]


def _innermost(value: Any) -> Any:
    """What every registry patch stacked on ``value`` was installed over."""
    while hasattr(value, _MARK):
        value = _original(value)
    return value


@dataclass(frozen=True)
class Variant:
    """An entry's form on other versions: the fields that differ there (None: the entry's own)
    and ``note``, what changed upstream. ``available=False``: the feature cannot work there;
    nothing is verified, and applying the patch is a start-up refusal naming the version."""

    verified_on: tuple[str, ...]
    note: str
    available: bool = True
    target: str | None = None
    signature: str | None = None
    assigned: tuple[str, ...] | None = None
    names: tuple[str, ...] | None = None


_VARIANT_FIELDS = ("target", "signature", "assigned", "names")


class _Versioned:
    """What :class:`Patch` and :class:`Assumption` share: picking the variant for a version."""

    name: str
    target: str
    verified_on: tuple[str, ...]
    variants: tuple[Variant, ...]

    def covers(self) -> tuple[str, ...]:
        """Every version some form of this entry was verified on."""
        found = {*self.verified_on, *(v for variant in self.variants for v in variant.verified_on)}
        return tuple(sorted(found, key=versions.parse))

    def variant_for(self) -> Variant | None:
        """The installed version's variant; None when the entry's own fields apply. Raises
        :class:`PatchTargetError` when no form was verified there."""
        proxy = versions.nearest_verified(installed_version())
        if proxy in self.verified_on:
            return None
        for variant in self.variants:
            if proxy in variant.verified_on:
                return variant
        raise PatchTargetError(
            f"megatron-ext {self.name!r}: no variant verified on megatron-core {proxy} "
            f"(verified on {', '.join(self.covers())}); `megatron-ext patches` lists every entry."
        )

    def unavailable(self) -> Variant | None:
        """The installed version's variant when it says the entry cannot work there."""
        variant = self.variant_for() if self.variants else None
        return variant if variant is not None and not variant.available else None

    def _error(self, what: str, target: str | None = None) -> PatchTargetError:
        return PatchTargetError(
            f"megatron-ext {self.name!r}: {target or self.target} {what} (verified on "
            f"megatron-core {', '.join(self.verified_on)}, installed {installed_version()}). "
            "Re-verify it against the installed megatron-core before running; "
            "`megatron-ext patches` lists every entry."
        )

    def _existing(self) -> tuple[str, Any]:
        """The target's attribute name and current value, or the refusal saying it is gone."""
        try:
            owner, attr = resolve(self.target)
            return attr, getattr(owner, attr)
        except (ImportError, AttributeError) as exc:
            raise self._error(f"not found ({exc})") from exc

    def _check_signature(self, fn: Any, expected: str) -> None:
        try:
            found = str(inspect.signature(fn))
        except (TypeError, ValueError):
            found = "<no signature>"
        if found != expected:
            raise self._error(f"changed signature: expected {expected}, found {found}")

    def selected(self) -> Self:
        """This entry as it applies to the installed version: the variant's fields over the
        entry's, ``verified_on`` the variant's, no further variants."""
        variant = self.variant_for()
        if variant is None:
            return self if not self.variants else replace(self, variants=())  # type: ignore[type-var]
        fields = {
            key: getattr(variant, key)
            for key in _VARIANT_FIELDS
            if getattr(variant, key) is not None and hasattr(self, key)
        }
        return replace(self, verified_on=variant.verified_on, variants=(), **fields)  # type: ignore[type-var]


@dataclass(frozen=True)
class Patch(_Versioned):
    """One runtime replacement of a Megatron attribute: ``wrap(original)`` (or ``wrap(original,
    bound)``, ``bound`` given to :meth:`apply`) returns it. ``also_bound_in``: modules whose own
    ``from module import name`` is rebound too; ``hook`` / ``feature``: the Feature hook or
    class a ``kind="hook"`` / ``"feature"`` patch belongs to."""

    name: str
    target: str
    reason: str
    signature: str
    wrap: Callable[..., Callable[..., Any]]
    verified_on: tuple[str, ...]
    kind: Kind = "feature"
    also_bound_in: tuple[str, ...] = field(default=())
    hook: Callable[..., Any] | None = None
    feature: type | None = None
    variants: tuple[Variant, ...] = field(default=())

    def verify(self) -> None:
        """Raise :class:`PatchTargetError` unless the installed version's form of the target
        exists with its signature (nothing to check where the variant is unavailable)."""
        if self.variants:
            return None if self.unavailable() else self.selected().verify()
        attr, current = self._existing()
        self._check_signature(_innermost(current), self.signature)
        for module_name in self.also_bound_in:
            module = importlib.import_module(module_name)
            if _innermost(getattr(module, attr, None)) is not _innermost(current):
                raise self._error(f"no longer refers to {self.target}", f"{module_name}.{attr}")

    def _marker(self) -> tuple[str | None, Any, Any]:
        if self.variants:
            return (None, None, None) if self.unavailable() else self.selected()._marker()
        owner, attr = resolve(self.target)
        return getattr(getattr(owner, attr), _MARK, (None, None, None))

    def is_applied(self) -> bool:
        return self._marker()[0] == self.name

    def apply(self, bound: Any = None) -> None:
        """Install, with ``bound`` handed to the wrapper; applying again with the same
        ``bound`` is a no-op, with another one (a new run in the same process) rebinds."""
        if self.variants:
            if variant := self.unavailable():
                raise StartupError(
                    f"{self.name} is not available on megatron-core {installed_version()}: "
                    f"{variant.note} Install a version it was verified on "
                    f"({', '.join(self.verified_on)}) or drop its flag."
                )
            return self.selected().apply(bound)
        self.verify()
        name, installed_over, already = self._marker()
        if name == self.name and already is bound:
            return
        owner, attr = resolve(self.target)
        original = installed_over if name == self.name else getattr(owner, attr)
        replacement = self.wrap(original) if bound is None else self.wrap(original, bound)
        setattr(replacement, _MARK, (self.name, original, bound))  # every wrap returns a function
        setattr(owner, attr, replacement)
        for module_name in self.also_bound_in:
            setattr(importlib.import_module(module_name), attr, replacement)

    def remove(self) -> None:
        """Restore the original (tests use this to prove a patch is what made a difference)."""
        if not self.is_applied():
            return
        if self.variants:
            return self.selected().remove()
        owner, attr = resolve(self.target)
        original = _original(getattr(owner, attr))
        setattr(owner, attr, original)
        for module_name in self.also_bound_in:
            setattr(importlib.import_module(module_name), attr, original)


@dataclass(frozen=True)
class HookCall:
    """A feature hook the training script's side calls (no patch): Megatron calls
    ``called_from``, which calls ``hook`` on every installed feature overriding it."""

    hook: Callable[..., Any]
    called_from: Callable[..., Any]
    where: str  # on which ranks, when

    def describe(self) -> str:
        fn = self.called_from
        return f"{fn.__module__}.{fn.__qualname__} ({self.where})"


@dataclass(frozen=True)
class Assumption(_Versioned):
    """A private Megatron name relied on without replacing it. ``target`` is a class, module
    attribute or function (``module:qualname``), or a module (no colon) with ``names``. Checked:
    ``assigned`` (names the class's ``__init__``, or the function, assigns, read from bytecode),
    ``signature`` (a function's exact one), ``names`` (a module's); else that it exists."""

    name: str
    target: str
    reason: str
    used_by: str  # the megatron-ext module that relies on it
    verified_on: tuple[str, ...]
    assigned: tuple[str, ...] = field(default=())
    signature: str | None = None
    names: tuple[str, ...] = field(default=())
    variants: tuple[Variant, ...] = field(default=())

    def verify(self) -> None:
        if self.variants:
            # Unavailable: the feature relying on it refuses to start on this version.
            return None if self.unavailable() else self.selected().verify()
        if ":" not in self.target:
            return self._verify_names()
        _, value = self._existing()
        if self.assigned:
            self._verify_assigned(value)
        if self.signature is not None:
            self._check_signature(value, self.signature)
        return None

    def _verify_assigned(self, value: Any) -> None:
        function = inspect.isfunction(value)
        # A decorated method (torch.no_grad) is read through to the function it wraps.
        body = inspect.unwrap(value) if function else getattr(value, "__init__", None)
        code = getattr(body, "__code__", None)
        names = set(getattr(code, "co_names", ()))
        if function:  # setattr(obj, "name", ...) keeps the name as a constant
            names |= {c for c in getattr(code, "co_consts", ()) if isinstance(c, str)}
        if missing := [a for a in self.assigned if a not in names]:
            where = "its body" if function else "__init__"
            raise self._error(f"no longer assigns {missing} in {where}")

    def _verify_names(self) -> None:
        try:
            module = importlib.import_module(self.target)
        except ImportError as exc:
            raise self._error(f"not found ({exc})") from exc
        missing = [
            n
            for n in self.names
            if not hasattr(module, n) and importlib.util.find_spec(f"{self.target}.{n}") is None
        ]
        if missing:
            raise self._error(f"no longer has {', '.join(missing)}")


Entry = Patch | Assumption


@functools.cache
def installed_version() -> str:
    """The installed megatron-core's version, as the registry's messages name it."""
    return versions.installed() or "not installed"


class UnsupportedMegatronCore(StartupError):
    """The installed megatron-core is outside the supported range (exit 1, no traceback)."""

    prefix = ""


def check_version(warn: Callable[[str], None] = print, found: str | None = None) -> bool:
    """Refuse a megatron-core outside the supported range (an override lets it run, warned);
    warn for one that is not an exact verified version. True when it is a verified one."""
    found = installed_version() if found is None else found
    try:
        warning = versions.check(found)
    except versions.UnsupportedVersion as exc:
        raise UnsupportedMegatronCore(str(exc)) from None
    if warning:
        warn(warning)
    return warning is None
