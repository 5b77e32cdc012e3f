"""A NaN or Inf loss or gradient is an incident: Megatron's rerun state machine hands it over.

Why: the detector's own rule is that a non-finite loss is a divergence to roll back at once,
but with ``--check-for-nan-in-loss-and-grad`` (Megatron's default) the loss function and the
DDP grad check send it to Megatron's rerun state machine first, and it never reaches the
detector (issue #30):

- ``--rerun-mode validate_results`` (the default) reruns the step in place. Not reproduced:
  a transient fault, and Megatron stops with 17, as before: a hardware diagnosis the overlay
  keeps. Reproduced: Megatron saves a checkpoint and exits 16 to rerun "on a different GPU";
  resumed on the same GPU it exits 16 again, forever (Megatron-LM #5281). Here the reproduced
  case becomes a rollback request instead (:func:`reproducible_result_rolls_back`): data or a
  real divergence reproduce; a persistent fault of one GPU that reproduces too shows up as the
  same failure after the rollback, which the planner treats as a repeat (it rolls back further,
  bounded, then stops naming what it tried).
- ``--rerun-mode disabled`` raises on the rank that saw it. Here the non-finite result goes on
  (:func:`nonfinite_goes_to_the_detector`): the reduced loss is NaN on every rank, the
  detector sees it after the step and every rank exits with the spike code, no checkpoint of
  the poisoned step saved.
- ``report_determinism_stats`` never rejects a result: the NaN reaches the detector as is.

The iteration is the machine's ``current_iteration``: it counts the step before running it,
so during logged iteration k it is k (Megatron's own messages and tracker lines say k + 1;
verified on 0.17.1-0.19.2 by a NaN injected at logged iteration 11, reported as "#12").

Both wrappers are bound to the installed :class:`~megatron_ext.spikes.adapter.SpikeFeature`
and registered in :mod:`megatron_ext.registry.table` (``spike-rerun-verdict``,
``spike-rerun-disabled``); without ``--spike-detect`` Megatron's behaviour is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from megatron_ext.common.features import collective_device

if TYPE_CHECKING:
    from megatron_ext.spikes.adapter import SpikeFeature

NONFINITE_CHECKS = (torch.isnan, torch.isinf)


def reproducible_result_rolls_back(
    original: Callable[[Any], tuple[bool, bool, int]], feature: SpikeFeature
) -> Callable[[Any], tuple[bool, bool, int]]:
    def should_checkpoint_and_exit(self: Any) -> tuple[bool, bool, int]:
        """A result reproduced on the in-place rerun: a rollback request, not a checkpoint
        and exit 16 (every rank: the state machine reduced its verdict over all of them)."""
        from megatron.core.rerun_state_machine import RerunState

        will_rerun = self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
        verdict = original(self)
        if not will_rerun:
            return verdict
        return False, True, feature.rerun_reproduced(self.current_iteration, _culprits(self))

    return should_checkpoint_and_exit


def _culprits(machine: Any) -> list[int]:
    """The DP ranks whose own validation rejected the result (the state machine keeps the
    failed call only where it failed): one small all-reduce, once, at the incident."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    mine = parallel_state.get_data_parallel_rank() if machine.failed_validation_call else -1
    ranks = torch.full((dist.get_world_size(),), -1, dtype=torch.int64, device=collective_device())
    ranks[dist.get_rank()] = mine
    dist.all_reduce(ranks, op=dist.ReduceOp.MAX)
    return sorted({int(r) for r in ranks.tolist() if r >= 0})


def nonfinite_goes_to_the_detector(
    original: Callable[..., None], feature: SpikeFeature
) -> Callable[..., None]:
    def validate_result(
        self: Any,
        result: Any,
        rejection_func: Callable[[Any], Any],
        message: str,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Under ``--rerun-mode disabled``, a NaN/Inf is left to the detector, not raised."""
        from megatron.core.rerun_state_machine import RerunMode

        if self.mode == RerunMode.DISABLED and rejection_func in NONFINITE_CHECKS:
            if rejection_func(result):
                feature.nonfinite_seen(self.current_iteration, message)
            return None
        return original(self, result, rejection_func, message, *args, **kwargs)

    return validate_result
