"""The mechanism behind the registry of every touch of Megatron internals.

Two kinds of entries, both declared in :mod:`megatron_ext.registry.table`:

- a :class:`Patch` replaces a Megatron attribute (``module:attr`` or ``module:Class.attr``)
  with a wrapper. It names why, the megatron-core version it was verified on and the
  target's exact signature; :func:`verify` fails loudly when the target moved or its
  signature changed, :func:`apply` is idempotent.
- an :class:`Assumption` is a private Megatron name the overlay reads without replacing it
  (a bucket's ``grad_data``, a module-level queue). Its check looks at the installed code
  (attribute names that the class's ``__init__`` assigns, a module attribute, a private
  function's signature), so a refactor upstream stops the run at start-up instead of
  silently mis-measuring.

Per-version variants: an entry's own fields (target, signature, wrapper, assigned names) are
the ones verified on the versions in its ``verified_on``; ``variants`` holds a
:class:`Variant` for each other line of megatron-core, with the exact versions it was
verified on and only the fields that differ there. :meth:`Patch.selected` /
:meth:`Assumption.selected` is the entry as it applies to the installed megatron-core (its
:func:`~megatron_ext.common.versions.nearest_verified` version); verify, apply and
``megatron-ext patches`` go through it. Every entry covers every version in
:data:`~megatron_ext.common.versions.VERIFIED` (tests/unit/test_registry.py checks).

:func:`check_version` refuses a megatron-core outside the supported range
(:mod:`megatron_ext.common.versions`) and warns for one that is not an exact verified version.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Self

from megatron_ext.common import versions
from megatron_ext.common.errors import Refusal, StartupError

_MARK = "__megatron_ext_patch__"

Kind = Literal["bugfix", "feature", "hook", "entry"]


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


def _target_error(
    name: str, target: str, verified_on: tuple[str, ...], what: str
) -> PatchTargetError:
    return PatchTargetError(
        f"megatron-ext {name!r}: {target} {what} (verified on megatron-core "
        f"{', '.join(verified_on)}, "
        f"installed {installed_version()}). Re-verify it against the installed megatron-core "
        "before running; `megatron-ext patches` lists every entry."
    )


def _existing(name: str, target: str, verified_on: tuple[str, ...]) -> tuple[str, Any]:
    """``target``'s attribute name and current value, or the start-up refusal saying it is
    gone."""
    try:
        owner, attr = resolve(target)
        return attr, getattr(owner, attr)
    except (ImportError, AttributeError) as exc:
        raise _target_error(name, target, verified_on, f"not found ({exc})") from exc


def _check_signature(
    name: str, target: str, verified_on: tuple[str, ...], fn: Any, expected: str
) -> None:
    found = _signature_of(fn)
    if found != expected:
        raise _target_error(
            name, target, verified_on, f"changed signature: expected {expected}, found {found}"
        )


@dataclass(frozen=True)
class Variant:
    """An entry as it is on other megatron-core versions: the exact versions it was verified
    on, the fields that differ there (None: the entry's own) and ``note``, what changed
    upstream and how the overlay meets it. ``available=False``: the feature cannot work on
    those versions (the note says why); nothing is verified there, and applying the patch
    is a start-up refusal naming the version."""

    verified_on: tuple[str, ...]
    note: str
    available: bool = True
    target: str | None = None
    signature: str | None = None
    wrap: Callable[..., Any] | None = None
    assigned: tuple[str, ...] | None = None
    names: tuple[str, ...] | None = None
    also_bound_in: tuple[str, ...] | None = None


_VARIANT_FIELDS = ("target", "signature", "wrap", "assigned", "names", "also_bound_in")


class _Versioned:
    """What :class:`Patch` and :class:`Assumption` share: picking the variant for a version."""

    name: str
    verified_on: tuple[str, ...]
    variants: tuple[Variant, ...]

    def covers(self) -> tuple[str, ...]:
        """Every version some form of this entry was verified on."""
        found = {*self.verified_on, *(v for variant in self.variants for v in variant.verified_on)}
        return tuple(sorted(found, key=versions.parse))

    def variant_for(self, version: str | None = None) -> Variant | None:
        """The variant for ``version`` (installed when None); None when the entry's own
        fields apply. Raises :class:`PatchTargetError` when no form was verified there."""
        proxy = versions.nearest_verified(installed_version() if version is None else version)
        if proxy in self.verified_on:
            return None
        for variant in self.variants:
            if proxy in variant.verified_on:
                return variant
        raise PatchTargetError(
            f"megatron-ext {self.name!r}: no variant verified on megatron-core {proxy} "
            f"(verified on {', '.join(self.covers())}); `megatron-ext patches` lists every entry."
        )

    def selected(self, version: str | None = None) -> Self:
        """This entry as it applies to ``version`` (installed when None): the variant's
        fields over the entry's, ``verified_on`` the variant's, no further variants."""
        variant = self.variant_for(version)
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
    """One runtime replacement of a Megatron attribute.

    ``wrap`` is the wrapper itself (an imported function, so a reader and an IDE go from the
    registry straight to it): called with the original, and with what the patch is applied
    with (``apply(bound)``: the feature, or the installed feature set, whose state the
    replacement reads; nothing for a bug fix), it returns the replacement. ``target`` stays a
    ``module:qualname`` string, resolved only when verified or applied, so that a target
    Megatron moved is reported as a readable start-up refusal instead of an ImportError while
    the registry is imported. ``also_bound_in`` lists modules that did ``from target_module
    import name`` and hold their own reference that must be rebound too. ``hook`` is the
    :class:`~megatron_ext.common.features.Feature` hook a ``kind="hook"`` patch dispatches to;
    ``feature`` the feature class a ``kind="feature"`` patch belongs to. ``verified_on`` are
    the versions these fields were verified on, ``variants`` the other versions' forms.
    """

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
        exists with its signature (nothing, where the variant says it is not available)."""
        if self.variants:
            variant = self.variant_for()
            if variant is not None and not variant.available:
                return None
            return self.selected().verify()
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
        if self.variants:
            variant = self.variant_for()
            if variant is not None and not variant.available:
                return (None, None, None)
            return self.selected()._marker()
        owner, attr = resolve(self.target)
        return getattr(getattr(owner, attr), _MARK, (None, None, None))

    def is_applied(self) -> bool:
        return self._marker()[0] == self.name

    def apply(self, bound: Any = None) -> None:
        """Install, with ``bound`` handed to the wrapper; applying again with the same
        ``bound`` is a no-op, with another one (a new run in the same process) rebinds."""
        if self.variants:
            variant = self.variant_for()
            if variant is not None and not variant.available:
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
        if self.variants:
            return None if not self.is_applied() else self.selected().remove()
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
class Assumption(_Versioned):
    """A private Megatron name the overlay relies on without replacing it.

    ``target`` is a class, module attribute or function (``module:qualname``), or a module
    (``module``, no colon) with ``names``. The check:

    - ``assigned``: attribute names the class's ``__init__`` must assign (``self.x = ...``,
      read from its bytecode, so nothing is constructed); for a function, the names it
      assigns on the objects it builds (``obj.x = ...`` or ``setattr(obj, 'x', ...)``);
    - ``signature``: for a function, its exact signature;
    - ``names``: for a module, the names the overlay imports from it (public API too: a name
      that moved between versions is a start-up refusal naming it, not an ImportError);
    - none of these: the target must exist.

    ``wrap`` optionally names the overlay's function that calls the target in this form (a
    variant gives each version's), for the code that picks it by version.
    """

    name: str
    target: str
    reason: str
    used_by: str  # the megatron-ext module that relies on it
    verified_on: tuple[str, ...]
    assigned: tuple[str, ...] = field(default=())
    signature: str | None = None
    names: tuple[str, ...] = field(default=())
    wrap: Callable[..., Any] | None = None
    variants: tuple[Variant, ...] = field(default=())

    def verify(self) -> None:
        if self.variants:
            variant = self.variant_for()
            if variant is not None and not variant.available:
                return None  # the feature relying on it refuses to start on this version
            return self.selected().verify()
        if ":" not in self.target:
            self._verify_names()
            return
        _, value = _existing(self.name, self.target, self.verified_on)
        if self.assigned:
            function = inspect.isfunction(value)
            # A decorated method (torch.no_grad) is read through to the function it wraps.
            body = inspect.unwrap(value) if function else getattr(value, "__init__", None)
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

    def _verify_names(self) -> None:
        try:
            module = importlib.import_module(self.target)
        except ImportError as exc:
            raise _target_error(
                self.name, self.target, self.verified_on, f"not found ({exc})"
            ) from exc
        missing = [
            n
            for n in self.names
            if not hasattr(module, n) and importlib.util.find_spec(f"{self.target}.{n}") is None
        ]
        if missing:
            raise _target_error(
                self.name, self.target, self.verified_on, f"no longer has {', '.join(missing)}"
            )


Entry = Patch | Assumption


@functools.cache
def installed_version() -> str:
    """The installed megatron-core's version, as the registry's messages name it."""
    return versions.installed() or "not installed"


class UnsupportedMegatronCore(StartupError):
    """The installed megatron-core is outside the supported range (exit 1, no traceback)."""

    prefix = ""


def check_version(warn: Callable[[str], None] = print, found: str | None = None) -> bool:
    """Refuse a megatron-core outside the supported range (:mod:`megatron_ext.common.versions`;
    an override lets it run, warned); warn, through ``warn``, for one that is not an exact
    verified version. True when the installed version is a verified one."""
    found = installed_version() if found is None else found
    try:
        warning = versions.check(found)
    except versions.UnsupportedVersion as exc:
        raise UnsupportedMegatronCore(str(exc)) from None
    if warning:
        warn(warning)
    return warning is None
