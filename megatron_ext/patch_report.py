"""``megatron-ext patches``: what the overlay changes in Megatron, and whether it still fits.

Lists every registered patch (name, kind, target, verified megatron-core version, reason) and
verifies each target against the installed megatron-core; exits 1 if any target changed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import textwrap

from megatron_ext import MEGATRON_CORE_VERSION, patches


def _load_registrations() -> None:
    """Import the fixes and every feature adapter: importing one registers its patches."""
    import megatron_ext.fixes  # noqa: F401
    from megatron_ext.arguments import FEATURES

    for name in FEATURES:
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-ext patches", description=__doc__)
    parser.parse_args(argv)
    _load_registrations()
    installed = importlib.metadata.version("megatron-core")
    print(f"megatron-core installed: {installed} (megatron-ext pins {MEGATRON_CORE_VERSION})\n")
    failed = 0
    for patch in patches.registry():
        try:
            patches.verify(patch)
            status = "ok"
        except patches.PatchTargetError as exc:
            status, failed = f"TARGET CHANGED: {exc}", failed + 1
        print(f"{patch.name}  [{patch.kind}, verified on {patch.verified_on}]  {status}")
        print(f"  target: {patch.target}{patch.signature}")
        print(textwrap.indent(textwrap.fill(patch.reason, 92), "  why:    ").replace(
            "\n  why:    ", "\n          "))
        print()
    return 1 if failed else 0
