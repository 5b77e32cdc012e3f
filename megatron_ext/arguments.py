"""Every megatron-ext command-line flag, in one argument group added to Megatron's parser.

Each feature module owns its flags (``add_args(group)``) and its start-up hook
(``install(args)``); this module only lists the features. Flags follow Megatron's conventions
(``--kebab-case``). With none of them set, a run is plain Megatron, apart from the upstream bug
fixes listed by ``megatron-ext patches``.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType
from typing import Any

# Feature modules, in installation order. Each defines add_args(group) and install(args).
FEATURES: tuple[str, ...] = (
    "megatron_ext.sample_log_adapter",
    "megatron_ext.signals_adapter",
    "megatron_ext.spike_adapter",
    "megatron_ext.zloss_adapter",
    "megatron_ext.weight_decay_adapter",
)


def _features() -> list[ModuleType]:
    return [importlib.import_module(name) for name in FEATURES]


def add_megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for ``parse_and_validate_args``."""
    group = parser.add_argument_group(title="megatron-ext")
    for feature in _features():
        feature.add_args(group)
    return parser


def install_features(args: Any) -> None:
    """Validate each feature's flags and install the patches the enabled ones need."""
    for feature in _features():
        feature.install(args)
