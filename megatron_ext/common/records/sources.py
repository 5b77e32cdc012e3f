"""Blend members as the per-source records name them (signals, the ledger's culprit, the drill's
corrupted source): one rule, applied to the blend ``get_blend_and_blend_per_split`` reads.
"""

from __future__ import annotations

import os
from typing import Any


def train_blend(blend: Any, blend_per_split: Any) -> list[str]:
    """The train split's prefixes: the per-split train blend (``--train-data-path``,
    ``--per-split-data-args-path``) when there is one, else the ``--data-path`` blend; none
    with mock data."""
    if blend_per_split is not None and blend_per_split[0] is not None:
        blend = blend_per_split[0]
    return list(blend[0]) if blend is not None else []


def member_names(prefixes: list[str]) -> list[str]:
    """Each blend member's name: its ``--data-path`` prefix, shortened to the basename where
    no other member has the same basename (two ``.../en/web`` and ``.../de/web`` keep their
    full prefixes; the same prefix twice in a blend is named ``#2``, ``#3`` after the first)."""
    bases = [os.path.basename(p.rstrip("/")) or p for p in prefixes]
    owners: dict[str, set[str]] = {}
    for base, prefix in zip(bases, prefixes):
        owners.setdefault(base, set()).add(prefix)
    names = [b if len(owners[b]) == 1 else p for b, p in zip(bases, prefixes)]
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            names[i] = f"{name}#{seen[name]}"
    return names


def train_members(args: Any) -> list[str]:
    """The names of this launch's train blend members, as Megatron reads ``args`` (a resume
    under another blend, a new stage, names its own)."""
    from megatron.training.utils import get_blend_and_blend_per_split  # late: a core

    return member_names(train_blend(*get_blend_and_blend_per_split(args)))
