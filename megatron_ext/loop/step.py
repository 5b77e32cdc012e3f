"""A training script's part of a run: what the entry point's runners hand Megatron's
``pretrain`` besides the arguments (:mod:`megatron_ext.loop.entry`).

Why a value of its own: the overlay's ``pretrain_gpt_ext.py`` (its GPT step,
:func:`megatron_ext.loop.entry.overlay_step`) and a script of the user's own
(:mod:`megatron_ext.fork`) start through the same runners, which call each megatron-core's
``pretrain`` its own way (registry ``entry-point``); only this part differs. No Megatron
import here: a script builds its step before the start-up checks the megatron-core version.
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
    """The script's functions and options, bound to the features once they are installed.

    ``bind`` gives the forward step and dataset provider Megatron calls (the dataset provider
    calling ``on_train_dataset``); ``check`` refuses, with the parsed args and before
    distributed init, what the script cannot train; ``model_provider`` is called as
    ``model_provider(features, pre_process=..., ...)`` for every model chunk and calls
    ``on_model_built`` itself; None: the overlay's GPT model (megatron-core 0.19: Megatron's
    builder from the args, whose ``pre_wrap_hooks`` call ``on_model_built``).
    ``extra_args_provider`` adds the script's own flags (the overlay adds its group after).
    """

    bind: Bind
    check: Callable[[Any], None]
    model_type: Any
    model_provider: Callable[..., Any] | None = None
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None
    extra_args_provider: Callable[[Any], Any] | None = None
    args_defaults: dict[str, Any] = field(default_factory=dict)
