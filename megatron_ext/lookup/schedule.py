"""Iteration / micro-batch / DP rank <-> positions in the sampler's sample stream, and back:
Megatron's batch arithmetic (skips, step batch-size schedule, 0.17 ramp-up, phases, the
pretraining and cyclic samplers) vectorised for the inverse lookup; :class:`Topology` names the
global ranks that read a DP rank's data.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from megatron_ext.lookup.errors import ConfigError, PositionError


def parse_step_schedule(text: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """``--step-batch-size-schedule`` as (threshold in samples, global batch size) pairs, by
    Megatron's own parser (thresholds are tokens when ``seq_length`` is given, as in training)."""
    try:
        from megatron.core.num_microbatches_calculator import (
            StepBatchsizeNumMicroBatchesCalculator as calculator,
        )

        pairs = calculator._parse_schedule(text, seq_length)
        # Validation is an instance method; it reads only the parsed schedule.
        calculator._validate_schedule(type("Parsed", (), {"schedule": pairs})())  # type: ignore[arg-type]
    except (AssertionError, ValueError, ImportError) as exc:
        raise ConfigError(f"--step-batch-size-schedule {text!r}: {exc}") from None
    return tuple((int(t), int(s)) for t, s in pairs)


def _check_rampup(start: int, increment: int, samples: int, global_batch_size: int) -> None:
    if start <= 0 or increment <= 0 or samples < 0:
        raise ConfigError(f"--rampup-batch-size {start} {increment} {samples}: Megatron asserts")
    diff = global_batch_size - start
    if diff < 0 or diff % increment:
        raise ConfigError(
            f"--rampup-batch-size {start} {increment} {samples} with --global-batch-size "
            f"{global_batch_size}: the interval must be a non-negative multiple of the increment "
            "(Megatron asserts)"
        )
    if diff == 0 or samples == 0:
        raise ConfigError(
            "--rampup-batch-size with no increments or no ramp-up samples: megatron-core 0.17 "
            "divides by zero there, so no such run exists"
        )


def rampup_schedule(
    rampup: tuple[int, int, int], global_batch_size: int, unit: int, decrease: bool
) -> tuple[tuple[int, int], ...]:
    """megatron-core 0.17's ``--rampup-batch-size START INCREMENT SAMPLES`` as (threshold in
    samples, running global batch size) pairs: 0.17's ``RampupBatchsizeNumMicroBatchesCalculator
    .update`` in the same float arithmetic, rounded down to ``unit`` (mbs x DP) with
    ``--decrease-batch-size-if-needed``. Megatron's own assertions are refusals here."""
    start, increment, samples = (int(x) for x in rampup)
    diff = global_batch_size - start
    _check_rampup(start, increment, samples, global_batch_size)
    per_increment = samples / (diff // increment)

    def steps(consumed: int) -> int:
        return int(consumed / per_increment)

    def size(consumed: int) -> int:
        raw = global_batch_size if consumed > samples else start + steps(consumed) * increment
        return (raw // unit) * unit if decrease else raw

    edges = {0, samples + 1}
    for k in range(1, diff // increment + 1):
        first = min(math.ceil(k * per_increment), samples + 1)  # then exact, by Megatron's test
        while first > 0 and steps(first - 1) >= k:
            first -= 1
        while first <= samples and steps(first) < k:
            first += 1
        edges.add(first)
    table: list[tuple[int, int]] = []
    for edge in sorted(edges):
        if not table or size(edge) != table[-1][1]:
            table.append((edge, size(edge)))
    return tuple(table)


def rampup_train_iters(
    rampup: tuple[int, int, int], global_batch_size: int, train_samples: int, unit: int
) -> int:
    """megatron-core 0.17's ``update_train_iters`` under a ramp-up: iterations are counted
    with the *unrounded* size through the ramp-up (while consumed <= SAMPLES and <=
    train_samples), then ``(train_samples - consumed) // GBS`` more."""
    table = rampup_schedule(rampup, global_batch_size, unit, decrease=False)
    thresholds = [t for t, _ in table]
    iterations = consumed = 0
    while consumed <= int(rampup[2]) and consumed <= train_samples:
        consumed += table[bisect.bisect_right(thresholds, consumed) - 1][1]
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations


@dataclass(frozen=True)
class Anchor:
    """A checkpoint's iteration and ``consumed_train_samples``: a fact the schedule must meet."""

    iteration: int
    consumed_samples: int


@dataclass(frozen=True)
class Batch:
    """One iteration's global batch."""

    iteration: int
    phase: int  # index into the phases cut by --phase-transition-iterations (0 without)
    consumed_before: int  # consumed_train_samples before the iteration, whole run
    stream_start: int  # position of its first sample in this phase's sampler stream
    size: int  # samples the iteration consumes (trained or skipped)
    num_microbatches: int
    skipped: bool


@dataclass(frozen=True)
class _Segment:
    """Consecutive iterations with one batch size: ``count`` of them (None: unbounded)."""

    done: int  # iterations completed before the segment
    consumed: int  # stream position at its start
    size: int
    count: int | None


@dataclass(frozen=True)
class Schedule:
    """The batch schedule of one run, anchored on a checkpoint when one is known."""

    micro_batch_size: int
    data_parallel_size: int
    global_batch_size: int
    train_iters: int | None = None
    step_schedule: tuple[tuple[int, int], ...] = ()
    decrease_batch_size_if_needed: bool = False
    phase_transitions: tuple[int, ...] = ()
    iterations_to_skip: frozenset[int] = frozenset()
    anchor: Anchor | None = None
    # False when walking the schedule from iteration 0 does not reach the anchor's consumed
    # samples (batch size or DP changed at a resume): iterations before it are then unknown.
    history_known: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        if self.micro_batch_size <= 0 or self.data_parallel_size <= 0:
            raise ConfigError("micro batch size and data-parallel size must be positive")
        varying = self.step_schedule or self._constant_size() != self.global_batch_size
        if self.phase_transitions and varying:
            raise ConfigError(
                "--phase-transition-iterations with a varying or rounded-down batch size: "
                "Megatron starts each phase at (iteration - transition) x global_batch_size, "
                "which is not where that phase's sampler stood, so any answer would be a guess"
            )
        if list(self.phase_transitions) != sorted(set(self.phase_transitions)):
            raise ConfigError("phase transition iterations must be distinct and increasing")
        if self.anchor is not None and self.anchor.iteration > 0:
            walked = self._walk((0, 0), self.anchor.iteration)
            object.__setattr__(self, "history_known", walked == self.anchor.consumed_samples)

    @property
    def samples_per_microbatch_step(self) -> int:
        """Samples one micro-batch step takes from the stream across all DP ranks."""
        return self.micro_batch_size * self.data_parallel_size

    def _constant_size(self) -> int:
        unit = self.samples_per_microbatch_step
        if self.decrease_batch_size_if_needed:
            return (self.global_batch_size // unit) * unit
        return self.global_batch_size

    def _running_size(self, consumed: int) -> int:
        """The batch size Megatron's calculator gives after ``consumed`` samples."""
        if not self.step_schedule:
            size = self._constant_size()
        else:
            thresholds = [t for t, _ in self.step_schedule]
            size = self.step_schedule[bisect.bisect_right(thresholds, consumed) - 1][1]
        if size <= 0 or size % self.samples_per_microbatch_step:
            raise ConfigError(
                f"global batch size {size} is not a positive multiple of micro-batch "
                f"{self.micro_batch_size} x DP {self.data_parallel_size}; Megatron refuses it"
            )
        return size

    def _segment(self, done: int, consumed: int) -> _Segment:
        size = self._running_size(consumed)
        later = [t for t, _ in self.step_schedule if t > consumed]
        count = None if not later else -(-(later[0] - consumed) // size)
        return _Segment(done, consumed, size, count)

    def _walk(self, start: tuple[int, int], done_target: int) -> int:
        """Stream position after ``done_target`` iterations, walking from ``start`` (iterations
        done, samples consumed) one constant-batch segment at a time."""
        done, consumed = start
        while done < done_target:
            segment = self._segment(done, consumed)
            steps = done_target - done
            if segment.count is not None:
                steps = min(steps, segment.count)
            done, consumed = done + steps, consumed + steps * segment.size
        return consumed

    def _unknown_history(self, what: str) -> PositionError:
        assert self.anchor is not None
        walked = self._walk((0, 0), self.anchor.iteration)
        return PositionError(
            f"{what} precedes checkpoint iteration {self.anchor.iteration}, whose "
            f"consumed_train_samples={self.anchor.consumed_samples} is not what this batch "
            f"schedule gives ({walked}): the batch size or DP size changed at a resume, so the "
            "batches before it are unknown. Ask with an earlier checkpoint of that stretch."
        )

    def consumed_before(self, iteration: int) -> int:
        """``consumed_train_samples`` just before 1-indexed ``iteration``: walked from the
        anchor when at or after it, else from iteration 0."""
        anchor = self.anchor
        if anchor is not None and iteration > anchor.iteration:
            return self._walk((anchor.iteration, anchor.consumed_samples), iteration - 1)
        if anchor is not None and not self.history_known:
            raise self._unknown_history(f"iteration {iteration}")
        return self._walk((0, 0), iteration - 1)

    def phase_of(self, iteration: int) -> int:
        """Phase index: how many transitions come strictly before ``iteration``."""
        return bisect.bisect_left(self.phase_transitions, iteration)

    def phase_bounds(self, phase: int) -> tuple[int, int | None]:
        """(iterations before the phase, its last iteration or None when open-ended)."""
        edges = (0, *self.phase_transitions, self.train_iters)
        return edges[phase], edges[phase + 1]

    def batch(self, iteration: int) -> Batch:
        """The global batch of 1-indexed ``iteration``; refuses iterations the run never had."""
        if iteration < 1:
            raise PositionError(f"iterations are 1-indexed (as Megatron logs them): {iteration}")
        if self.train_iters is not None and iteration > self.train_iters:
            raise PositionError(f"iteration {iteration} is beyond --train-iters {self.train_iters}")
        consumed = self.consumed_before(iteration)
        size = self._running_size(consumed)
        phase = self.phase_of(iteration)
        start = consumed
        if self.phase_transitions:
            start = (iteration - 1 - self.phase_bounds(phase)[0]) * self.global_batch_size
        return Batch(
            iteration,
            phase,
            consumed,
            start,
            size,
            size // self.samples_per_microbatch_step,
            iteration in self.iterations_to_skip,
        )

    def batch_at_consumed(self, consumed: int) -> Batch:
        """The iteration Megatron runs next when ``consumed_train_samples == consumed``."""
        # (phase 0's stream is the whole run's under phase transitions: a constant batch)
        iterations, offsets = self._locate(np.array([consumed], dtype=np.int64), phase=0)
        iteration, inside = int(iterations[0]), int(offsets[0])
        batch = self.batch(iteration)
        if inside:
            raise PositionError(
                f"consumed samples {consumed} is inside iteration {iteration} ({inside} samples "
                "after its start); Megatron's consumed_train_samples is always a batch boundary"
            )
        return batch

    def positions(self, batch: Batch, microbatch: int, dp_rank: int) -> np.ndarray:
        """Sampler stream positions of one micro-batch of one DP rank."""
        if not 0 <= microbatch < batch.num_microbatches:
            raise PositionError(
                f"iteration {batch.iteration} has micro-batches 0..{batch.num_microbatches - 1}"
            )
        if not 0 <= dp_rank < self.data_parallel_size:
            raise PositionError(f"DP ranks are 0..{self.data_parallel_size - 1}: {dp_rank}")
        first = (
            batch.stream_start
            + microbatch * self.samples_per_microbatch_step
            + dp_rank * self.micro_batch_size
        )
        return np.arange(first, first + self.micro_batch_size, dtype=np.int64)

    def _locate(self, positions: np.ndarray, phase: int) -> tuple[np.ndarray, np.ndarray]:
        """(iteration, offset inside its batch) for stream positions of ``phase``."""
        before, last = self.phase_bounds(phase)
        if self.phase_transitions:
            size = self.global_batch_size
            return before + positions // size + 1, positions % size
        done = consumed = 0
        if self.anchor is not None and not self.history_known:  # walk from the anchor
            if positions.size and positions.min() < self.anchor.consumed_samples:
                raise self._unknown_history(f"sample position {int(positions.min())}")
            done, consumed = self.anchor.iteration, self.anchor.consumed_samples
        top = int(positions.max()) if positions.size else 0
        segments = []
        while consumed <= top and (last is None or done < last):
            segment = self._segment(done, consumed)
            segments.append(segment)
            if segment.count is None:
                break
            done, consumed = done + segment.count, consumed + segment.count * segment.size
        if not segments:  # everything lies past the last iteration
            past = np.full(positions.shape, (last or 0) + 1, dtype=np.int64)
            return past, np.zeros_like(positions)
        starts = np.array([s.consumed for s in segments], dtype=np.int64)
        which = np.searchsorted(starts, positions, side="right") - 1
        sizes = np.array([s.size for s in segments], dtype=np.int64)[which]
        done_before = np.array([s.done for s in segments], dtype=np.int64)[which]
        since = positions - starts[which]
        return done_before + since // sizes + 1, since % sizes

    def locate(
        self, positions: np.ndarray, phase: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(iteration, micro-batch, DP rank) of each stream position of ``phase``, vectorised."""
        iterations, inside = self._locate(np.asarray(positions, dtype=np.int64), phase)
        unit = self.samples_per_microbatch_step
        return iterations, inside // unit, (inside % unit) // self.micro_batch_size


@lru_cache(maxsize=4)
def _permutation(size: int, epoch: int) -> np.ndarray:
    import torch  # only cyclic runs need it; the single-dataloader lookup starts without torch

    generator = torch.Generator()
    generator.manual_seed(epoch)
    return torch.randperm(size, generator=generator).numpy()


@lru_cache(maxsize=4)
def _inverse(size: int, epoch: int) -> np.ndarray:
    inverse = np.empty(size, dtype=np.int64)
    inverse[_permutation(size, epoch)] = np.arange(size, dtype=np.int64)
    return inverse


class CyclicOrder:
    """Stream position <-> dataset index for ``MegatronPretrainingRandomSampler``."""

    def __init__(
        self,
        total_samples: int,
        micro_batch_size: int,
        data_parallel_size: int,
        data_sharding: bool,
    ) -> None:
        self.mbs, self.dp, self.sharding = micro_batch_size, data_parallel_size, data_sharding
        unit = micro_batch_size * data_parallel_size
        self.active = total_samples - total_samples % unit
        self.bucket = (total_samples // unit) * micro_batch_size  # per rank, with sharding
        self.permuted = self.bucket if data_sharding else self.active  # the permutation's size
        if self.active == 0:
            raise ConfigError(f"the dataset ({total_samples} samples) is smaller than mbs x DP")
        full = (total_samples // micro_batch_size) * micro_batch_size
        if not data_sharding and full != self.active:
            raise ConfigError(
                "--dataloader-type cyclic --no-data-sharding with a dataset size "
                f"({total_samples}) whose remainder modulo mbs x DP is at least mbs: Megatron's "
                "ranks disagree on the epoch length, so no exact answer exists"
            )

    def dataset_indices(self, positions: np.ndarray) -> np.ndarray:
        """Dataset index of each stream position (``consumed + r*mbs + t`` of a micro-batch)."""
        positions = np.asarray(positions, dtype=np.int64)
        unit = self.mbs * self.dp
        epoch, within = np.divmod(positions, self.active)
        start, rest = within - within % unit, within % unit
        rank, slot = rest // self.mbs, rest % self.mbs
        out = np.empty_like(positions)
        for e in np.unique(epoch):
            here = epoch == e
            perm = _permutation(self.permuted, int(e))
            if self.sharding:
                out[here] = rank[here] * self.bucket + perm[start[here] // self.dp + slot[here]]
            else:
                out[here] = perm[start[here] + rank[here] + self.dp * slot[here]]
        return out

    def positions_of(self, indices: np.ndarray, epochs: int) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions at which ``indices`` are read in epochs ``0..epochs-1``."""
        indices = np.asarray(indices, dtype=np.int64)
        keep = np.flatnonzero(indices < self.active)
        found = [np.empty(0, dtype=np.int64)]
        for e in range(epochs):
            inverse = _inverse(self.permuted, e)
            if self.sharding:
                rank, q = np.divmod(indices[keep], self.bucket)
                q = inverse[q]
                within = (q - q % self.mbs) * self.dp + rank * self.mbs + q % self.mbs
            else:
                q = inverse[indices[keep]]
                unit = self.mbs * self.dp
                rest = q % unit
                within = q - rest + (rest % self.dp) * self.mbs + rest // self.dp
            found.append(e * self.active + within)
        return np.concatenate(found), np.tile(keep, epochs)


@dataclass(frozen=True)
class Topology:
    """Model-parallel layout of the run (sizes as in Megatron's args)."""

    data_parallel: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    tp_pp_dp_mapping: bool = False

    def rank(self, *, tp: int, cp: int, dp: int, pp: int) -> int:
        """Global rank of one coordinate, in Megatron's default rank order."""
        outer = ((dp, self.data_parallel), (pp, self.pipeline_parallel))  # tp-cp-dp-pp
        rank, stride = 0, 1
        for coord, size in (
            (tp, self.tensor_parallel),
            (cp, self.context_parallel),
            *(outer[::-1] if self.tp_pp_dp_mapping else outer),
        ):
            rank += coord * stride
            stride *= size
        return rank

    def readers(self, dp_rank: int) -> list[int]:
        """Global ranks that read DP rank ``dp_rank``'s micro-batches from the dataset."""
        if not 0 <= dp_rank < self.data_parallel:
            raise PositionError(f"DP ranks are 0..{self.data_parallel - 1}: {dp_rank}")
        stages = sorted({0, self.pipeline_parallel - 1})
        return sorted(
            self.rank(tp=0, cp=cp, dp=dp_rank, pp=pp)
            for pp in stages
            for cp in range(self.context_parallel)
        )

    def describe(self) -> str:
        """One line for humans: what TP/PP/CP mean for the samples shown."""
        parts = [f"DP={self.data_parallel}"]
        if self.tensor_parallel > 1:
            parts.append(f"TP={self.tensor_parallel} (TP rank 0 reads, peers get a broadcast)")
        if self.pipeline_parallel > 1:
            parts.append(f"PP={self.pipeline_parallel} (first and last stage read)")
        if self.context_parallel > 1:
            parts.append(
                f"CP={self.context_parallel} (every CP rank reads; rank c trains on sequence "
                f"chunks c and {2 * self.context_parallel - 1}-c of {2 * self.context_parallel})"
            )
        return ", ".join(parts)
