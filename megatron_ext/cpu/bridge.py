"""The CPU harness's additions for Megatron-Bridge's own ``pretrain`` (``run.py
--bridge-script``): what Bridge 0.6.2 needs on top of :mod:`megatron_ext.cpu.shims`.

Why separate: Bridge has its own ``initialize_megatron`` (``megatron.bridge.training.
initialize``, called from ``megatron.bridge.training.setup``) and reads one more CUDA counter
(``torch.cuda.memory_stats``, in its memory report); the megatron-core shims do not reach
either. Loaded only by the CPU runner, like the shims (a GPU run never imports it). The third
addition, the dataset-helpers build fix at ``megatron.bridge.training.initialize.
compile_helpers``, is not CPU-specific and is a registry bug fix for every Bridge user
(:mod:`megatron_ext.bridge.table`, ``bridge-prebuilt-dataset-helpers``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_ext.cpu import shims


def install() -> None:
    """Install the Bridge additions (after :func:`megatron_ext.cpu.shims.install`);
    idempotent. Imports Bridge (through the Transformer Engine stand-in)."""
    if getattr(torch.cuda, "_megatron_ext_cpu_bridge", False):
        return
    torch.cuda.memory_stats = shims._shim("memory_stats", lambda *a, **k: {})  # type: ignore[assignment]
    from megatron_ext.bridge import te_standin

    te_standin.install()
    from megatron.bridge.training import initialize, setup

    from megatron_ext.bridge import table

    for fix in table.BUGFIXES:  # Bridge alone (the runner's --plain scripts) needs it too
        fix.apply()

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        shims._count("bridge.initialize_megatron(allow_no_cuda)")
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    setup.initialize_megatron = initialize_megatron  # bound there by `from ... import`
    torch.cuda._megatron_ext_cpu_bridge = True  # type: ignore[attr-defined]
