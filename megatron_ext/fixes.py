"""Wrappers that fix upstream megatron-core bugs (declared in :mod:`megatron_ext.registry`).

Each registry entry states the symptom, who hits it and why the fix is safe; ``megatron-ext
patches`` lists them. They apply whenever ``pretrain_gpt_ext.py`` runs, because they fix
behaviour that plain Megatron gets wrong with the pip wheel, not features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def skip_make_when_prebuilt(original: Callable[[], None]) -> Callable[[], None]:
    def compile_helpers() -> None:
        """Use the wheel's prebuilt ``helpers_cpp``; only fall back to ``make`` without it."""
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    return compile_helpers


def _uses_torch_adam() -> bool:
    """The fixes below concern only the torch.optim fallback (no Apex, no TE FusedAdam)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def state_dict_tolerates_fresh_state(original: Callable[[Any], dict]) -> Callable[[Any], dict]:
    def state_dict(self: Any) -> dict:
        """A not-yet-stepped torch optimizer has no per-param ``step``; report step 0."""
        if not _uses_torch_adam() or self.optimizer.state:
            return original(self)
        inner = self.optimizer.state_dict()
        result: dict[str, Any] = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for group in result["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0
        if self.grad_scaler:
            result["grad_scaler"] = self.grad_scaler.state_dict()
        return result

    return state_dict


def load_state_dict_unshares_step(original: Callable[[Any, dict], None]) -> Callable[..., None]:
    def load_state_dict(self: Any, state_dict: dict) -> None:
        """Give every parameter its own ``step`` tensor after Megatron's load."""
        original(self, state_dict)
        if _uses_torch_adam():
            for param_state in self.optimizer.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = param_state["step"].clone()

    return load_state_dict


def copy_state_safely(original: Callable[..., None]) -> Callable[..., None]:
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: Any) -> None:
        """Copy checkpointed tensors into main-param views under no_grad, never ``step``."""
        if _uses_torch_adam() and "step" in tensors:
            tensors = {**tensors, "step": None}  # non-tensors are skipped by the copy loop
        with torch.no_grad():
            original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _ignore_stop_signals() -> None:
    """Initializer of the checkpoint writer's results-queue Manager (runs in that process)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def results_queue_survives_stop_signals(original: Callable[..., None]) -> Callable[..., None]:
    def prepare_write_data(self: Any, plan: Any, planner: Any) -> None:
        """Create the results queue first (upstream reuses it), its Manager deaf to SIGTERM."""
        import multiprocessing
        from multiprocessing.managers import SyncManager

        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            manager.start(initializer=_ignore_stop_signals)
            filesystem_async._results_queue = manager.Queue()
        return original(self, plan, planner)

    return prepare_write_data
