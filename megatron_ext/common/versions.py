"""The megatron-core versions megatron-ext supports, declared once.

``setup.py`` runs this file with ``runpy`` for :data:`REQUIREMENT` (nothing but the standard
library at import time); the entry point and ``megatron-ext patches`` refuse a version outside
the range (:func:`check`); registry variants name the :data:`VERIFIED` versions they hold on.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping

MIN_VERSION = "0.17.1"
MAX_VERSION = "0.19.2"
DEFAULT_VERSION = "0.19.2"  # the one the full test suite runs on
# Every registry entry was verified on these (0.19.0's targets are source-identical to 0.19.2's).
VERIFIED: tuple[str, ...] = ("0.17.1", "0.18.2", "0.19.0", "0.19.2")

# The verified versions by minor, as registry variants name them.
ALL = VERIFIED  # an entry whose one form was verified on every supported version
V17 = tuple(v for v in VERIFIED if v.startswith("0.17."))
V18 = tuple(v for v in VERIFIED if v.startswith("0.18."))
V19 = tuple(v for v in VERIFIED if v.startswith("0.19."))

# Set to 1 to try a megatron-core outside the range (warned; the registry's checks still apply).
OVERRIDE_ENV = "MEGATRON_EXT_ALLOW_UNVERIFIED_MEGATRON_CORE"

REQUIREMENT = f"megatron-core>={MIN_VERSION},<={MAX_VERSION}"


class UnsupportedVersion(Exception):
    """A megatron-core outside the range: an internal control-flow signal that the caller turns
    into its refusal (``patching.UnsupportedMegatronCore``); ``setup.py`` reads this module."""


def installed() -> str | None:
    """The installed megatron-core's distribution version (``package_info`` adds a hash), read
    from its metadata without importing it; None when it is not installed."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def parse(version: str) -> tuple[int, ...]:
    """``"0.19.2"`` (or ``"0.19.2rc1"``, ``"0.19.2+abc"``) -> ``(0, 19, 2)``; ValueError if it
    is not a version."""
    from packaging.version import Version  # here: setup.py runs this file before any install

    return Version(version).release[:3]


def nearest_verified(version: str) -> str:
    """The verified version whose variants apply to ``version``: the newest of its minor line not
    newer than it, else that line's oldest (0.18.1 -> 0.18.2); without one, the same over all
    verified versions (0.20.0 -> 0.19.2)."""
    try:
        key = parse(version)
    except ValueError:
        return DEFAULT_VERSION
    line = sorted((v for v in VERIFIED if parse(v)[:2] == key[:2]), key=parse)
    candidates = line or sorted(VERIFIED, key=parse)
    older = [v for v in candidates if parse(v) <= key]
    return older[-1] if older else candidates[0]


def check(found: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Raise :class:`UnsupportedVersion` for a megatron-core outside the range; return the
    warning to print for one that may run but is not an exact verified version (None for a
    verified one)."""
    if found in VERIFIED:
        return None
    supported = f"megatron-ext supports megatron-core {MIN_VERSION} to {MAX_VERSION}"
    try:
        in_range = parse(MIN_VERSION) <= parse(found) <= parse(MAX_VERSION)
    except ValueError:
        in_range = False
    if in_range:
        return (
            f"megatron-ext WARNING: megatron-core {found} is in the supported range but not one "
            f"of the verified versions ({', '.join(VERIFIED)}); the registry's checks for "
            f"{nearest_verified(found)} decide whether this run may start."
        )
    if environ.get(OVERRIDE_ENV, "") not in ("", "0"):
        return (
            f"megatron-ext WARNING: UNVERIFIED megatron-core {found} ({OVERRIDE_ENV} is set). "
            f"{supported}; nothing was verified on {found}. The registry's checks for "
            f"{nearest_verified(found)} decide whether this run may start, and results may be "
            "silently wrong where a check cannot see a change."
        )
    raise UnsupportedVersion(
        f"megatron-ext: megatron-core {found} is not supported: {supported} "
        f"(verified: {', '.join(VERIFIED)}). To train, install a supported one: `pip install "
        f"'megatron-core=={DEFAULT_VERSION}'` (or any of {', '.join(VERIFIED)}). To try {found} "
        f"anyway (unverified, at your own risk), set {OVERRIDE_ENV}=1."
    )
