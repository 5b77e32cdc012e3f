"""The setting of a real run, rebuilt at any scale on one machine (``benchmarks/scale.py``).

At scale 1: a 3-dataset blend of ~30 B tokens in 50 M documents with long-tailed
(log-normal) lengths, seq 4096, global batch 1024, 102.4 M train samples (100 k iterations),
checkpoint args at DP=64, a 1 M-iteration signals log with a spike at its end and the spike
ledger the real detector writes for it, and a DP=64 sample log. Every count scales linearly
with ``scale``; seq, global batch and DP do not.

What is real: the ``.idx`` files (megatron-core's on-disk format, opened by its
``IndexedDataset``, with the fingerprint trailer ``megatron-ext preprocess`` appends), the
index caches (built later by Megatron itself, at the first training start-up), the saved args
(a ``common.pt`` holding the namespace Megatron's own parser produces), the signals records
(``SignalRecord``), the ledger lines (the real ``SpikeDetector`` fed the records around the
spike) and the sample records (``SampleRecord``, sample ids as Megatron's sampler hands them
out, token SHA-1s of what the data holds). What is not: the ``.bin`` files are sparse files of
the right size (all tokens 0), so 60 GB of corpus costs no disk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WEIGHTS = (0.5, 0.3, 0.2)
SEQ_LENGTH = 4096
GLOBAL_BATCH = 1024
DP = 64
MICRO_BATCH = 4  # per DP rank: 1024 / 64 = 16 samples, 4 micro-batches per iteration
CKPT_INTERVAL = 1000  # iterations between the planner's checkpoints
FULL = {
    "documents": 50_000_000,
    "tokens": 30_000_000_000,
    "train_samples": 102_400_000,
    "signals_iterations": 1_000_000,
    "sample_log_iterations": 100_000,
}
_IDX_HEADER = b"MMIDIDX\x00\x00"
_UINT16_CODE = 8  # megatron.core.datasets.indexed_dataset.DType.uint16
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Setting:
    """The sizes at one scale and where the files of that scale live."""

    root: Path
    scale: float

    def count(self, name: str, floor: int = 1) -> int:
        return max(floor, round(FULL[name] * self.scale))

    @property
    def prefixes(self) -> list[str]:
        return [str(self.root / "data" / f"part{k}_text_document") for k in range(len(WEIGHTS))]

    @property
    def train_iters(self) -> int:
        return max(2, self.count("train_samples") // GLOBAL_BATCH)

    @property
    def signals_iterations(self) -> int:
        return self.count("signals_iterations", floor=1000)

    @property
    def sample_log_iterations(self) -> int:
        return min(self.count("sample_log_iterations", floor=4), self.train_iters)

    def blend(self) -> list[str]:
        """``--data-path`` as weight/prefix pairs."""
        return [str(x) for w, p in zip(WEIGHTS, self.prefixes) for x in (w, p)]


def write_idx(path: Path, lengths: np.ndarray) -> None:
    """megatron-core's ``.idx`` (one sequence per document, uint16 tokens), written in chunks
    so 50 M documents need no Python loop (megatron-core's writer builds the pointers in one)."""
    count = len(lengths)
    with open(path, "wb") as out:
        out.write(_IDX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", _UINT16_CODE))
        out.write(struct.pack("<Q", count) + struct.pack("<Q", count + 1))
        out.write(lengths.astype(np.int32).tobytes())
        start = 0
        for first in range(0, count, _CHUNK):
            part = lengths[first : first + _CHUNK].astype(np.int64) * 2
            pointers = np.cumsum(part) - part + start
            out.write(pointers.tobytes())
            start = int(pointers[-1] + part[-1])
        for first in range(0, count + 1, _CHUNK):
            out.write(np.arange(first, min(first + _CHUNK, count + 1), dtype=np.int64).tobytes())


def long_tailed_lengths(documents: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Log-normal document lengths (sigma 1.5: a few documents of 10^5 tokens among many
    short ones), scaled to sum to about ``tokens``."""
    sigma = 1.5
    mu = math.log(tokens / documents) - sigma**2 / 2
    raw = rng.lognormal(mu, sigma, documents)
    lengths = np.maximum(1, np.rint(raw * (tokens / raw.sum()))).astype(np.int32)
    del raw
    return np.minimum(lengths, 1 << 24)


def build_corpus(setting: Setting, seed: int = 1234) -> dict[str, int]:
    """Real ``.idx`` files with their fingerprint, sparse ``.bin`` files; returns the sizes."""
    from megatron_ext.common.records.pair import append_fingerprint

    rng = np.random.default_rng(seed)
    (setting.root / "data").mkdir(parents=True, exist_ok=True)
    documents = tokens = 0
    for weight, prefix in zip(WEIGHTS, setting.prefixes):
        lengths = long_tailed_lengths(
            round(setting.count("documents") * weight),
            round(setting.count("tokens") * weight),
            rng,
        )
        write_idx(Path(prefix + ".idx"), lengths)
        with open(prefix + ".bin", "wb") as out:
            out.truncate(int(lengths.sum(dtype=np.int64)) * 2)  # sparse: no block written
        append_fingerprint(prefix + ".idx", prefix + ".bin")
        documents += len(lengths)
        tokens += int(lengths.sum(dtype=np.int64))
    return {"documents": documents, "tokens": tokens}


def training_flags(setting: Setting, tokenizer_args: list[str]) -> list[str]:
    """The Megatron data and schedule flags of the run (model flags are the caller's)."""
    return [
        "--data-path",
        *setting.blend(),
        "--split",
        "100,0,0",
        *tokenizer_args,
        "--data-cache-path",
        str(setting.root / "cache"),
        "--seq-length",
        str(SEQ_LENGTH),
        "--max-position-embeddings",
        str(SEQ_LENGTH),
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--train-iters",
        str(setting.train_iters),
        "--eval-iters",
        "0",
        "--eval-interval",
        str(setting.train_iters),
    ]


def write_checkpoint_args(directory: Path, iteration: int, flags: list[str]) -> Any:
    """``iter_NNNNNNN/common.pt`` with the namespace Megatron's parser makes of ``flags``
    (``--data-parallel-size`` included) and the tracker naming it, as a torch_dist save has."""
    import torch

    from megatron_ext.lookup.config import megatron_namespace

    parsed = vars(megatron_namespace(flags, None))
    # Defaults the lookup's parser cannot name (stand-ins for Megatron objects) pickle as None.
    args = argparse.Namespace(
        **{
            k: None if type(v).__module__.startswith("megatron_ext") else v
            for k, v in parsed.items()
        }
    )
    args.data_parallel_size = DP
    args.world_size = DP
    args.iteration = iteration
    args.consumed_train_samples = iteration * GLOBAL_BATCH
    target = directory / f"iter_{iteration:07d}"
    target.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args, "iteration": iteration}, target / "common.pt")
    (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return args


def checkpoint_interval(last: int) -> int:
    """Iterations between the planner's checkpoints in a log of ``last`` iterations."""
    return CKPT_INTERVAL if last >= 10 * CKPT_INTERVAL else 100


def planner_checkpoints(directory: Path, template: Path, last: int) -> int:
    """Every ``CKPT_INTERVAL``-th iteration up to ``last`` (every 100th in logs under 10 k
    iterations) as a checkpoint directory, each
    ``common.pt`` a hard link to ``template`` (the planner reads directory names, and the
    saved args of the newest only) and the rest of a loadable torch_dist checkpoint linked in
    (the planner verifies the rollback target it chooses)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.checkpoints import write_loadable_checkpoint

    interval = checkpoint_interval(last)
    count = 0
    for iteration in range(interval, last + 1, interval):
        target = directory / f"iter_{iteration:07d}"
        target.mkdir(parents=True, exist_ok=True)
        if not (target / "common.pt").exists():
            os.link(template, target / "common.pt")
            write_loadable_checkpoint(target, link=True)
        count += 1
    (directory / "latest_checkpointed_iteration.txt").write_text(str(last // interval * interval))
    return count


def build_signals(setting: Setting) -> tuple[int, int]:
    """``signals/signals.jsonl`` (a slowly falling loss with noise, a sustained spike over
    the last 80 iterations), each line what a default run writes (``tests/support/
    default_run.py``: a real record of ``megatron-ext demo``, per-source fields included), and
    ``signals/spikes.jsonl`` written by the real detector fed the records around the spike;
    returns (iterations, onset)."""
    from megatron_ext.common.files import SIGNALS_FILE, SPIKE_LEDGER_FILE
    from megatron_ext.common.records.ledger import config_record
    from megatron_ext.common.records.spike_config import SpikeConfig
    from megatron_ext.spikes.detector import SpikeDetector
    from tests.support.default_run import lines, record

    directory = setting.root / "signals"
    directory.mkdir(parents=True, exist_ok=True)
    last = setting.signals_iterations
    onset = last - 80
    rng = np.random.default_rng(7)
    noise = rng.normal(0.0, 0.01, last + 1)
    config = SpikeConfig()
    window: list[dict] = []

    def moving() -> Any:
        for iteration in range(1, last + 1):
            loss = 2.0 + 8.0 / math.sqrt(iteration) + float(noise[iteration])
            loss *= 1.6 if iteration >= onset else 1.0
            values = {
                "iteration": iteration,
                "attempt": 1,
                "wall_time": 1.7e9 + iteration * 4.0,
                "consumed_samples": iteration * GLOBAL_BATCH,
                "lm_loss": loss,
                "max_local_loss": loss * 1.05,
                "grad_norm": 0.3,
                "params_norm": 400.0 + iteration * 1e-4,
                "lr": 3e-4,
                "source_loss": loss,
            }
            if iteration > onset - config.warmup - config.window - 20:
                window.append(values)
            yield values

    with open(directory / SIGNALS_FILE, "w") as out:
        out.writelines(lines(moving()))
    detector = SpikeDetector(config)
    with open(directory / SPIKE_LEDGER_FILE, "w") as ledger:
        line = config_record(window[0]["iteration"], 1, config, str(setting.root / "ckpt"), None)
        ledger.write(json.dumps(line) + "\n")
        for values in window:
            for event in detector.observe(record(**values)):
                ledger.write(json.dumps(event.as_json()) + "\n")
    return last, onset


def build_sample_logs(setting: Setting, args: Any) -> int:
    """``samples/samples-dp{r}.jsonl`` for DP=64 over the first iterations, each record the
    global sample ids Megatron's sampler gives that rank's micro-batch (``(i-1)·1024 +
    m·4·64 + r·4 + k``) and the SHA-1 of its tokens (all 0: the sparse ``.bin``)."""
    from megatron_ext.common.io import token_sha1
    from megatron_ext.common.records.sample_log import append_layout, layout_record

    write_attempt_indexes(setting)

    directory = setting.root / "samples"
    directory.mkdir(parents=True, exist_ok=True)
    digest = token_sha1(np.zeros(SEQ_LENGTH, dtype=np.int64))
    digests = json.dumps([digest] * MICRO_BATCH)
    iterations = setting.sample_log_iterations
    for rank in range(DP):
        with open(directory / f"samples-dp{rank}.jsonl", "w") as out:
            for iteration in range(1, iterations + 1):
                for micro in range(GLOBAL_BATCH // DP // MICRO_BATCH):
                    first = (iteration - 1) * GLOBAL_BATCH + micro * MICRO_BATCH * DP
                    first += rank * MICRO_BATCH
                    losses = [2.5 + ((first + k) % 97) / 100 for k in range(MICRO_BATCH)]
                    out.write(
                        f'{{"iteration":{iteration},"dp_rank":{rank},"microbatch":{micro},'
                        f'"sample_ids":{list(range(first, first + MICRO_BATCH))},'
                        f'"token_sha1":{digests},"loss_sum":{sum(losses) * SEQ_LENGTH},'
                        f'"num_tokens":{SEQ_LENGTH * MICRO_BATCH},"sample_losses":{losses},'
                        f'"lm_loss_sum":{sum(losses) * SEQ_LENGTH}}}\n'
                    )
    start = argparse.Namespace(**{**vars(args), "iteration": 0, "consumed_train_samples": 0})
    append_layout(directory, layout_record(start, "scale-bench", 1.7e9))
    return iterations


def write_attempt_indexes(setting: Setting) -> None:
    """``samples/attempts-dp{r}.jsonl`` as the sample log's writer keeps it: one attempt, its
    records from byte 0 (without it, readers fall back to reading each file whole, as for a
    log written before the index existed)."""
    from megatron_ext.common.files import sample_log_attempts_file

    directory = setting.root / "samples"
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(DP):
        line = {"offset": 0, "first_iteration": 1, "job_id": "scale-bench", "host": "bench"}
        line |= {"pid": 0, "wall_time": 1.7e9}
        sample_log_attempts_file(directory, rank).write_text(json.dumps(line) + "\n")
