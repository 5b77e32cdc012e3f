"""The feature protocol: one object per feature, with its flags, checks, state and hooks.

A run calls ``add_args``, ``enabled``, ``validate`` (before distributed init), ``install``
(then its registry patches where ``needs_patch``) and the hooks it overrides, in
:func:`megatron_ext.loop.install.all_features` order. Features never import each other: what
one produces for another goes on the :class:`StepRecord` or the :class:`MicroBatch`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megatron_ext.common.errors import StartupError


class FeatureError(StartupError):
    """A feature's flags cannot work as given; the message says what to do (exit 1)."""


def writing_rank(world_size: int) -> int:
    """The rank writing the per-step records (the last: it holds the last stage's losses)."""
    return world_size - 1


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only, before or after torch.distributed is initialised."""
    import torch  # late, as in collective_device

    dist = torch.distributed
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, flush=True)


def collective_device() -> str:
    """Where a collective's tensor must live: CUDA for NCCL, CPU for gloo (the CPU harness)."""
    import torch  # late: this module is imported by cores that never communicate

    return "cuda" if torch.cuda.is_available() else "cpu"


def is_writing_rank(rank: int, world_size: int) -> bool:
    """Whether ``rank`` is :func:`writing_rank`."""
    return rank == writing_rank(world_size)


def from_writing_rank(size: int, read: Callable[[], list[float]]) -> list[float]:
    """``read()`` on the writing rank (which holds the run's files), broadcast to every rank
    as ``size`` floats, NaN past what it returned. Call on every rank."""
    import torch  # late, as in collective_device

    dist = torch.distributed
    values = torch.full((size,), math.nan, dtype=torch.float64)
    world = dist.get_world_size()
    if is_writing_rank(dist.get_rank(), world):
        read_values = read()
        values[: len(read_values)] = torch.tensor(read_values, dtype=torch.float64)
    values = values.to(collective_device())
    dist.broadcast(values, src=writing_rank(world))
    return values.tolist()


# What megatron-core's BlendedDataset adds to every sample: the index of its blend member.
DATASET_ID_KEY = "dataset_id"


@dataclass
class MicroBatch:
    """One micro-batch as the features see it, from ``on_batch`` to ``on_loss``; ``extras``
    carries what a feature noted at read time for loss time (e.g. sample ids)."""

    iteration: int  # 1-indexed, as Megatron logs it
    training: bool
    dp_rank: int
    reads_data: bool = False  # this rank read the batch (TP rank 0 of the first/last stage)
    # [micro-batch] blend member of each sample (megatron-core's BlendedDataset returns it;
    # Megatron's own get_batch drops it): set where reads_data, None when not a blend.
    dataset_ids: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


LM_LOSS_PER_TOKEN = "lm_loss_per_token"
"""``MicroBatch.extras`` key: the ``[b, s]`` per-token ``lm loss``, published in ``on_loss`` by
a feature whose training loss differs (z-loss); absent, ``LossInputs.per_token`` is it."""


@dataclass
class LossInputs:
    """What ``on_loss`` gets: this rank's micro-batch loss, before any averaging."""

    micro_batch: MicroBatch
    per_token: Any  # [b, s] per-token training loss (Megatron's output tensor)
    mask: Any  # flattened float loss mask
    loss: Any  # token-summed loss (0-d tensor)
    num_tokens: Any  # int tensor


@dataclass
class StepRecord:
    """One iteration as Megatron's ``training_log`` saw it, shared by all features; only the
    writing rank has ``signals`` (telemetry fills them, the spike detector reads them)."""

    iteration: int
    losses: dict[str, Any]  # Megatron's reduced loss_dict (tensors: read them where needed)
    learning_rate: float | None
    loss_scale: float
    skipped_iter: bool
    grad_norm: float | None
    params_norm: float | None
    num_zeros: float | None
    max_attention_logit: float | None
    update_skipped: bool = False  # --spike-skip-update withheld this step's update
    recovery: dict[str, float] | None = None  # --recovery-iters: the step was in the window
    signals: Any = None  # megatron_ext.common.records.signals.SignalRecord on the writing rank


class Feature:
    """Base class; subclasses override what they need (every hook is optional)."""

    name: ClassVar[str] = "feature"

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        """Add this feature's flags."""

    def enabled(self, args: Any) -> bool:
        """Whether the flags ask for this feature."""
        return False

    def validate(self, args: Any) -> None:
        """Raise :class:`FeatureError` for flags that cannot work (before distributed init)."""

    def install(self, args: Any) -> None:
        """Set up this feature's state from the args it keeps (before distributed init)."""

    def needs_patch(self, name: str) -> bool:
        """After :meth:`install`: whether the registry's patch ``name`` of this feature (one
        of its ``feature=`` entries) is to be applied; it is bound to this instance."""
        return True

    # Hooks: the base versions are never called (see :meth:`implements`).
    # Model chunks built, not yet wrapped (no DDP, no optimizer).
    def on_model_built(self, model: list[Any]) -> None: ...
    # Model chunks and optimizer exist (lay out buckets, open files).
    def on_setup(self, model: list[Any], optimizer: Any) -> None: ...
    # The train dataset is built (data-reading ranks); may wrap it.
    def on_train_dataset(self, dataset: Any) -> Any: ...
    # TP rank 0 of a data-reading stage got a micro-batch; may change it.
    def on_batch(self, batch: dict[str, Any], micro_batch: MicroBatch) -> None: ...
    # The last stage computed a micro-batch's loss; returns extra ``report`` entries.
    def on_loss(self, inputs: LossInputs) -> dict[str, Any]: ...
    # Grads reduced, not yet clipped.
    def before_grad_norm(self, optimizer: Any) -> None: ...
    # An iteration was logged: read and fill the StepRecord.
    def after_step(self, record: StepRecord) -> None: ...
    # Megatron is about to save; False vetoes the save.
    def on_checkpoint(self, iteration: int) -> bool: ...

    def implements(self, hook: Callable[..., Any]) -> bool:
        """Whether this feature overrides ``hook`` (a :class:`Feature` method)."""
        return getattr(type(self), hook.__name__) is not hook


HOOKS: tuple[Callable[..., Any], ...] = (
    Feature.on_model_built,
    Feature.on_setup,
    Feature.on_train_dataset,
    Feature.on_batch,
    Feature.on_loss,
    Feature.before_grad_norm,
    Feature.after_step,
    Feature.on_checkpoint,
)


@dataclass
class ModelBuilt:
    """The chunks the overlay's model provider built so far (0.17/0.18) and whether
    ``on_model_built`` ran (:meth:`FeatureSet.check_model_built`)."""

    chunks: list[Any] = field(default_factory=list)
    hook_ran: bool = False


@dataclass(frozen=True)
class FeatureSet:
    """The features installed for one run, in hook order; the hook wrappers and the entry
    point's functions are bound to it (no process-wide singleton)."""

    args: Any
    features: tuple[Feature, ...]
    built: ModelBuilt = field(default_factory=ModelBuilt)

    @classmethod
    def install(cls, features: list[Feature], args: Any) -> FeatureSet:
        """Validate every enabled feature first, then install them (nothing is half-done)."""
        enabled = [f for f in features if f.enabled(args)]
        for feature in enabled:
            feature.validate(args)
        for feature in enabled:
            feature.install(args)
        return cls(args, tuple(enabled))

    def using(self, hook: Callable[..., Any]) -> list[Feature]:
        """The installed features overriding ``hook`` (e.g. ``Feature.after_step``)."""
        return [f for f in self.features if f.implements(hook)]

    def check_model_built(self) -> None:
        """Fail loudly when ``on_model_built`` never ran though a feature uses it (registry
        ``model-pre-wrap-hooks``): its checks would silently not run."""
        if self.using(Feature.on_model_built) and not self.built.hook_ran:
            raise StartupError(
                "on_model_built never ran: this megatron-core's model builder did not call "
                "the overlay's hook (registry model-pre-wrap-hooks); re-verify its variant"
            )
