"""The telemetry feature in Megatron: per-bucket and per-layer norms and the per-step signals
log (docs/signals.md). ``before_grad_norm`` launches the squared norms' all-reduces,
``on_loss`` sums the lm loss (per blend member too), ``after_step`` writes the record.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import mpu
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.training import get_tensorboard_writer, get_wandb_writer
from megatron.training import training as megatron_training

from megatron_ext.common.features import (
    LM_LOSS_PER_TOKEN,
    Feature,
    FeatureError,
    LossInputs,
    StepRecord,
    collective_device,
    is_writing_rank,
    writing_rank,
)
from megatron_ext.common.records.signals import SignalRecord, SignalsWriter
from megatron_ext.common.records.sources import train_members
from megatron_ext.common.validation import check_directory
from megatron_ext.telemetry.bucket_layout import (
    BucketNormer,
    Reduction,
    assign_slots,
    bucket_views,
    grad_stats_groups,
    layer_layout,
    params_by_group,
)
from megatron_ext.telemetry.layers import GRAD, PARAM, UPDATE, roots, split_slots
from megatron_ext.telemetry.sharded import (
    UnitNormer,
    fsdp_units,
    is_fully_sharded,
    main_params,
    snapshot,
    update_ratio,
)
from megatron_ext.telemetry.sources import SourceAccumulator, format_sources
from megatron_ext.telemetry.step_sums import StepSums, StepValues
from megatron_ext.telemetry.stragglers import (
    StepClock,
    Stragglers,
    StragglerWatch,
    add_straggler_args,
    check_straggler_args,
)

# Σ bucket² must equal grad-norm² to this relative tolerance (fp32 summation-order noise).
NORM_CHECK_RTOL = 1e-5


def _is_writer() -> bool:
    return is_writing_rank(dist.get_rank(), dist.get_world_size())


def _counted(param: torch.Tensor, optimizer: Any) -> bool:
    """Whether Megatron's grad norm counts ``param`` on this rank: its own filter with the
    optimizer part's groups (assumption ``optimizer-tp-groups``; ``expert_tp_group`` only
    where the part has one, as before megatron-core 0.19)."""
    try:
        groups = {"tp_group": optimizer.tp_group}
    except AttributeError as exc:
        raise RuntimeError(
            f"megatron-ext telemetry: {type(optimizer).__name__} has no {exc.name} (registry "
            "assumption optimizer-tp-groups); re-verify megatron_ext.telemetry.adapter"
        ) from None
    if hasattr(optimizer, "expert_tp_group"):
        groups["expert_tp_group"] = optimizer.expert_tp_group
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, **groups)


def _main_of(param: torch.Tensor, holders: dict[int, torch.Tensor]) -> Any:
    """A parameter's fp32 main copy: the distributed optimizer's shard on it (registry
    ``distopt-main-param``), Float16Optimizer's whole one (``holders``), or None (fp32)."""
    shard = getattr(param, "main_param", None)
    if shard is not None and getattr(param, "main_param_sharded", False):
        return shard, True
    return (holders[id(param)], False) if id(param) in holders else None


def write_scalars(scalars: dict[str, float], step: int, tensorboard: bool = True) -> None:
    """``scalars`` to Megatron's TensorBoard writer (where ``tensorboard``) and to W&B."""
    writer, wandb = get_tensorboard_writer(), get_wandb_writer()
    if tensorboard and writer is not None:
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
    if wandb is not None and scalars:
        wandb.log(scalars, step)


def step_lr(reported: float | None, now: list[float], before: list[float] | None) -> float | None:
    """The learning rate the step used. Megatron reports the next iteration's lr of its
    logging group, the first whose lr ``now`` is the reported one; ``before`` holds each
    group's lr as the step ran (None: an overflow skip, the schedule stood still)."""
    if reported is None or before is None:
        return reported
    for current, used in zip(now, before):
        if current == reported:
            return used
    return reported


class TelemetryFeature(Feature):
    """Bucket grad norms, the worst DP rank's loss, the update ratio and the signals log."""

    name = "telemetry"

    def __init__(self) -> None:
        self.args: Any = None
        self.model: list[Any] = []
        self.optimizer: Any = None
        self.normer: BucketNormer | UnitNormer | None = None
        self.reductions: list[Reduction] = []
        self.pending: list[torch.Tensor] = []
        self.snapshot: list[list[torch.Tensor]] | None = None
        self.layer_snapshot: list[torch.Tensor] | None = None  # --log-layer-norms' weights
        self.loss_sum: torch.Tensor | float = 0.0
        self.loss_tokens: torch.Tensor | float = 0.0
        self.writer: SignalsWriter | None = None
        self.members: list[str] = []
        self.sources: SourceAccumulator | None = None
        self.step_lrs: list[float] | None = None  # each param group's lr as the step ran
        self.sums: StepSums | None = None  # the after-step all-reduce (--signals-dir)
        self.clock: StepClock | None = None  # this rank's busy time per step
        self.peers = 0  # the first rank of this rank's DP group: its straggler peers
        self.stragglers: Stragglers | None = None  # the writer's rule

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--log-bucket-grad-norms",
            action="store_true",
            help="Log the L2 norm of every DDP gradient bucket's reduced, pre-clip gradient "
            "each step (console at --log-interval, TensorBoard key bucket-grad-norm/<name>, "
            "W&B, signals log).",
        )
        group.add_argument(
            "--log-layer-norms",
            action="store_true",
            help="Log each transformer layer's (and the embedding's, final norm's, output "
            "layer's) gradient and weight L2 norms every step, from the bucket norms' pass and "
            "all-reduce (console at --log-interval, TensorBoard layer-grad-norm/<name>, "
            "layer-param-norm/<name>, signals log); with --signals-update-ratio, update norms.",
        )
        group.add_argument(
            "--signals-dir",
            type=str,
            default=None,
            help="Append one JSON line per iteration to DIR/signals.jsonl (written by the "
            "last rank every step): losses, worst DP rank, grad/bucket/params norms, lr, loss "
            "scale, zeros, flags, job id and attempt.",
        )
        group.add_argument(
            "--no-signals-by-dataset",
            dest="signals_by_dataset",
            action="store_false",
            help="Leave the per-source fields (lm_loss_by_dataset, tokens_by_dataset: each "
            "train blend member's loss and tokens) out of the signals, and their one small "
            "all-reduce per step, and the per-dataset validation loss (validation.jsonl, "
            "console, TensorBoard lm-loss-validation-by-dataset/<name>); both recorded by "
            "default with --signals-dir.",
        )
        group.add_argument(
            "--signals-update-ratio",
            action="store_true",
            help="Also record ||Δθ||/||θ|| per step. Keeps an fp32 copy of this rank's "
            "optimizer parameters (1/DP of them with the distributed optimizer), hence opt-in.",
        )
        add_straggler_args(group)

    def enabled(self, args: Any) -> bool:
        return bool(
            args.log_bucket_grad_norms
            or args.log_layer_norms
            or args.signals_dir
            or args.signals_update_ratio
        )

    def validate(self, args: Any) -> None:
        if args.signals_update_ratio and not args.signals_dir:
            raise FeatureError("--signals-update-ratio needs --signals-dir (it is a signals field)")
        if args.signals_dir:
            try:
                check_directory("--signals-dir", args.signals_dir)
                check_straggler_args(args)
            except ValueError as exc:
                raise FeatureError(str(exc)) from None

    def install(self, args: Any) -> None:
        self.args = args
        if args.signals_dir and args.signals_by_dataset:
            self.members = train_members(args)

    def on_setup(self, model: list[Any], optimizer: Any) -> None:
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        if optimizer is None and self.args.skip_train:  # evaluation only: no step to measure
            return
        if not isinstance(optimizer, ChainedOptimizer):
            raise RuntimeError(
                f"megatron-ext telemetry expects Megatron's ChainedOptimizer, got "
                f"{type(optimizer).__name__}; re-verify megatron_ext.telemetry.adapter"
            )
        self.model, self.optimizer = model, optimizer
        if self.args.log_bucket_grad_norms or self.args.log_layer_norms:
            self._layout_buckets()
        if self.args.signals_dir and _is_writer():
            self.writer = SignalsWriter(self.args.signals_dir)
        if self.members and mpu.is_pipeline_last_stage():
            device = next(p.device for chunk in model for p in chunk.parameters())
            self.sources = SourceAccumulator(self.members, device)
        if self.args.signals_dir:
            self._setup_after_step(model)

    def _setup_after_step(self, model: list[Any]) -> None:
        """The after-step all-reduce's layout, this rank's busy-time clock, each rank's node
        (gathered once, to the writer) and the writer's straggler rule."""
        world = dist.get_world_size()
        self.sums = StepSums(len(self.members), mpu.get_data_parallel_world_size(), world)
        self.peers = min(dist.get_process_group_ranks(mpu.get_data_parallel_group()))
        self.clock = StepClock(collective_device() == "cuda")
        self.clock.attach(model)
        nodes: list[Any] | None = [None] * world if _is_writer() else None
        dist.gather_object(socket.gethostname(), nodes, dst=writing_rank(world))
        if nodes is not None:
            a = self.args
            watch = StragglerWatch(a.straggler_factor, a.straggler_steps, a.straggler_min_seconds)
            self.stragglers = Stragglers(watch, [str(n) for n in nodes])

    def _layout_buckets(self) -> None:
        """Bucket views (FSDP2: ``fully_shard`` units) and their reduction slots."""
        parts, by_layer = self.optimizer.chained_optimizers, self.args.log_layer_norms
        groups = grad_stats_groups(parts, bool(self.args.num_experts))
        counted = lambda p: _counted(p, parts[0])  # every part carries the same TP groups
        if is_fully_sharded(self.model):
            units, normer = fsdp_units(self.model, counted, parts, by_layer)
            views, layers, self.normer = {False: units, True: []}, normer.layers, normer
        else:
            holders = main_params(parts)
            main_of = lambda p: _main_of(p, holders)
            views = bucket_views(self.model, counted, param_is_not_shared, main_of)
            layers, owners = layer_layout(views)
            self.normer = BucketNormer([*views[False], *views[True]], owners if by_layer else None)
        self.reductions = assign_slots(
            views,
            groups,
            stage=mpu.get_pipeline_model_parallel_rank(),
            staged=mpu.get_pipeline_model_parallel_world_size() > 1,
            expert_rank=mpu.get_expert_model_parallel_rank(),
            layers=layers if by_layer else None,
        )

    def before_grad_norm(self, optimizer: Any) -> None:
        """Grads are reduced and not yet clipped: launch the bucket norms' all-reduces."""
        if optimizer is not self.optimizer:
            return
        self.step_lrs = [group["lr"] for group in optimizer.param_groups]
        if self.normer is not None:
            # fp16: grad_data holds scaled grads; the loss scale stays a tensor (no host sync).
            local = self.normer(optimizer.get_loss_scale())
            self.pending = self._slots(local)
            for reduction, slots in zip(self.reductions, self.pending):
                dist.all_reduce(slots, group=reduction.group)
        if self.args.signals_update_ratio:
            self.snapshot = snapshot(params_by_group(optimizer.chained_optimizers, _counted))
            if self.args.log_layer_norms and self.normer is not None:
                self.layer_snapshot = self.normer.snapshot()

    def _slots(self, local: torch.Tensor) -> list[torch.Tensor]:
        """``local`` (the normer's vector) placed in each reduction's slots."""
        out = []
        for reduction in self.reductions:
            slots = torch.zeros(len(reduction.names), dtype=torch.float64, device=local.device)
            for first, count, offset in reduction.parts:
                slots[offset : offset + count] = local[first : first + count]
            out.append(slots)
        return out

    def on_loss(self, inputs: LossInputs) -> dict[str, Any]:
        """Accumulate this rank's token-summed lm loss (pure CE, as ``lm loss``; no sync)."""
        if inputs.micro_batch.training and self.args.signals_dir:
            per_token = inputs.micro_batch.extras.get(LM_LOSS_PER_TOKEN)
            loss = inputs.loss.detach().float()
            if per_token is not None:
                loss = torch.sum(per_token.reshape(-1).float() * inputs.mask)
            self.loss_sum = self.loss_sum + loss
            self.loss_tokens = self.loss_tokens + inputs.num_tokens.detach().float()
            if self.sources is not None and inputs.micro_batch.reads_data:
                lm = per_token if per_token is not None else inputs.per_token
                self.sources.add(lm.detach(), inputs.mask, inputs.micro_batch.dataset_ids)
        return {}

    def _reduce_after_step(self) -> torch.Tensor:
        """The worst DP rank's loss sums, the per-source sums and every rank's busy time: one
        all-reduce over every rank (:mod:`.step_sums`), read by the writer alone."""
        assert self.sums is not None and self.clock is not None
        loss = None  # TP rank 0 of the last stage adds its replica's (CP: its part)
        adds = mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0
        if adds and torch.is_tensor(self.loss_tokens):
            loss = (torch.as_tensor(self.loss_sum), self.loss_tokens)
        values = self.sums.pack(
            collective_device(),
            dist.get_rank(),
            self.clock.read(),
            self.peers,
            sources=None if self.sources is None else self.sources.take(),
            loss=loss,
            replica=mpu.get_data_parallel_rank(),
        )
        self.loss_sum, self.loss_tokens = 0.0, 0.0
        dist.all_reduce(values)
        return values

    def after_step(self, record: StepRecord) -> None:
        names = [n for reduction in self.reductions for n in reduction.names]
        slots = split_slots(names, [v for slots in self.pending for v in slots.tolist()])
        self.pending = []
        bucket_sq = slots[0] if self.args.log_bucket_grad_norms else {}
        buckets, layers = roots(bucket_sq), (roots(slots[1]), roots(slots[2]))
        grad_norm = record.grad_norm
        if grad_norm is not None and math.isfinite(grad_norm):
            for what, squares in (("bucket", bucket_sq), ("layer", slots[1])):
                if squares:
                    self._check(record.iteration, sum(squares.values()), grad_norm, what)
        summed = None if self.sums is None else self._reduce_after_step()
        riders = []  # per-layer update norms ride in the update ratio's all-reduces
        if self.layer_snapshot is not None and self.normer is not None:
            local = self.normer.update_squares(self.layer_snapshot)
            riders = [(r.group, s) for r, s in zip(self.reductions, self._slots(local))]
        ratio = None
        if self.snapshot is not None:
            sets = params_by_group(self.optimizer.chained_optimizers, _counted)
            ratio = update_ratio(sets, self.snapshot, riders)
        self.snapshot = self.layer_snapshot = None
        values = [v for _, slots in riders for v in slots.tolist()]
        updates = roots(split_slots(names, values)[1]) if riders else {}
        params_norm = record.params_norm
        if self.args.signals_dir and params_norm is None:  # the patched one (FSDP2: global)
            params_norm = megatron_training.calc_params_l2_norm(self.model)
        if not _is_writer():
            return
        step = StepValues() if summed is None else self.sums.read(summed.tolist(), self.members)
        by_dataset, slow = step.by_dataset, self._log_stragglers(record.iteration, step)
        self._log_norms(record.iteration, "bucket", ("bucket-grad-norm/", buckets))
        self._log_norms(record.iteration, "layer", *zip((GRAD, PARAM, UPDATE), (*layers, updates)))
        self._log_sources(record.iteration, *by_dataset)
        if self.writer is None:
            return
        args = self.args
        losses = {k: float(v) for k, v in record.losses.items()}
        record.signals = SignalRecord(
            iteration=record.iteration,
            attempt=0,
            job_id=os.environ.get("SLURM_JOB_ID", "local"),
            wall_time=time.time(),
            consumed_samples=int(args.consumed_train_samples),
            skipped_samples=int(args.skipped_train_samples),
            lm_loss=losses.get("lm loss"),
            z_loss=losses.get("z loss"),
            max_local_loss=step.worst_loss,
            max_loss_dp_rank=step.worst_rank,
            grad_norm=grad_norm,
            bucket_grad_norms=buckets,
            layer_grad_norms=layers[0],
            layer_param_norms=layers[1],
            layer_update_norms=updates,
            lm_loss_by_dataset=by_dataset[0],
            tokens_by_dataset=by_dataset[1],
            params_norm=params_norm,
            update_ratio=ratio,
            lr=step_lr(
                record.learning_rate,
                [group["lr"] for group in self.optimizer.param_groups],
                self.step_lrs,
            ),
            loss_scale=record.loss_scale,
            num_zeros=record.num_zeros,
            max_attention_logit=(
                record.max_attention_logit
                if self.args.log_max_attention_logit or self.args.signals_attention_logit
                else None
            ),
            skipped_iter=record.skipped_iter,
            nan_iter=any(not math.isfinite(v) for v in losses.values()),
            log_z=losses.get("log z"),
            update_skipped=record.update_skipped,
            recovery=record.recovery or {},
            **slow,
        )
        self.writer.write(record.signals)
        self.step_lrs = None

    def _check(self, iteration: int, sum_sq: float, grad_norm: float, what: str) -> None:
        expected = grad_norm * grad_norm
        if abs(sum_sq - expected) > NORM_CHECK_RTOL * max(expected, 1e-30):
            print(
                f"megatron-ext WARNING: iteration {iteration}: sum of {what} grad norms^2 "
                f"{sum_sq:.9g} != grad-norm^2 {expected:.9g} (rtol {NORM_CHECK_RTOL}); "
                f"{what} norms do not cover what Megatron's grad norm covers",
                flush=True,
            )

    def _log_norms(self, iteration: int, what: str, *kinds: tuple[str, dict[str, float]]) -> None:
        """Norms under their TensorBoard prefixes; the console line shows the first (grad)."""
        scalars = {prefix + n: v for prefix, norms in kinds for n, v in norms.items()}
        shown = " | ".join(f"{n}: {v:.4g}" for n, v in kinds[0][1].items())
        self._log(iteration, scalars, f"{what} grad norms | {shown}")

    def _log_stragglers(self, iteration: int, step: StepValues) -> dict[str, Any]:
        """The slowest rank to TensorBoard and the console, a straggler announced when named
        or cleared; returns the signals fields."""
        if self.stragglers is None:
            return {}
        out = self.stragglers.observe(iteration, step.slowest)
        if out.news is not None:
            print(f"megatron-ext stragglers: {out.news}", flush=True)
        self._log(iteration, out.scalars, out.line)
        return out.fields

    def _log_sources(
        self, iteration: int, losses: dict[str, float], tokens: dict[str, int]
    ) -> None:
        scalars = {f"lm-loss-by-dataset/{n}": v for n, v in losses.items()}
        scalars |= {f"tokens-by-dataset/{n}": float(v) for n, v in tokens.items()}
        self._log(iteration, scalars, f"lm loss by dataset | {format_sources(losses, tokens)}")

    def _log(self, iteration: int, scalars: dict[str, float], line: str) -> None:
        """Scalars to TensorBoard and W&B, and ``line`` to the console at --log-interval."""
        if not scalars:
            return
        write_scalars(scalars, iteration)
        if iteration % self.args.log_interval == 0:
            print(f" iteration {iteration:8d} | {line}", flush=True)
