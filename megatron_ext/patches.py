"""``megatron-ext patches``: every entry of the registry (:mod:`megatron_ext.registry.table`),
the features using each loop hook, and whether each entry still fits the installed
megatron-core (exit 1 if any target changed)."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable

from megatron_ext.common import versions
from megatron_ext.common.features import HOOKS, Feature
from megatron_ext.registry.copies import Copy, CopyChanged
from megatron_ext.registry.patching import (
    Assumption,
    Entry,
    Patch,
    PatchTargetError,
    installed_version,
)


def _form(entry: Entry) -> tuple[Entry, str]:
    """The entry's form for the installed megatron-core and the line saying which it is."""
    try:
        variant = entry.variant_for()
    except PatchTargetError as exc:
        return entry, f"variant: NONE ({exc})"
    if variant is None:
        label = "this entry's own" if entry.variants else "one form for all"
        return entry.selected(), f"variant: {label} [verified on {', '.join(entry.verified_on)}]"
    note = textwrap.fill(variant.note, 86, subsequent_indent="      ")
    return entry.selected(), (
        f"variant: [verified on {', '.join(variant.verified_on)}] {note}".rstrip()
    )


def _why(text: str) -> str:
    return textwrap.indent(textwrap.fill(text, 90), "    why:  ").replace(
        "\n    why:  ", "\n          "
    )


def _section(
    title: str, entries: tuple[Entry, ...], detail: Callable[[Entry], str], out: list[str]
) -> int:
    out.append(f"== {title}")
    failed = 0
    for entry in entries:
        try:
            entry.verify()
            status = "ok"
        except PatchTargetError as exc:
            status = f"TARGET CHANGED: {exc}"
            failed += 1
        form, which = _form(entry)
        out.append(f"  {entry.name}  [verified on {', '.join(entry.covers())}]  {status}")
        out.append(f"    {which}")
        out.append(f"    {detail(form)}")
        out.append(_why(entry.reason))
    out.append("")
    return failed


def _patch_target(entry: Entry) -> str:
    assert isinstance(entry, Patch)
    if entry.unavailable():
        return "target: none on this version (not available; see the variant)"
    wrapper = f"{entry.wrap.__module__}.{entry.wrap.__qualname__}"
    return f"target: {entry.target}{entry.signature}\n    wrapper: {wrapper}"


def _assumed(entry: Entry) -> str:
    assert isinstance(entry, Assumption)
    what = (
        f" assigns {', '.join(entry.assigned)}"
        if entry.assigned
        else f" has {', '.join(entry.names)}"
        if entry.names
        else f"{entry.signature}"
        if entry.signature
        else " exists"
    )
    return f"relies on: {entry.target}{what}\n    used by: {entry.used_by}"


def _copies(entries: tuple[Copy, ...], out: list[str]) -> int:
    """The copies section: a changed "tools" copy makes its tool refuse, not training (so it
    does not fail this command); a changed "training" copy does."""
    out.append("== copies of Megatron logic (checked by the tool that holds them, no import)")
    failed = 0
    for entry in entries:
        try:
            entry.verify()
            status = "ok"
        except CopyChanged as exc:
            blocks = entry.scope == "training"
            failed += blocks
            status = f"COPY CHANGED ({'training refuses' if blocks else 'its tool refuses'}): {exc}"
        source = entry.source_for()
        out.append(f"  {entry.name}  [verified on {', '.join(entry.covers())}]  {status}")
        note = f" {source.note}" if source.note else ""
        out.append(f"    variant: [verified on {', '.join(source.verified_on)}]{note}")
        out.append(f"    copies: {', '.join(source.targets or entry.targets)}")
        out.append(f"    used by: {', '.join(entry.used_by)} (scope {entry.scope})")
        out.append(_why(entry.reason))
    out.append("")
    return failed


def hook_users(features: list[Feature]) -> dict[str, list[str]]:
    """Hook name -> the features overriding it."""
    return {hook.__name__: [f.name for f in features if f.implements(hook)] for hook in HOOKS}


def _hook_name(entry: Entry) -> str:
    assert isinstance(entry, Patch) and entry.hook is not None
    return entry.hook.__name__


def _bridge(out: list[str]) -> int:
    """Megatron-Bridge's own table (:mod:`megatron_ext.bridge.table`) where Bridge is installed."""
    from megatron_ext.bridge import table as bridge
    from megatron_ext.bridge import te_standin

    found = bridge.installed_bridge()
    if found is None:
        out.append("== Megatron-Bridge: not installed (its entries: megatron_ext/bridge/table.py)")
        return 0
    try:
        bridge.check_version(found)
    except bridge.UnsupportedBridge as exc:
        out.append(f"== Megatron-Bridge {found}: {exc}")
        return 1
    te_standin.install()  # as the integration does (entry bridge-te-import)
    title = f"Megatron-Bridge {found} (megatron_ext.bridge.table)"
    failed = _section(f"{title}: bug fixes", bridge.BUGFIXES, _patch_target, out)
    failed += _section(f"{title}: hooks", bridge.PATCHES, _patch_target, out)
    failed += _section(f"{title}: feature patches", bridge.FEATURE_PATCHES, _patch_target, out)
    failed += _section(f"{title}: CPU runner", bridge.CPU_RUNNER, _patch_target, out)
    assumed = (*bridge.ASSUMPTIONS, *bridge.IMPORTS)
    return failed + _section(f"{title}: assumptions and imports", assumed, _assumed, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-ext patches", description=__doc__)
    parser.parse_args(argv)
    found = installed_version()
    supported = f"{versions.MIN_VERSION} to {versions.MAX_VERSION}"
    out = [
        f"megatron-core installed: {found} (megatron-ext supports {supported}, verified on "
        f"{', '.join(versions.VERIFIED)}; variants below are {versions.nearest_verified(found)}'s)",
        "",
    ]
    try:
        warning = versions.check(found)
    except versions.UnsupportedVersion as exc:  # before importing anything of Megatron's
        print("\n".join([*out, str(exc)]))
        return 1
    if warning:
        out[1:1] = [warning, ""]
    # After the version check: the registry imports the adapters (Megatron).
    from megatron_ext.loop.install import all_features
    from megatron_ext.registry import table as registry

    users = hook_users(all_features())
    failed = _section("upstream bug fixes (always applied)", registry.BUGFIXES, _patch_target, out)
    failed += _section(
        "loop hooks (applied when an installed feature uses the hook)",
        registry.HOOKS,
        lambda e: (
            f"hook {_hook_name(e)}, used by: {', '.join(users[_hook_name(e)]) or 'none'}\n    "
            + _patch_target(e)
        ),
        out,
    )
    out.append(
        "== entry-point hooks (megatron_ext.registry.hooks, called by the GPT step and "
        "megatron_ext.fork; no patch of Megatron)"
    )
    for call in registry.ENTRY_POINT_HOOKS:
        name = call.hook.__name__
        out.append(f"  {name}: called from {call.describe()}; used by: {', '.join(users[name])}")
    out.append("")
    failed += _section(
        "feature patches (applied when the feature's flag is set)",
        registry.FEATURE_PATCHES,
        _patch_target,
        out,
    )
    failed += _section(
        "assumptions (private names read, not replaced)", registry.ASSUMPTIONS, _assumed, out
    )
    failed += _section(
        "entry point (the runner of pretrain_gpt_ext.py and megatron_ext.fork, batch helpers, "
        "per version)",
        (*registry.ENTRY_POINT, registry.CLASSIC_INIT),
        lambda e: _patch_target(e) if isinstance(e, Patch) else _assumed(e),
        out,
    )
    failed += _section("megatron names the training side imports", registry.IMPORTS, _assumed, out)
    failed += _section(
        "CPU runner (applied by megatron_ext.cpu only)", registry.CPU_RUNNER, _patch_target, out
    )
    failed += _copies(registry.COPIES, out)
    failed += _bridge(out)
    print("\n".join(out).rstrip())
    return 1 if failed else 0
