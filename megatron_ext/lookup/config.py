"""The run's data and batch configuration: from a checkpoint's saved args, or Megatron flags.

Megatron saves its whole ``args`` namespace in every checkpoint, so a checkpoint is the most
faithful record of how the run read data. Flags are parsed by Megatron's own argument parser,
on top of the checkpoint's args when both are given (explicit flags win), so every flag means
exactly what it meant to the training job. What the lookup needs is then distilled into a
:class:`RunConfig`; modes whose sample order this tool cannot reproduce are refused here.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.common.checkpoint_state import CheckpointUnreadable, load_common_state
from megatron_ext.common.files import (
    CHECKPOINT_COMMON_FILE,
    CHECKPOINT_METADATA_FILE,
    TrackerError,
    read_checkpoint_tracker,
)
from megatron_ext.lookup import flagspec
from megatron_ext.lookup.caches import DataSpec
from megatron_ext.lookup.errors import ConfigError
from megatron_ext.lookup.formats import blend_and_blend_per_split
from megatron_ext.lookup.position import (
    Anchor,
    Schedule,
    parse_step_schedule,
    rampup_schedule,
    rampup_train_iters,
)
from megatron_ext.lookup.topology import Topology

# Megatron-LM's validate_args default when --data-path is given without --split.
LEGACY_SPLIT = "969, 30, 1"

UNSUPPORTED = {
    "mock_data": "--mock-data (there is no data to look up)",
    "sft": "--sft (SFT packs conversations; its sample order is not GPTDataset's)",
    "fim_data": "--fim-data",
    "hybrid_context_parallel": "--hybrid-context-parallel (its sampler reorders micro-batches)",
    "perform_rl_step": "RL training (data comes from rollouts)",
}


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint says about its run."""

    directory: Path
    iteration: int
    args: argparse.Namespace


def load_checkpoint(path: str | Path, step: int | None = None) -> Checkpoint:
    """Read the saved args of a torch_dist checkpoint (a --save dir or one ``iter_*`` dir).

    Read by :mod:`megatron_ext.common.checkpoint_state` (no Megatron import); a layout it does not
    know is read by Megatron's ``load_common_state_dict``.
    """
    root = Path(path)
    try:
        tracked = None if step is not None else read_checkpoint_tracker(root)
    except TrackerError as exc:
        raise ConfigError(f"{exc}; or choose a checkpoint with --ckpt-step") from None
    if step is not None:
        directory = root / f"iter_{step:07d}"
    elif tracked is not None:
        directory = root / f"iter_{tracked:07d}"
    else:
        directory = root
    if not any(
        (directory / f).is_file() for f in (CHECKPOINT_METADATA_FILE, CHECKPOINT_COMMON_FILE)
    ):
        raise ConfigError(
            f"{directory} is not a torch_dist checkpoint (no {CHECKPOINT_METADATA_FILE}); pass "
            "the --save directory or an iter_NNNNNNN directory, and --ckpt-step to choose one"
        )
    try:
        state = load_common_state(directory)
    except CheckpointUnreadable as exc:
        raise ConfigError(f"{exc}; or read another one with --ckpt-step") from None
    return Checkpoint(directory, int(state.get("iteration", 0)), state["args"])


def megatron_namespace(argv: list[str], base: argparse.Namespace | None) -> argparse.Namespace:
    """Parse Megatron flags with Megatron's parser; values already in ``base`` are defaults.

    argparse only fills defaults for attributes the namespace lacks, so checkpoint values stay
    unless a flag overrides them, and flags absent from the checkpoint get Megatron's defaults.
    The parser is Megatron's own, rebuilt from its generated spec (:mod:`.flagspec`).
    """
    namespace = copy.deepcopy(base) if base is not None else argparse.Namespace()
    parsed, unknown = flagspec.parse(argv, namespace)
    if unknown:
        raise ConfigError(f"unknown flags (neither lookup nor Megatron flags): {' '.join(unknown)}")
    if isinstance(parsed.phase_transition_iterations, str):  # as validate_args does
        parsed.phase_transition_iterations = sorted(
            int(x.strip()) for x in parsed.phase_transition_iterations.split(",")
        )
    if parsed.data_path is not None and parsed.split is None:
        parsed.split = LEGACY_SPLIT
    return parsed


def _blend(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...] | None, bool]:
    """(prefixes, weights, per-split) of the train split, by Megatron's blend rules."""
    blend, per_split = blend_and_blend_per_split(args)
    if blend is None and per_split is not None:
        blend = per_split[0]
        if blend is None:
            raise ConfigError("the run has per-split data paths but no train split blend")
        split_mode = True
    else:
        split_mode = False
    if blend is None:
        raise ConfigError("no training data: pass --data-path/--train-data-path or a checkpoint")
    prefixes, weights = blend
    if any(p.startswith(("s3://", "msc://")) for p in prefixes):
        raise ConfigError("object-storage datasets (s3://, msc://) are not supported")
    return tuple(prefixes), None if weights is None else tuple(weights), split_mode


@dataclass(frozen=True)
class RunConfig:
    """Everything the lookup needs to know about one run."""

    args: argparse.Namespace  # Megatron's namespace (for the tokenizer and cache rebuilds)
    schedule: Schedule
    topology: Topology
    dataloader_type: str  # "single" or "cyclic"
    data_sharding: bool
    data_phase: int | None  # the phase whose data the args describe; None: as asked (flags)
    notes: tuple[str, ...]  # things the engineer should know (deprecated flags etc.)
    add_extra_token: bool = True

    def train_target(self, phase: int) -> int:
        """Train split size Megatron requested for ``phase`` (get_train_valid_test_num_samples)."""
        args = self.args
        if self.schedule.phase_transitions:
            edges = [
                0,
                *(t * args.global_batch_size for t in self.schedule.phase_transitions),
                args.train_samples,
            ]
            return edges[phase + 1] - edges[phase]
        if args.train_samples:
            return int(args.train_samples)
        return int(args.train_iters) * int(args.global_batch_size)

    def data_spec(self, phase: int) -> DataSpec:
        """The train dataset of ``phase``, as the builder saw it."""
        prefixes, weights, per_split = _blend(self.args)
        return DataSpec(
            prefixes=prefixes,
            weights=weights,
            per_split=per_split,
            split=None if per_split else self.args.split,
            seed=int(self.args.seed),
            sequence_length=int(self.args.seq_length),
            target_samples=self.train_target(phase),
            surplus=float(self.args.mid_level_dataset_surplus),
            cache_dir=self.args.data_cache_path,
            add_extra_token=self.add_extra_token,
        )


def honours_rampup(args: argparse.Namespace, *, from_checkpoint: bool) -> bool:
    """Whether the megatron-core that trained the run honoured ``--rampup-batch-size``.

    megatron-core 0.17 ramps the batch up; 0.18 replaced it with ``--step-batch-size-schedule``
    and ignores it. A checkpoint's saved args are the namespace the training job's own parser
    built, and every parser from 0.18 on defines ``step_batch_size_schedule``: the attribute is
    in the saved args exactly when the run was trained on 0.18 or later (a record Megatron
    keeps in every checkpoint). Without a checkpoint (flags only), the installed
    megatron-core is taken to be the one that trained the run (a note says so).
    """
    if from_checkpoint:
        return "step_batch_size_schedule" not in vars(args)
    installed = flagspec.installed_version()
    return installed is not None and installed.startswith("0.17.")


def _train_iters(
    args: argparse.Namespace, step_schedule: tuple[tuple[int, int], ...], rampup: bool
) -> int:
    """Megatron's update_train_iters for sample-based runs (0.17's under a ramp-up). A
    checkpoint's args hold the train_iters Megatron derived; the rule gives the same."""
    if rampup:
        if not args.train_samples:
            raise ConfigError(
                "--rampup-batch-size with --train-iters: megatron-core 0.17 asserts 'expected "
                "no batch-size rampup for iteration-based training', so no such run exists"
            )
        unit = int(args.micro_batch_size) * int(args.data_parallel_size)
        return rampup_train_iters(
            args.rampup_batch_size, int(args.global_batch_size), int(args.train_samples), unit
        )
    if args.train_iters:
        return int(args.train_iters)
    if not args.train_samples:
        raise ConfigError("pass --train-iters or --train-samples (or use a checkpoint)")
    if not step_schedule:
        return int(args.train_samples) // int(args.global_batch_size)
    iterations = consumed = 0
    while consumed < args.train_samples:
        consumed += [s for t, s in step_schedule if t <= consumed][-1]
        iterations += 1
    return iterations


def run_config(
    args: argparse.Namespace,
    *,
    data_parallel_size: int | None,
    checkpoint: Checkpoint | None,
    data_from_checkpoint: bool = True,
    add_extra_token: bool = True,
    segment: bool = False,
    rampup_honoured: bool = False,
) -> RunConfig:
    """Distil Megatron's namespace into a RunConfig, refusing what cannot be answered exactly.

    ``data_from_checkpoint``: the data paths are the checkpoint's (not overridden by flags), so
    they describe the phase the checkpoint was saved in. ``segment``: ``checkpoint`` is the
    start of one attempt of the layout history (no notes about the anchor).
    ``rampup_honoured``: the run was trained by a megatron-core that ramps the batch up
    (0.17; :func:`honours_rampup`).
    """
    used = [text for attr, text in UNSUPPORTED.items() if getattr(args, attr, None)]
    if used:
        raise ConfigError(f"unsupported for lookup: {'; '.join(used)}")
    if getattr(args, "gtp_weight_remat_size", 1) not in (None, 1):
        raise ConfigError("--tensor-parallel-num-weight-shards changes the data axis; unsupported")
    dataloader = args.dataloader_type or "single"
    if dataloader not in ("single", "cyclic"):
        raise ConfigError(f"--dataloader-type {dataloader}: the sample order is the user's code")
    if args.seq_length is None or args.micro_batch_size is None:
        raise ConfigError("pass --seq-length and --micro-batch-size (or --from-checkpoint)")
    dp = data_parallel_size or getattr(args, "data_parallel_size", None)
    if not dp:
        raise ConfigError("pass --data-parallel-size (world size / (TP x PP x CP))")
    args = copy.copy(args)
    args.data_parallel_size = dp
    notes = []
    rampup = bool(getattr(args, "rampup_batch_size", None)) and rampup_honoured
    if getattr(args, "rampup_batch_size", None) and not rampup:
        notes.append(
            f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))} is deprecated and "
            "ignored from megatron-core 0.18 on, which trained this run: it used a constant "
            "global batch (--step-batch-size-schedule is the ramp-up that takes effect)"
        )
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    step_schedule: tuple[tuple[int, int], ...] = ()
    if getattr(args, "step_batch_size_schedule", None):
        step_schedule = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
    elif rampup:
        step_schedule = rampup_schedule(
            args.rampup_batch_size,
            int(args.global_batch_size),
            int(args.micro_batch_size) * int(dp),
            bool(args.decrease_batch_size_if_needed),
        )
        notes.append(
            f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: the run was "
            "trained by megatron-core 0.17, which ramps the global batch up (batch sizes "
            + ", ".join(f"{size} from {at} samples" for at, size in step_schedule)
            + ")"
        )
    transitions = tuple(args.phase_transition_iterations or ())
    if transitions and not args.train_samples:
        raise ConfigError(
            "--phase-transition-iterations without --train-samples: megatron-core 0.19.2 cannot "
            "size the phases (it compares against train_samples=None), so no such run exists"
        )
    anchor = (
        None
        if checkpoint is None
        else Anchor(checkpoint.iteration, int(args.consumed_train_samples))
    )
    schedule = Schedule(
        micro_batch_size=int(args.micro_batch_size),
        data_parallel_size=int(dp),
        global_batch_size=int(args.global_batch_size),
        train_iters=_train_iters(args, step_schedule, rampup),
        step_schedule=step_schedule,
        decrease_batch_size_if_needed=bool(args.decrease_batch_size_if_needed),
        phase_transitions=transitions,
        iterations_to_skip=frozenset(int(i) for i in (args.iterations_to_skip or ())),
        anchor=anchor,
    )
    args.train_iters = schedule.train_iters  # as Megatron's update_train_iters leaves it
    if anchor is not None and not schedule.history_known and not segment:
        notes.append(
            f"checkpoint iteration {anchor.iteration} has consumed_train_samples="
            f"{anchor.consumed_samples}, which this batch schedule does not reproduce: only "
            "iterations after it can be answered"
        )
    skipped = getattr(args, "skipped_train_samples", None)
    if checkpoint is not None and skipped is not None and schedule.history_known:
        done = [i for i in schedule.iterations_to_skip if i <= checkpoint.iteration]
        listed = sum(schedule.batch(i).size for i in done)
        if schedule.decrease_batch_size_if_needed and rampup:
            listed = skipped  # 0.17 counts each ramp-up size's rounding: not re-derived here
        elif schedule.decrease_batch_size_if_needed and not step_schedule:
            # Megatron also counts the rounded-off samples of every trained iteration.
            rounded = schedule.global_batch_size - schedule.batch(1).size
            listed += rounded * (checkpoint.iteration - len(done))
        if skipped != listed:
            notes.append(
                f"the checkpoint counts {skipped} skipped samples but its --iterations-to-skip "
                f"account for {listed}: earlier jobs skipped other iterations, so 'skipped' "
                "flags before this job may be incomplete"
            )
    topology = Topology(
        data_parallel=int(dp),
        tensor_parallel=int(args.tensor_model_parallel_size),
        pipeline_parallel=int(args.pipeline_model_parallel_size),
        context_parallel=int(args.context_parallel_size),
        tp_pp_dp_mapping=bool(getattr(args, "use_tp_pp_dp_mapping", False)),
    )
    phase = None
    if checkpoint is not None and data_from_checkpoint:
        phase = schedule.phase_of(max(checkpoint.iteration, 1))
    return RunConfig(
        args,
        schedule,
        topology,
        dataloader,
        bool(args.data_sharding),
        phase,
        tuple(notes),
        add_extra_token,
    )


def eval_sizes(args: argparse.Namespace) -> tuple[int | None, int]:
    """Validation and test sizes as ``get_train_valid_test_num_samples`` (for rebuilds).

    They only decide which valid/test caches a rebuild writes next to the train ones; the train
    caches the lookup reads do not depend on them.
    """
    eval_batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    test = args.eval_iters * eval_batch
    if args.full_validation:
        return None, test
    if not args.eval_interval:
        return 0, test
    points = args.train_iters // args.eval_interval + 1
    if getattr(args, "start_eval_at_iter", None) is not None:  # 0.18 on
        points = max(0, points - args.start_eval_at_iter // args.eval_interval)
    return points * args.eval_iters * eval_batch, test
