"""A Megatron-Bridge checkpoint's common state, as the offline tools read Megatron's: its
``args`` are built from Megatron's parser defaults, ``run_config.yaml``, ``train_state.pt`` and
the overlay's layout file (Megatron, torch and yaml imported only when one is read).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import pickle
import sys
from pathlib import Path
from typing import Any

from megatron_ext.common.errors import Refusal
from megatron_ext.common.files import (
    BRIDGE_LAYOUT_FILE,
    BRIDGE_RUN_CONFIG_FILE,
    BRIDGE_TRACKER_FILE,
    BRIDGE_TRAIN_STATE_FILE,
    checkpoint_dir,
)

# Megatron arg <- (section, Bridge field) where the names differ.
RENAMED = {
    "seed": ("dataset", "random_seed"),
    "data_cache_path": ("dataset", "path_to_cache"),
    "create_attention_mask_in_dataloader": ("dataset", "create_attention_mask"),
    "tokenizer_type": ("tokenizer", "tokenizer_type"),
    "tokenizer_model": ("tokenizer", "tokenizer_model"),
    "vocab_size": ("tokenizer", "vocab_size"),
    "eval_interval": ("validation", "eval_interval"),
    "eval_iters": ("validation", "eval_iters"),
    "mock_data": ("dataset", "mock"),
}
# Sections whose fields keep Megatron's names.
SECTIONS = ("train", "dataset")
MODEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "seq_length")


class BridgeStateError(Refusal):
    """A Bridge checkpoint's files cannot be read as its run's configuration."""


def is_bridge_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / BRIDGE_RUN_CONFIG_FILE).is_file()


def parse_megatron_args(flags: list[str], extra_args_provider: Any = None) -> argparse.Namespace:
    """Megatron's ``parse_args`` on ``flags`` rather than this process's ``sys.argv``."""
    from megatron.training.arguments import parse_args

    argv = sys.argv
    sys.argv = [argv[0], *flags]
    try:
        return parse_args(extra_args_provider=extra_args_provider)
    finally:
        sys.argv = argv


@functools.cache
def megatron_defaults() -> argparse.Namespace:
    """Megatron's parser defaults, parsed once per process (callers change a deep copy)."""
    return parse_megatron_args([])


def data_path_words(data_path: Any, blend: Any) -> list[str] | None:
    """Megatron's ``--data-path`` words (``[weight] prefix ...``) for a Bridge dataset config's
    ``data_path`` and ``blend`` (``(prefixes, weights or None)``), live or from a checkpoint."""
    if isinstance(data_path, str):
        return data_path.split()
    if data_path:
        return [str(word) for word in data_path]
    if not blend:
        return None
    prefixes, weights = blend
    if weights is None:
        return list(prefixes)
    return [word for pair in zip(weights, prefixes) for word in (str(pair[0]), pair[1])]


def read_bridge_state(directory: str | Path) -> dict[str, Any]:
    """``{"args": Namespace, "iteration": step}`` for one Bridge ``iter_NNNNNNN``."""
    import torch
    import yaml

    directory = Path(directory)
    try:
        text = (directory / BRIDGE_RUN_CONFIG_FILE).read_text()
        config = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        state = torch.load(
            directory / BRIDGE_TRAIN_STATE_FILE, map_location="cpu", weights_only=True
        )
        layout = json.loads((directory / BRIDGE_LAYOUT_FILE).read_text())
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise BridgeStateError(
            f"{directory}: cannot read it as a Megatron-Bridge checkpoint ({exc}); the lookup "
            f"needs {BRIDGE_RUN_CONFIG_FILE}, {BRIDGE_TRAIN_STATE_FILE} and megatron-ext's "
            f"{BRIDGE_LAYOUT_FILE} (written when megatron_ext.bridge.pretrain saves)"
        ) from None
    try:
        args = _as_args(config, state, layout)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # damaged or foreign
        raise BridgeStateError(
            f"{directory}: its {BRIDGE_RUN_CONFIG_FILE}, {BRIDGE_TRAIN_STATE_FILE} or "
            f"{BRIDGE_LAYOUT_FILE} lacks what a Bridge run writes ({type(exc).__name__}: {exc}); "
            "restore the checkpoint or use an earlier one"
        ) from None
    return {"args": args, "iteration": args.iteration, "checkpoint_version": 3.0}


def _as_args(config: Any, state: Any, layout: Any) -> argparse.Namespace:
    """Megatron's saved args from a Bridge checkpoint's run config, train state and layout."""
    args = copy.deepcopy(megatron_defaults())
    for section in SECTIONS:
        for key, value in (config.get(section) or {}).items():
            if hasattr(args, key) and not key.startswith("_"):
                setattr(args, key, value)
    for name, (section, key) in RENAMED.items():
        setattr(args, name, (config.get(section) or {}).get(key))
    for name in MODEL_FIELDS:
        setattr(args, name, config["model"][name])
    args.context_parallel_size = config["model"].get("context_parallel_size") or 1
    dataset = config["dataset"]
    args.data_path = data_path_words(dataset.get("data_path"), dataset.get("blend"))
    args.data_parallel_size = layout["data_parallel_size"]
    args.world_size = layout["world_size"]
    args.iterations_to_skip = list(config["train"].get("iterations_to_skip") or [])
    counters = {key: int(value) for key, value in state.items() if key != "do_train"}
    args.iteration = counters["step"]
    args.consumed_train_samples = counters["consumed_train_samples"]
    args.skipped_train_samples = counters["skipped_train_samples"]
    args.save = (config.get("checkpoint") or {}).get("save")
    return args


def saved_overlay_args(load: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The ``iter_NNNNNNN`` Bridge resumes ``load`` from (its ``latest_train_state.pt``) and the
    overlay's flags its layout file saved; None where there is none (not a Bridge checkpoint,
    or one written before the flags were saved)."""
    import torch

    tracker = Path(load) / BRIDGE_TRACKER_FILE
    if not tracker.is_file():
        return None
    try:  # an unreadable tracker is Bridge's load to report, with its own message
        step = int(torch.load(tracker, map_location="cpu", weights_only=True)["step"])
        directory = checkpoint_dir(load, step)
        layout = json.loads((directory / BRIDGE_LAYOUT_FILE).read_text())
    except (OSError, ValueError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError):
        return None
    saved = layout.get("args")
    return (directory, saved) if isinstance(saved, dict) else None
