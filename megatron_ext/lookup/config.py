"""The run's configuration: a checkpoint's saved args and/or Megatron flags (Megatron's own
parser; explicit flags win) -> :class:`RunConfig`, the tokenizer (``--text``), and
``--rebuild-caches`` (Megatron's builder, the entry point's config). Modes whose sample order
cannot be reproduced are refused here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megatron_ext.common import versions
from megatron_ext.common.checkpoint_state import CheckpointUnreadable, load_common_state
from megatron_ext.common.files import (
    CHECKPOINT_COMMON_FILE,
    CHECKPOINT_METADATA_FILE,
    TrackerError,
    checkpoint_dir,
    read_checkpoint_tracker,
)
from megatron_ext.common.records.pair import PairError, check_pair
from megatron_ext.lookup.data import DataSpec, blend_and_blend_per_split, remap
from megatron_ext.lookup.errors import ConfigError, DataChanged
from megatron_ext.lookup.schedule import (
    Anchor,
    Schedule,
    Topology,
    parse_step_schedule,
    rampup_schedule,
    rampup_train_iters,
)

# Megatron-LM's validate_args default when --data-path is given without --split.
LEGACY_SPLIT = "969, 30, 1"

UNSUPPORTED = {
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
    """Read the saved args of a torch_dist checkpoint (a --save dir or one ``iter_*`` dir)."""
    root = Path(path)
    if root.is_file():
        raise ConfigError(
            f"{root} is a file, not a checkpoint; pass the --save directory or an iter_NNNNNNN "
            "directory, and --ckpt-step to choose one"
        )
    try:
        tracked = None if step is not None else read_checkpoint_tracker(root)
    except TrackerError as exc:
        raise ConfigError(f"{exc}; or choose a checkpoint with --ckpt-step") from None
    chosen = step if step is not None else tracked
    directory = root if chosen is None else checkpoint_dir(root, chosen)
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


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own training-flag parser (imports megatron.training: seconds)."""
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(
        argparse.ArgumentParser(prog="megatron flags", allow_abbrev=False)
    )


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """:func:`megatron_parser`, built once per process (building it reads Megatron's source
    for the help texts: a second per lookup)."""
    return megatron_parser()


def megatron_namespace(argv: list[str], base: argparse.Namespace | None) -> argparse.Namespace:
    """Parse Megatron flags with Megatron's parser; values already in ``base`` are defaults
    (argparse fills only missing attributes: checkpoint values stay unless a flag overrides)."""
    namespace = copy.deepcopy(base) if base is not None else argparse.Namespace()
    parsed, unknown = _parser().parse_known_args(argv, namespace=namespace)
    parsed = copy.deepcopy(parsed)  # no value shared with the cached parser's defaults
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
    split_mode = blend is None and per_split is not None
    if split_mode:
        blend = per_split[0]
        if blend is None:
            raise ConfigError("the run has per-split data paths but no train split blend")
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
    """Whether the megatron-core that trained the run honoured ``--rampup-batch-size``."""
    if from_checkpoint:
        return "step_batch_size_schedule" not in vars(args)
    installed = versions.installed()
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


def _refuse_unsupported(args: argparse.Namespace) -> str:
    """The dataloader type, after refusing the modes whose sample order is not reproducible."""
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
    return dataloader


def _step_schedule(
    args: argparse.Namespace, rampup: bool, notes: list[str]
) -> tuple[tuple[int, int], ...]:
    """The running batch sizes: --step-batch-size-schedule, or 0.17's ramp-up when honoured."""
    flag = getattr(args, "rampup_batch_size", None)
    if flag and not rampup:
        notes.append(
            f"--rampup-batch-size {' '.join(map(str, flag))} is deprecated and "
            "ignored from megatron-core 0.18 on, which trained this run: it used a constant "
            "global batch (--step-batch-size-schedule is the ramp-up that takes effect)"
        )
    if getattr(args, "step_batch_size_schedule", None):
        return parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
    if not rampup:
        return ()
    table = rampup_schedule(
        flag,
        int(args.global_batch_size),
        int(args.micro_batch_size) * int(args.data_parallel_size),
        bool(args.decrease_batch_size_if_needed),
    )
    notes.append(
        f"--rampup-batch-size {' '.join(map(str, flag))}: the run was "
        "trained by megatron-core 0.17, which ramps the global batch up (batch sizes "
        + ", ".join(f"{size} from {at} samples" for at, size in table)
        + ")"
    )
    return table


def _skip_note(
    schedule: Schedule, skipped: int, iteration: int, ramped: bool, stepped: bool
) -> str | None:
    """A note when the checkpoint's skipped-sample count is not what its skips account for."""
    done = [i for i in schedule.iterations_to_skip if i <= iteration]
    listed = sum(schedule.batch(i).size for i in done)
    if schedule.decrease_batch_size_if_needed and ramped:
        listed = skipped  # 0.17 counts each ramp-up size's rounding: not re-derived here
    elif schedule.decrease_batch_size_if_needed and not stepped:
        # Megatron also counts the rounded-off samples of every trained iteration.
        rounded = schedule.global_batch_size - schedule.batch(1).size
        listed += rounded * (iteration - len(done))
    if skipped == listed:
        return None
    return (
        f"the checkpoint counts {skipped} skipped samples but its --iterations-to-skip "
        f"account for {listed}: earlier jobs skipped other iterations, so 'skipped' "
        "flags before this job may be incomplete"
    )


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
    """Distil Megatron's namespace into a RunConfig, refusing what cannot be answered exactly."""
    dataloader = _refuse_unsupported(args)
    dp = data_parallel_size or getattr(args, "data_parallel_size", None)
    if not dp:
        raise ConfigError("pass --data-parallel-size (world size / (TP x PP x CP))")
    args = copy.copy(args)
    args.data_parallel_size = dp
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    notes: list[str] = []
    rampup = bool(getattr(args, "rampup_batch_size", None)) and rampup_honoured
    step_schedule = _step_schedule(args, rampup, notes)
    transitions = tuple(args.phase_transition_iterations or ())
    if transitions and not args.train_samples:
        raise ConfigError(
            "--phase-transition-iterations without --train-samples: megatron-core 0.19.2 cannot "
            "size the phases (it compares against train_samples=None), so no such run exists"
        )
    anchor = None
    if checkpoint is not None:
        anchor = Anchor(checkpoint.iteration, int(args.consumed_train_samples))
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
        note = _skip_note(schedule, skipped, checkpoint.iteration, rampup, bool(step_schedule))
        notes += [note] if note else []
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
    """Validation and test sizes as ``get_train_valid_test_num_samples`` (for rebuilds)."""
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


# (0.17 name, 0.18+ name) of the same tokenizer flag's dest.
RENAMED = (("tokenizer_special_tokens", "special_tokens"), ("tokenizer_metadata", "metadata_path"))
TOKENIZER_PATH_ARGS = ("tokenizer_model", "vocab_file", "merge_file")


def tokenizer_from_args(args: argparse.Namespace, data_root: Sequence[tuple[str, str]] = ()) -> Any:
    """The run's tokenizer, built by Megatron from the training flags; its files are read
    through ``--data-root`` (they move with the data), renamed fields carried over (RENAMED)."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    if args.tokenizer_type is None:
        raise ConfigError("no tokenizer in the run's args; pass --tokenizer-type/--tokenizer-model")
    args = copy.copy(args)
    args.rank = 0
    for old, new in RENAMED:
        value = getattr(args, old, None)
        value = value if value is not None else getattr(args, new, None)
        setattr(args, old, value)  # whichever name the installed build_tokenizer reads
        setattr(args, new, value)
    for name in TOKENIZER_PATH_ARGS:
        value = getattr(args, name, None)
        if not isinstance(value, str) or not os.path.isabs(value):
            continue  # unset, or a hub name such as "gpt2"
        moved = remap(value, data_root)
        if not os.path.exists(moved):
            hint = (
                f" (mapped from {value} by --data-root)"
                if moved != value
                else "; if it moved with the data, map the old location with --data-root OLD=NEW"
            )
            raise ConfigError(f"--text: the run's tokenizer file {moved} is not there{hint}")
        setattr(args, name, moved)
    try:
        return build_tokenizer(args)
    except Exception as exc:  # any failure of the tokenizer library: say which tokenizer
        raise ConfigError(
            f"--text: cannot build the run's tokenizer ({args.tokenizer_type} "
            f"{getattr(args, 'tokenizer_model', None)}): {type(exc).__name__}: {exc}"
        ) from None


def pad_token_id(tokenizer: Any, allow_ambiguous: bool) -> int:
    """The pad id GPTDataset uses (MegatronDataset.__init__): the tokenizer's, or -1 when it
    is missing or collides with another special token."""
    try:
        pad = tokenizer.pad
    except Exception:  # Megatron's own fallback is this broad: any failure means "no pad"
        return -1
    try:
        specials = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    except (AttributeError, IndexError, ValueError):
        specials = []
    if not specials:
        for name in ("eos", "eod"):
            with contextlib.suppress(AttributeError, NotImplementedError):
                specials.append(getattr(tokenizer, name))
    if pad in specials and not allow_ambiguous:
        return -1
    return pad


class _Progress(logging.Handler):
    """Advance a progress bar on Megatron's "Build and save"/"Load the" index messages."""

    def __init__(self, bar: tqdm) -> None:
        super().__init__(logging.INFO)
        self.bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for prefix in ("Build and save the ", "Load the "):
            if message.startswith(prefix) and "indices" in message:
                self.bar.set_postfix_str(message[len(prefix) :].replace(" indices", ""))
                self.bar.update(1)


def _expected_indices(args: Any) -> int:
    """How many GPT/Blended indices the builder will build or load, for the bar's total."""
    blend, per_split = blend_and_blend_per_split(args)
    blends = (
        [blend] * sum(1 for part in args.split.split(",") if float(part) > 0)
        if blend
        else [b for b in per_split if b is not None]
    )
    return sum(
        len(prefixes) + (len(prefixes) > 1 or weights is not None) for prefixes, weights in blends
    )


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """A one-process gloo group while none exists: megatron-core 0.17's BlendedDataset asks
    torch.distributed for the rank before building its indices (0.18 on check first), and a
    lookup is one process with no group."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(f"{directory}/store", 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _check_data(args: Any) -> None:
    """Every pair the builder will read passes the check training start-up runs: on a
    truncated ``.idx`` the builder dies in a numpy traceback, and on an edited one it builds
    caches that the lookup would then answer from."""
    blend, per_split = blend_and_blend_per_split(args)
    for found in (blend, *(per_split or ())):
        for prefix in found[0] if found else ():
            try:
                check_pair(prefix)
            except PairError as exc:
                raise DataChanged(f"{exc}; no cache was rebuilt") from None


def build_datasets(
    args: Any, dataset_class: Any, sizes: list[int | None], add_extra_token: bool, train_only: bool
) -> list[Any]:
    """Megatron's ``BlendedMegatronDatasetBuilder`` over the entry point's dataset config, in
    this one process as training built it (``train_only``: the train split alone)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    from megatron_ext.loop.gpt_step import gpt_dataset_config_from_args

    args = copy.copy(args)
    args.rank = 0
    # Both skip building (they assume caches exist); neither changes names or contents.
    args.dataloader_fast_cache_load = args.dataloader_defer_npy_index_mmap = False
    config = gpt_dataset_config_from_args(args)
    config.add_extra_token_to_sequence = add_extra_token
    if train_only:  # (mock data: megatron-core sets split 1,1,1)
        config.split_matrix = [config.split_matrix[0], None, None]
    with process_group():
        return BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()


def rebuild_caches(config: RunConfig, phase: int, cache_dir: str | None) -> None:
    """Build (or load, where present) every index cache of the run's datasets for ``phase``."""
    _check_data(config.args)
    from megatron.core.datasets.gpt_dataset import GPTDataset

    args = copy.copy(config.args)
    if cache_dir is not None:
        args.data_cache_path = cache_dir
    sizes = [config.train_target(phase), *eval_sizes(args)]
    logger = logging.getLogger("megatron.core.datasets")
    level, propagate = logger.level, logger.propagate
    with tqdm(total=_expected_indices(args), desc="rebuilding index caches", unit="index") as bar:
        handler = _Progress(bar)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # the bar reports progress; the log lines would drown it
        try:
            build_datasets(args, GPTDataset, sizes, config.add_extra_token, train_only=False)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
