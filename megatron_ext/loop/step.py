"""A training script's part of a run: what the entry point's runners hand Megatron's
``pretrain`` besides the arguments; the overlay's GPT step and a script of the user's own
(:mod:`megatron_ext.fork`) differ only here. No Megatron import: a script builds its step
before the start-up checks the megatron-core version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.common.features import FeatureSet

# (features, the installed version's TP batch broadcast) -> (forward step, dataset provider)
Bind = Callable[[FeatureSet, Callable[..., dict[str, Any]]], tuple[Callable[..., Any], Any]]


@dataclass(frozen=True)
class Step:
    """The script's functions and options. ``bind`` gives the forward step and dataset provider
    Megatron calls; ``check`` refuses, before distributed init, what the script cannot train;
    ``model_provider(features, ...)`` is called per model chunk and calls ``on_model_built``
    (None: the overlay's GPT model); ``extra_args_provider`` adds the script's own flags."""

    bind: Bind
    check: Callable[[Any], None]
    model_type: Any
    model_provider: Callable[..., Any] | None = None
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None
    extra_args_provider: Callable[[Any], Any] | None = None
    args_defaults: dict[str, Any] = field(default_factory=dict)
