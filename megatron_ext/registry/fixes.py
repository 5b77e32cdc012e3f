"""The wrappers of the registry's own patches (:mod:`megatron_ext.registry.table` says why
each exists): the upstream bug fixes every run gets, the classic entry point's parsed args
(0.17) and the CPU runner's ``allow_no_cuda``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_ext.common.stop_signals import ignore_stop_signals


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


def start_results_queue(method: str) -> None:
    """Create torch_dist's write-results queue (upstream reuses the one it finds), its Manager
    deaf to SIGTERM and started by ``method``; nothing if the queue exists. The CPU runner
    starts it by ``fork`` (no torch import in the Manager) while it has one thread."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context(method))
        manager.start(initializer=ignore_stop_signals, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()


def results_queue_survives_stop_signals(original: Callable[..., None]) -> Callable[..., None]:
    def prepare_write_data(self: Any, plan: Any, planner: Any) -> None:
        """Create the results queue first (upstream reuses it), its Manager deaf to SIGTERM."""
        start_results_queue("spawn")
        return original(self, plan, planner)

    return prepare_write_data


def docstring_help_is_text(original: Callable[..., dict]) -> Callable[..., dict]:
    def _build_argparse_kwargs_from_field(self: Any, attribute: Any) -> dict:
        """A field docstring used as help is prose: escape its ``%`` for argparse."""
        kwargs = original(self, attribute)
        text = kwargs.get("help")
        if isinstance(text, str) and text == self.field_docstrings.get(attribute.name):
            kwargs["help"] = text.replace("%", "%%")
        return kwargs

    return _build_argparse_kwargs_from_field


def with_parsed_args(original: Callable[..., Any], bound: Any) -> Callable[..., Any]:
    """Classic ``initialize_megatron`` on the entry point's parsed args (``bound.args``: it
    validates them and makes them the global args), then ``bound.initialized()``."""

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["parsed_args"] = bound.args
        result = original(*args, **kwargs)
        bound.initialized()
        return result

    return initialize_megatron


def allows_no_cuda(
    original: Callable[..., Any], count: Callable[[str], None]
) -> Callable[..., Any]:
    """The CPU runner's ``initialize_megatron``: ``allow_no_cuda=True``, counted by ``count``."""

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        count("initialize_megatron(allow_no_cuda)")
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron
