"""The CPU runner's additions for Megatron-Bridge's own ``pretrain`` (``run.py
--bridge-script``), on top of :mod:`megatron_ext.cpu.shims`: Bridge's ``initialize_megatron``
with ``allow_no_cuda`` (registry entry ``bridge-cpu-initialize-without-cuda``) and
``torch.cuda.memory_stats`` (its memory report).
"""

from __future__ import annotations

import torch

from megatron_ext.cpu import shims


def install() -> None:
    """Install the Bridge additions (after :func:`megatron_ext.cpu.shims.install`), once."""
    torch.cuda.memory_stats = shims._shim("memory_stats", lambda *a, **k: {})  # type: ignore[assignment]
    from megatron_ext.bridge import te_standin

    te_standin.install()
    from megatron_ext.bridge import table

    for fix in table.BUGFIXES:  # Bridge alone (the runner's --plain scripts) needs it too
        fix.apply()

    table.CPU_RUNNER[0].apply(lambda label: shims._count(f"bridge.{label}"))
