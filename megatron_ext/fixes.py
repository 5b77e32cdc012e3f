"""Upstream megatron-core bugs the overlay fixes at start-up, each registered as a patch.

Each fix states the symptom, who hits it and why the fix is safe; ``megatron-ext patches``
lists them. They apply whenever ``pretrain_gpt_ext.py`` runs, because they fix behaviour
that plain Megatron gets wrong with the pip wheel, not features.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_ext.patches import Patch, register


def _skip_make_when_prebuilt(original: Callable[[], None]) -> Callable[[], None]:
    def compile_helpers() -> None:
        """Use the wheel's prebuilt ``helpers_cpp``; only fall back to ``make`` without it."""
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    return compile_helpers


COMPILE_HELPERS = register(
    Patch(
        name="prebuilt-dataset-helpers",
        target="megatron.core.datasets.utils:compile_helpers",
        kind="bugfix",
        reason=(
            "initialize_megatron runs `make` in the installed package, but the pip wheel ships "
            "a prebuilt helpers_cpp and no Makefile, so every wheel user's start-up exits(1). "
            "Skip the build when the prebuilt extension imports."
        ),
        signature="()",
        wrap=_skip_make_when_prebuilt,
    )
)

def _uses_torch_adam() -> bool:
    """The fixes below concern only the torch.optim fallback (no Apex, no TE FusedAdam)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _state_dict_tolerates_fresh_state(original: Callable[[Any], dict]) -> Callable[[Any], dict]:
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


def _load_state_dict_unshares_step(original: Callable[[Any, dict], None]) -> Callable[..., None]:
    def load_state_dict(self: Any, state_dict: dict) -> None:
        """Give every parameter its own ``step`` tensor after Megatron's load."""
        original(self, state_dict)
        if _uses_torch_adam():
            for param_state in self.optimizer.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = param_state["step"].clone()

    return load_state_dict


DISTOPT_FRESH_STATE = register(
    Patch(
        name="distopt-fresh-state-dict",
        target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict",
        kind="bugfix",
        reason=(
            "Without Apex/TE, DistributedOptimizer.state_dict asserts exactly one distinct "
            "Adam step, but loading a checkpoint calls it on a fresh optimizer with no state "
            "yet, so every distributed-optimizer resume crashes. A fresh optimizer reports "
            "step 0; the checkpoint's real step is loaded right after."
        ),
        signature="(self)",
        wrap=_state_dict_tolerates_fresh_state,
    )
)

DISTOPT_UNSHARED_STEP = register(
    Patch(
        name="distopt-unshared-adam-step",
        target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict",
        kind="bugfix",
        reason=(
            "Without Apex/TE, DistributedOptimizer.load_state_dict assigns ONE step tensor to "
            "every parameter; torch Adam increments it in place once per parameter, so after "
            "a resume the bias correction runs N_params steps per iteration (silent drift). "
            "Each parameter gets its own copy."
        ),
        signature="(self, state_dict)",
        wrap=_load_state_dict_unshares_step,
    )
)

def _copy_state_safely(original: Callable[..., None]) -> Callable[..., None]:
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: Any) -> None:
        """Copy checkpointed tensors into main-param views under no_grad, never ``step``."""
        if _uses_torch_adam() and "step" in tensors:
            tensors = {**tensors, "step": None}  # non-tensors are skipped by the copy loop
        with torch.no_grad():
            original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


DISTOPT_STATE_COPY = register(
    Patch(
        name="distopt-state-copy",
        target=(
            "megatron.core.optimizer.distrib_optimizer:"
            "DistributedOptimizer._set_main_param_and_optimizer_states"
        ),
        kind="bugfix",
        reason=(
            "Two resume bugs without Apex/TE. (1) load_parameter_state_from_dp_reshardable "
            "copies checkpoint values into views of leaf parameters that require grad outside "
            "no_grad, so fp32 resumes raise; the copy is data movement, so it runs under "
            "torch.no_grad(). (2) The per-param Adam `step` in the loaded param state is the "
            "non-persistent load template (0), and copying it resets the step restored from "
            "param_groups to 0 (bias correction restarts silently); `step` is left to "
            "param_groups, as the save path intends."
        ),
        signature="(self, model_param, tensors)",
        wrap=_copy_state_safely,
    )
)

def _ignore_stop_signals() -> None:
    """Initializer of the checkpoint writer's results-queue Manager (runs in that process)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _results_queue_survives_stop_signals(original: Callable[..., None]) -> Callable[..., None]:
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


CKPT_RESULTS_QUEUE = register(
    Patch(
        name="ckpt-results-queue-survives-sigterm",
        target=(
            "megatron.core.dist_checkpointing.strategies.filesystem_async:"
            "FileSystemWriterAsync.prepare_write_data"
        ),
        kind="bugfix",
        reason=(
            "torch_dist saves hand their write results through a multiprocessing Manager "
            "queue (filesystem_async.get_write_results_queue) whose server process is started "
            "at the first save, in the rank's process group. Slurm signals every process of a "
            "step and torchrun forwards SIGTERM with killpg, so a preemption or scancel "
            "SIGTERM kills that Manager and the --exit-signal-handler save fails with "
            "BrokenPipeError: the job falls back to its last periodic checkpoint. The queue is "
            "created before upstream's first use, by a Manager that ignores SIGTERM/SIGINT."
        ),
        signature=(
            "(self, plan: torch.distributed.checkpoint.planner.SavePlan, "
            "planner: torch.distributed.checkpoint.planner.SavePlanner) -> None"
        ),
        wrap=_results_queue_survives_stop_signals,
    )
)


BUGFIXES: tuple[Patch, ...] = (
    COMPILE_HELPERS,
    DISTOPT_FRESH_STATE,
    DISTOPT_UNSHARED_STEP,
    DISTOPT_STATE_COPY,
    CKPT_RESULTS_QUEUE,
)


