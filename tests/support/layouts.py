"""The layout matrix: every feature at once, at the parallel layouts users run (CPU harness).

Each layout starts from a single-rank **base** run of the same model (same data order:
``--train-iters`` is equal, so the sample index is the same): the base trains iterations
1..``FIRST`` and saves iteration ``FIRST - 1``. A layout's first launch loads that checkpoint's
weights only (``--no-load-optim --no-load-rng``: the optimizer starts fresh, so its first
step is Adam's first step) and trains ``FIRST``..: its iteration ``FIRST`` is a forward pass on
the same weights and data as the base's iteration ``FIRST``, and its checkpoint at ``FIRST``
holds exactly one update of the base weights. Later launches (drill restart, kill -9
resume) are plain resumes of the layout's own checkpoints.

Every layout run has z-loss, weight-decay multipliers, bucket norms, signals with the update
ratio and stragglers, the spike detector, the sample log, the drill (garbage tokens on the
last DP rank at ``BAD``) and one short evaluation after ``FIRST`` on a two-member validation
blend (per-dataset validation; training and the base read the one training source as
``--train-data-path``, so the first iteration still equals the base's): its first launch
ends with the detector's exit on every rank. A ``replay`` layout
also resumes a copy of its first launch's checkpoint of ``FIRST``, which must retrace the
first launch bit for bit (one launch where ``resume`` takes two). The layouts marked
``FUSED`` also run ``--fused-output-loss`` (the bases never do), so their first iteration is
the fused head against the unfused one, and the kill -9 resume is proven with it on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from megatron_ext.common.files import (
    CHECKPOINT_TRACKER_FILE,
    SIGNALS_FILE,
    SPIKE_LEDGER_FILE,
    checkpoint_dir,
)
from megatron_ext.demo import TINY_MODEL
from tests.support.harness import TELEMETRY, Run, launch, run_skiplist
from tests.support.sources import CODE, prepare_source

TRAIN_ITERS = 25
FIRST = 10  # the layouts' first iteration; the base saves FIRST - 1
# Checkpoints: FIRST (the one-update weight-decay check, the kill -9 point) and, for the drill
# restart, FIRST + 5 (the rollback target before the onset); a save costs seconds on CPU.
SAVE_INTERVAL, RESTART_SAVE_INTERVAL = FIRST, 5
BAD = (17, 21)  # drill: garbage tokens on the last DP rank, these iterations (inclusive)
# A low lr keeps the loss curve flat enough for a 5-iteration detector baseline to see the
# drill on one of four DP ranks (+2.5% lm loss); WD = 10 keeps the first step's decay term
# (lr * WD * mult * p) far above fp32 rounding in units of lr, for the exact-update check.
LR, WD, Z_LOSS = 1e-4, 10.0, 1e-4
EXIT_CODE_SPIKE = 42
T = TypeVar("T")
# Rollback to the newest checkpoint at least 2 iterations before the onset (15), skip 7
# batches after it (16-22): the window covers BAD.
DECAY = ["--embedding-weight-decay-mult", "0", "--weight-decay-override", "*.linear_fc2.weight=0.5"]
OUTPUT_LAYER_MULT = 0.25  # --output-layer-weight-decay-mult, untied models only
PLAN = ["--rollback-iters", "2", "--skip-batches", "7"]
# One short evaluation after FIRST (in the first launch, before the drill) on a validation
# blend of two members, the training source and a code source (tests/support/sources.py):
# per-dataset validation at every layout. Training reads the one source as before
# (--train-data-path, the base too: Megatron takes per-split paths or --data-path, not both).
EVAL_ITERS, EVAL_INTERVAL = 1, FIRST

UNTIE = "--untie-embeddings-and-output-weights"


def _fused_available() -> bool:
    from megatron_ext.registry import table as registry

    variant = registry.patch("fused-output-loss").variant_for()
    return variant is None or variant.available


FUSED = "--fused-output-loss"  # with a small chunk, so that every micro-batch has several
# --fused-output-loss is declared unavailable on megatron-core 0.17 (registry variant): the
# rows that use it run without it there.
FUSED_FLAGS = (FUSED, "--fused-output-loss-chunk-tokens", "48") if _fused_available() else ()
MODELS = {
    # 4 layers: two per stage at PP=2, one per virtual stage at PP=2 x VP=2.
    "dense": [*TINY_MODEL, "--num-layers", "4"],
    # Megatron's default: the output layer is the embedding (a copy on the last stage).
    "tied": [a for a in TINY_MODEL if a != UNTIE],
    "moe": [
        *TINY_MODEL,
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-aux-loss-coeff",
        "1e-2",
        # The alltoall dispatcher hands tensor split sizes to all_to_all_single, which gloo
        # rejects; allgather is the dispatcher that runs on CPU.
        "--moe-token-dispatcher-type",
        "allgather",
    ],
}
# Equal padded vocabularies at TP=1 and TP=2 (Megatron pads to 128 x TP by default, and the
# padded logits are part of the softmax, so TP=2 would be another model).
COMMON = ["--train-iters", str(TRAIN_ITERS), "--make-vocab-size-divisible-by", "64"]
# Stragglers: the default rule (1.5x the peers' median for 5 steps) with the margin of
# tests/e2e/test_stragglers.py, where a rank slowed by 3 s a step is named: on the shared
# 2-core runner a balanced rank alone is 2-7x its peer for several steps (up to ~1 s a step).
STRAGGLERS = ["--straggler-min-seconds", "1.5"]
DETECTOR = [
    "--spike-detect",
    "--spike-window",
    "5",
    "--spike-warmup",
    "5",
    # Garbage on one of four DP ranks lifts lm loss by ~2.5%: far below the 10% default.
    "--spike-loss-rel",
    "0.015",
    "--spike-mad-k",
    "3",
    "--spike-grad-factor",
    "1.5",
    "--spike-patience",
    "2",
]


@dataclass(frozen=True)
class Layout:
    """One parallel layout of the matrix."""

    name: str
    model: str  # key of MODELS
    nproc: int
    flags: tuple[str, ...]
    dp: int
    tp: int = 1
    pp: int = 1
    vp: int = 1
    bf16: bool = False
    restart: bool = False  # drill restart (plan, apply, relaunch past the spike)
    resume: bool = False  # kill -9 after the first checkpoint, resume, compare bit for bit
    # Resume a copy of the first launch's checkpoint of FIRST and compare bit for bit: the
    # exact-resume check at one launch (the first launch is its own killed run).
    replay: bool = False

    @property
    def tied(self) -> bool:
        return UNTIE not in MODELS[self.model]

    @property
    def num_layers(self) -> int:
        flags = MODELS[self.model]
        return int(flags[len(flags) - 1 - flags[::-1].index("--num-layers") + 1])

    def stage_layers(self) -> dict[int, list[int]]:
        """Global layers per pipeline stage, as Megatron places them (even split; with
        virtual stages, chunk c of stage s holds the (c * pp + s)-th slice)."""
        per_chunk = self.num_layers // (self.pp * self.vp)
        return {
            s: [(c * self.pp + s) * per_chunk + i for c in range(self.vp) for i in range(per_chunk)]
            for s in range(self.pp)
        }


LAYOUTS = (
    Layout(
        "pp2-tied", "tied", 2, ("--pipeline-model-parallel-size", "2"), dp=1, pp=2, restart=True
    ),
    Layout(
        "dp2-pp2-distopt-tied",
        "tied",
        4,
        ("--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", *FUSED_FLAGS),
        dp=2,
        pp=2,
        resume=True,
    ),
    Layout(
        "tp2-pp2",
        "dense",
        4,
        ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *FUSED_FLAGS),
        dp=1,
        tp=2,
        pp=2,
    ),
    Layout(
        "pp2-vp2",
        "dense",
        2,
        (
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            *FUSED_FLAGS,
        ),
        dp=1,
        pp=2,
        vp=2,
    ),
    Layout("moe-ep2-dp4", "moe", 4, ("--expert-model-parallel-size", "2"), dp=4),
    Layout(
        "bf16-distopt-overlap",
        "dense",
        2,
        ("--bf16", "--use-distributed-optimizer", "--overlap-param-gather", *FUSED_FLAGS),
        dp=2,
        bf16=True,
    ),
    # torch FSDP2 over a CPU device mesh (the runner's shim): bucket norms are fully_shard
    # units, params norm and update ratio add the DP shards, the checkpoint is torch_dist.
    Layout("fsdp2-dp2", "dense", 2, ("--use-torch-fsdp2", *FUSED_FLAGS), dp=2, replay=True),
)
BY_NAME = {layout.name: layout for layout in LAYOUTS}


# log Z (the z-loss kernel's) and the local attention's max logit: one value per global batch,
# so every layout must give the single-rank run's.
PRECURSOR_SIGNALS = ("--log-output-z", "--signals-attention-logit")


def per_split(data_args: list[str], valid: dict[str, float] | None = None) -> list[str]:
    """``data_args`` (``--data-path P --split S`` ...) as ``--train-data-path P``, with
    ``--valid-data-path`` the blend ``valid`` ({prefix: weight}) and an evaluation where given."""
    flags = list(data_args)
    at = flags.index("--data-path")
    flags[at] = "--train-data-path"
    del flags[flags.index("--split") : flags.index("--split") + 2]
    if valid:
        flags += ["--valid-data-path", *(x for p, w in valid.items() for x in (str(w), p))]
        flags += ["--eval-iters", str(EVAL_ITERS), "--eval-interval", str(EVAL_INTERVAL)]
    return flags


def base_args(work: Path, data_args: list[str]) -> list[str]:
    """Single rank, the tiny training recipe, z-loss and signals; saves FIRST - 1, exits after
    FIRST (whose losses are the reference)."""
    return [
        *data_args,
        *COMMON,
        "--z-loss-coeff",
        str(Z_LOSS),
        *PRECURSOR_SIGNALS,
        "--signals-dir",
        str(work / "signals"),
        "--save",
        str(work / "ckpt"),
        "--save-interval",
        str(FIRST - 1),
        "--exit-interval",
        str(FIRST),
    ]


def layout_args(layout: Layout, work: Path, data_args: list[str]) -> list[str]:
    """Every feature on; constant lr so that the first update is lr * (Adam step + decay)."""
    decay = [*DECAY]
    if not layout.tied:
        decay += ["--output-layer-weight-decay-mult", str(OUTPUT_LAYER_MULT)]
    ckpt = str(work / "ckpt")
    return [
        *data_args,
        *COMMON,
        *layout.flags,
        "--lr",
        str(LR),
        "--lr-decay-style",
        "constant",
        "--lr-warmup-iters",
        "0",
        "--weight-decay",
        str(WD),
        *decay,
        "--z-loss-coeff",
        str(Z_LOSS),
        *PRECURSOR_SIGNALS,
        *TELEMETRY,
        "--signals-dir",
        str(work / "signals"),
        *DETECTOR,
        *STRAGGLERS,
        "--drill-corrupt-batch",
        f"{BAD[0]}-{BAD[1]}:{layout.dp - 1}",
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--save-interval",
        str(RESTART_SAVE_INTERVAL if layout.restart else SAVE_INTERVAL),
    ]


def expected_mult(key: str) -> float:
    """The multiplier the flags above must give a checkpoint tensor (layers stacked)."""
    if "norm" in key:
        return 0.0  # 1-D: Megatron never decays them, whatever the flags
    if key.startswith("embedding."):
        return 0.0  # --embedding-weight-decay-mult 0
    if key == "output_layer.weight":
        return OUTPUT_LAYER_MULT  # only in untied checkpoints
    if key.endswith(".linear_fc2.weight"):
        return 0.5  # --weight-decay-override, expert copies included
    return 1.0


def model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors from a torch_dist checkpoint (reassembled without a process
    group by torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer.")
    }
    dcp.load(tensors, checkpoint_id=str(checkpoint), no_dist=True)
    return tensors


class Matrix:
    """Launches of the matrix, made on first use and kept for the session."""

    def __init__(self, root: Path, data_args: list[str], models: Iterable[str] = MODELS) -> None:
        """``models``: the bases the session's tests need (launched together at first use)."""
        self.root = root
        self.source_args = data_args
        self.data_args = per_split(data_args)  # the bases'
        self.models = [m for m in MODELS if m in set(models)]
        self._runs: dict[str, Any] = {}

    def _once(self, key: str, make: Callable[[], T]) -> T:
        if key not in self._runs:
            self._runs[key] = make()
        return self._runs[key]

    @property
    def validation_members(self) -> set[str]:
        """The validation blend's member names (the training source's and the code's)."""
        return {Path(self._source()).name, CODE}

    def _source(self) -> str:
        return self.source_args[self.source_args.index("--data-path") + 1]

    def layout_data(self) -> list[str]:
        """The layouts' data flags: the bases' training data, the validation blend (half the
        training source, half code) and its evaluation."""

        def make() -> list[str]:
            flags = self.source_args
            tokenizer = Path(flags[flags.index("--tokenizer-model") + 1])
            code = prepare_source(self.root / "code", CODE, tokenizer)
            return per_split(flags, {self._source(): 0.5, code: 0.5})

        return self._once("layout-data", make)

    def bases(self) -> dict[str, Run]:
        """The single-rank bases of ``models``, launched together (one rank each, on two
        cores)."""

        def run(model: str) -> Run:
            work = self.root / f"base-{model}"
            return launch(work, base_args(work, self.data_args), model=MODELS[model])

        def make() -> dict[str, Run]:
            with ThreadPoolExecutor(max(1, len(self.models))) as pool:
                return dict(zip(self.models, pool.map(run, self.models)))

        return self._once("bases", make)

    def base(self, layout: Layout) -> Run:
        bases = self.bases()
        if layout.model not in bases:  # a test outside the session's selection asked
            work = self.root / f"base-{layout.model}"
            bases[layout.model] = launch(
                work, base_args(work, self.data_args), model=MODELS[layout.model]
            )
        run = bases[layout.model]
        assert run.returncode == 0, run.log[-4000:]
        return run

    def _from_base(self, layout: Layout, name: str, kill_at_checkpoint: int | None = None) -> Run:
        """A first launch into ``name`` from the base's checkpoint (its weights only)."""
        work = self.root / name
        source = self.base(layout).workdir / "ckpt" / f"iter_{FIRST - 1:07d}"
        shutil.copytree(source, work / "ckpt" / source.name)
        (work / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(FIRST - 1))
        args = [*layout_args(layout, work, self.layout_data()), "--no-load-optim", "--no-load-rng"]
        return launch(
            work,
            args,
            nproc=layout.nproc,
            model=MODELS[layout.model],
            kill_at_checkpoint=kill_at_checkpoint,
        )

    def _again(self, layout: Layout, files: Path, name: str) -> Run:
        """A relaunch on the checkpoints and signals under ``files``; log, harness records
        and sample log of its own under ``name``."""
        args = layout_args(layout, files, self.layout_data())
        return launch(self.root / name, args, nproc=layout.nproc, model=MODELS[layout.model])

    def first(self, name: str) -> Run:
        """The layout's first launch: FIRST.. until the drill's spike exit."""
        return self._once(f"{name}/first", lambda: self._from_base(BY_NAME[name], name))

    def restart(self, name: str) -> tuple[subprocess.CompletedProcess[str], Run]:
        """Plan + apply on a copy of the first launch's checkpoints and signals (the first
        launch's files stay as it left them), then the relaunch past the spike."""

        def make() -> tuple[subprocess.CompletedProcess[str], Run]:
            first, work = self.first(name), self.root / f"{name}-restart"
            for part in ("ckpt", "signals"):
                shutil.copytree(first.workdir / part, work / part)
            plan = run_skiplist(work, *PLAN, "--apply")
            return plan, self._again(BY_NAME[name], work, work.name)

        return self._once(f"{name}/restart", make)

    def resume(self, name: str) -> tuple[Run, Run]:
        """K: the first launch again, SIGKILLed right after its checkpoint of FIRST; R: resumes
        K's checkpoint and signals, with its own sample log, up to the drill's exit."""

        def make() -> tuple[Run, Run]:
            layout = BY_NAME[name]
            killed = self._from_base(layout, f"{name}-K", kill_at_checkpoint=FIRST)
            return killed, self._again(layout, killed.workdir, f"{name}-R")

        return self._once(f"{name}/resume", make)

    def replay(self, name: str) -> Run:
        """A resume from a copy of the first launch's checkpoint of FIRST, with its signals and
        spike ledger as they stood at FIRST; its own sample log, up to the drill's exit."""

        def make() -> Run:
            first, work = self.first(name), self.root / f"{name}-replay"
            saved = checkpoint_dir(first.workdir / "ckpt", FIRST)
            shutil.copytree(saved, work / "ckpt" / saved.name)
            (work / "ckpt" / CHECKPOINT_TRACKER_FILE).write_text(str(FIRST))
            (work / "signals").mkdir()
            for file in (SIGNALS_FILE, SPIKE_LEDGER_FILE):
                lines = (first.workdir / "signals" / file).read_text().splitlines(keepends=True)
                kept = [line for line in lines if json.loads(line)["iteration"] <= FIRST]
                (work / "signals" / file).write_text("".join(kept))
            return self._again(BY_NAME[name], work, work.name)

        return self._once(f"{name}/replay", make)
