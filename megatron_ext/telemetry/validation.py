"""Per-dataset validation loss: Megatron's evaluation ``lm loss`` per blend member, reduced
once per evaluated set, checked against Megatron's number, then printed, logged to
TensorBoard and to ``validation.jsonl`` (docs/signals.md).
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from megatron_ext.common.features import (
    LM_LOSS_PER_TOKEN,
    Feature,
    LossInputs,
    collective_device,
    is_writing_rank,
)
from megatron_ext.common.records.sources import member_names
from megatron_ext.common.records.validation import ValidationRecord, ValidationWriter
from megatron_ext.telemetry.sources import SourceAccumulator, format_sources

# Σ member loss sums / Σ tokens must equal Megatron's number to this relative tolerance
# (Megatron sums in fp32, the members in fp64).
LOSS_CHECK_RTOL = 1e-5
SPLITS = {1: "valid", 2: "test"}  # Megatron's split index -> the record's name


def evaluated_sets(
    blend: Any, blend_per_split: Any, multiple_sets: bool
) -> dict[str, list[list[str]]]:
    """Per evaluated split, the member names of each set Megatron evaluates, in its order:
    the ``--data-path`` blend, or the split's own (``--valid-data-path``); with
    ``--multiple-validation-sets`` each valid prefix is a set of its own."""
    sets: dict[str, list[list[str]]] = {}
    for index, split in SPLITS.items():
        chosen = blend if blend_per_split is None else blend_per_split[index]
        if chosen is None:
            continue
        names = member_names(list(chosen[0]))
        separate = split == "valid" and multiple_sets and blend_per_split is not None
        sets[split] = [[n] for n in names] if separate and len(names) > 1 else [names]
    return sets


def set_names(count: int, names: list[str] | None) -> list[str]:
    """Megatron's suffix of each of ``count`` validation sets: ``--validation-set-names``
    (megatron-core 0.19) or the index."""
    return list(names) if names else [str(i) for i in range(count)]


def reduces_to(
    losses: dict[str, float], tokens: dict[str, int], megatron_loss: float
) -> tuple[bool, float]:
    """Whether Σ member loss·tokens / Σ tokens is Megatron's loss (to :data:`LOSS_CHECK_RTOL`),
    and that combined value."""
    total = sum(tokens.values())
    combined = sum(losses[n] * tokens[n] for n in losses) / total if total else math.nan
    ok = abs(combined - megatron_loss) <= LOSS_CHECK_RTOL * max(abs(megatron_loss), 1e-30)
    return ok, combined


@dataclass
class SetResult:
    """One evaluated set: Megatron's lm loss and the members' (the reducing ranks only)."""

    name: str | None
    lm_loss: float | None
    losses: dict[str, float]
    tokens: dict[str, int]


@dataclass
class Evaluation:
    """One ``evaluate_and_print_results`` call in progress: its split, iteration and sets."""

    split: str
    iteration: int
    prefix: str
    tensorboard: bool
    results: list[SetResult] = field(default_factory=list)


class ValidationFeature(Feature):
    """Per-member sums in evaluation forwards, reduced and reported per evaluated set."""

    name = "validation_by_dataset"

    def __init__(self) -> None:
        self.args: Any = None
        self.sets: dict[str, list[list[str]]] = {}
        self.sums: SourceAccumulator | None = None  # the set being evaluated, last stage
        self.evaluation: Evaluation | None = None
        self.writer: ValidationWriter | None = None

    def enabled(self, args: Any) -> bool:
        return bool(args.signals_dir and args.signals_by_dataset)

    def install(self, args: Any) -> None:
        from megatron.training.utils import get_blend_and_blend_per_split

        self.args = args
        blend, per_split = get_blend_and_blend_per_split(args)
        self.sets = evaluated_sets(blend, per_split, bool(args.multiple_validation_sets))

    def needs_patch(self, name: str) -> bool:
        return bool(self.sets)  # mock data: no members to name

    def on_setup(self, model: list[Any], optimizer: Any) -> None:
        if self.sets and is_writing_rank(dist.get_rank(), dist.get_world_size()):
            self.writer = ValidationWriter(self.args.signals_dir)  # before any signals line

    def on_loss(self, inputs: LossInputs) -> dict[str, Any]:
        """An evaluation micro-batch on the rank that read it: its lm loss per member."""
        batch = inputs.micro_batch
        if self.sums is not None and not batch.training and batch.reads_data:
            per_token = batch.extras.get(LM_LOSS_PER_TOKEN, inputs.per_token)
            self.sums.add(per_token.detach(), inputs.mask, batch.dataset_ids)
        return {}

    def begin(self, prefix: str, iteration: int, tensorboard: bool) -> None:
        """Megatron starts evaluating after ``iteration`` (``prefix`` names the split)."""
        split = "test" if prefix.endswith("on test set") else "valid"
        self.evaluation = Evaluation(split, iteration, prefix, tensorboard)

    def start_set(self) -> None:
        """Megatron's ``evaluate`` starts the next set: fresh sums on the last stage."""
        from megatron.core import mpu

        self.sums = None
        members = self._members()
        if members is not None and mpu.is_pipeline_last_stage():
            self.sums = SourceAccumulator(members, collective_device())

    def _members(self) -> list[str] | None:
        if self.evaluation is None:
            return None
        sets = self.sets.get(self.evaluation.split, [])
        index = len(self.evaluation.results)
        return sets[index] if index < len(sets) else None

    def end_set(self, loss_dict: Any, timelimit: bool) -> None:
        """Megatron's ``evaluate`` returned: reduce this set's sums (every rank of the last
        stage) and keep them with Megatron's lm loss for :meth:`report`."""
        from megatron.core import mpu

        sums, self.sums = self.sums, None
        if self.evaluation is None or self._members() is None or timelimit:
            return
        losses: dict[str, float] = {}
        tokens: dict[str, int] = {}
        if sums is not None:  # TP ranks > 0 add zeros; CP ranks their sequence parts
            losses, tokens = sums.reduce(mpu.get_tensor_and_data_parallel_group(True))
        megatron = (loss_dict or {}).get("lm loss")
        lm_loss = None if megatron is None else float(megatron)
        index = len(self.evaluation.results)
        name = None
        if self.args.multiple_validation_sets and self.evaluation.split == "valid":
            count = len(self.sets["valid"])
            name = set_names(count, getattr(self.args, "validation_set_names", None))[index]
        self.evaluation.results.append(SetResult(name, lm_loss, losses, tokens))

    def report(self) -> None:
        """After Megatron printed: on the writing rank, check, print, log and record each set."""
        evaluation, self.evaluation = self.evaluation, None
        if evaluation is None or not is_writing_rank(dist.get_rank(), dist.get_world_size()):
            return
        for result in evaluation.results:
            self._check(evaluation, result)
            self._log(evaluation, result)
            if self.writer is not None:
                self.writer.write(self._record(evaluation, result))

    def _check(self, evaluation: Evaluation, result: SetResult) -> None:
        if result.lm_loss is None or not math.isfinite(result.lm_loss) or not result.tokens:
            return
        ok, combined = reduces_to(result.losses, result.tokens, result.lm_loss)
        if not ok:
            print(
                f"megatron-ext WARNING: {evaluation.prefix}: the members' validation lm loss "
                f"combine to {combined:.9g}, Megatron's is {result.lm_loss:.9g} (rtol "
                f"{LOSS_CHECK_RTOL}); per-dataset validation does not cover what Megatron "
                "evaluated",
                flush=True,
            )

    def _log(self, evaluation: Evaluation, result: SetResult) -> None:
        from megatron_ext.telemetry.adapter import write_scalars  # imports Megatron

        what = "validation" if evaluation.split == "valid" else "test"
        suffix = f"-{result.name}" if result.name is not None else ""
        key = f"lm-loss-{what}{suffix}-by-dataset"
        scalars = {f"{key}/{n}": v for n, v in result.losses.items()}
        write_scalars(scalars, evaluation.iteration, evaluation.tensorboard)
        print(
            f" validation{suffix} lm loss by dataset at {evaluation.prefix} | "
            f"{format_sources(result.losses, result.tokens)}",
            flush=True,
        )

    def _record(self, evaluation: Evaluation, result: SetResult) -> ValidationRecord:
        return ValidationRecord(
            iteration=evaluation.iteration,
            attempt=0,
            job_id=os.environ.get("SLURM_JOB_ID", "local"),
            wall_time=time.time(),
            consumed_samples=int(self.args.consumed_train_samples),
            split=evaluation.split,
            set_name=result.name,
            lm_loss=result.lm_loss,
            lm_loss_by_dataset=result.losses,
            tokens_by_dataset=result.tokens,
        )


def evaluating_by_dataset(
    original: Callable[..., Any], feature: ValidationFeature
) -> Callable[..., Any]:
    """Wrap Megatron's ``evaluate_and_print_results`` (registry ``validation-by-dataset``):
    the split and iteration it evaluates, and the report once Megatron printed its own."""
    signature = inspect.signature(original)

    def evaluate_and_print_results(*args: Any, **kwargs: Any) -> Any:
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        feature.begin(
            a.arguments["prefix"],
            a.arguments["iteration"],
            bool(a.arguments["write_to_tensorboard"]),
        )
        try:
            result = original(*args, **kwargs)
            feature.report()
        finally:
            feature.evaluation = None  # report() took it; or Megatron's evaluation raised
        return result

    return evaluate_and_print_results


def summed_by_dataset(
    original: Callable[..., Any], feature: ValidationFeature
) -> Callable[..., Any]:
    """Wrap Megatron's ``evaluate`` (registry ``validation-set-by-dataset``): one set's
    per-member sums, reduced when it returns."""

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        feature.start_set()
        result = original(*args, **kwargs)
        loss_dict, _, timelimit = result
        feature.end_set(loss_dict, bool(timelimit))
        return result

    return evaluate
