"""Iteration / micro-batch / DP rank <-> positions in the sampler's sample stream, and back.

Pure Python + numpy (no Megatron import), so the arithmetic can be read, tested against the
Megatron objects it mirrors, and run where Megatron is not installed. It encodes what
megatron-core 0.19.2 does (``training/training.py`` ``train()``,
``core/num_microbatches_calculator.py``, ``training/datasets/data_samplers.py``):

- Iteration k (1-indexed, as logged) reads the running global batch that follows the
  ``consumed_train_samples`` of iterations 1..k-1; ``update_num_microbatches(consumed)`` picks
  that batch size just before the iteration.
- A skipped iteration (``--iterations-to-skip``) still pulls its micro-batches
  (``dummy_train_step``) and adds them to ``consumed_train_samples``, so skips never shift the
  batches of later iterations; they only mean a batch was not trained on.
- ``--rampup-batch-size`` is accepted but ignored from 0.18 on (deprecated; the calculator is
  constant unless ``--step-batch-size-schedule`` is given, whose thresholds Megatron reads as
  tokens and divides by ``--seq-length``). megatron-core 0.17 honours it and has no step
  schedule: its ``RampupBatchsizeNumMicroBatchesCalculator`` is a step function of the
  consumed samples too, so :func:`rampup_schedule` turns it into the same (threshold, size)
  table, sizes already rounded down as ``--decrease-batch-size-if-needed`` rounds them.
- ``--decrease-batch-size-if-needed`` makes an iteration consume GBS rounded down to a multiple
  of micro-batch x DP.
- ``--phase-transition-iterations t1,t2,..``: every phase trains on its own train dataset, whose
  sampler starts at ``(iteration - last transition) * global_batch_size``.
- ``MegatronPretrainingSampler`` hands micro-batch m of an iteration that starts at stream
  position C to DP rank r as positions ``C + m*mbs*DP + r*mbs + [0, mbs)``. For
  ``--dataloader-type single`` the position is the global sample index; ``cyclic`` maps it
  further (:mod:`megatron_ext.lookup.cyclic`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from megatron_ext.lookup.errors import ConfigError, PositionError

_SUFFIXES = {"K": 1_000, "M": 1_000_000, "B": 1_000_000_000, "T": 1_000_000_000_000}


def parse_step_schedule(text: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """``--step-batch-size-schedule`` as (threshold in samples, global batch size) pairs.

    Same parsing as Megatron's ``StepBatchsizeNumMicroBatchesCalculator._parse_schedule``;
    training always passes ``seq_length``, so thresholds are tokens there.
    """

    def number(value: str) -> int:
        value = value.strip().upper()
        scale = _SUFFIXES.get(value[-1:], 1)
        return int(float(value[:-1] if scale != 1 else value) * scale)

    pairs = []
    for entry in text.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ConfigError(f"step batch size schedule entry {entry!r} is not THRESHOLD:SIZE")
        threshold, size = (number(part) for part in entry.split(":", 1))
        pairs.append((threshold // seq_length if seq_length is not None else threshold, size))
    pairs.sort()
    if not pairs or pairs[0][0] != 0:
        raise ConfigError("the step batch size schedule must start at threshold 0")
    if any(a[0] >= b[0] for a, b in itertools.pairwise(pairs)) or any(s <= 0 for _, s in pairs):
        raise ConfigError("step batch size schedule thresholds must increase; sizes be > 0")
    return tuple(pairs)


def rampup_schedule(
    rampup: tuple[int, int, int], global_batch_size: int, unit: int, decrease: bool
) -> tuple[tuple[int, int], ...]:
    """megatron-core 0.17's ``--rampup-batch-size START INCREMENT SAMPLES`` as (threshold in
    samples, running global batch size) pairs.

    The size after ``c`` consumed samples is 0.17's ``RampupBatchsizeNumMicroBatchesCalculator.
    update``: ``GBS`` once ``c > SAMPLES``, else ``START + int(c / (SAMPLES / n)) * INCREMENT``
    with ``n = (GBS - START) / INCREMENT`` (the same float arithmetic, so the thresholds are
    Megatron's to the sample), rounded down to a multiple of ``unit`` (micro-batch x DP) with
    ``--decrease-batch-size-if-needed``. Megatron's own assertions are refusals here.
    """
    start, increment, samples = (int(x) for x in rampup)
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

    def _start(self, done_target: int) -> tuple[int, int]:
        """Where to walk from (iterations done, samples consumed): the anchor when at or after
        it, else iteration 0."""
        anchor = self.anchor
        if anchor is not None and done_target >= anchor.iteration:
            return anchor.iteration, anchor.consumed_samples
        if anchor is not None and not self.history_known:
            raise self._unknown_history(f"iteration {done_target + 1}")
        return 0, 0

    def consumed_before(self, iteration: int) -> int:
        """``consumed_train_samples`` just before 1-indexed ``iteration``."""
        return self._walk(self._start(iteration - 1), iteration - 1)

    def phase_of(self, iteration: int) -> int:
        """Phase index: how many transitions come strictly before ``iteration``."""
        return bisect.bisect_left(self.phase_transitions, iteration)

    def phase_bounds(self, phase: int) -> tuple[int, int | None]:
        """(iterations before the phase, its last iteration or None when open-ended)."""
        edges = (0, *self.phase_transitions)
        if phase < len(self.phase_transitions):
            return edges[phase], self.phase_transitions[phase]
        return edges[phase], self.train_iters

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
        if self.phase_transitions:
            iteration = consumed // self.global_batch_size + 1
            inside = consumed % self.global_batch_size
        else:
            iterations, inside_arr = self._locate(np.array([consumed], dtype=np.int64), phase=0)
            iteration, inside = int(iterations[0]), int(inside_arr[0])
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
        done, consumed = self._start(0)
        if positions.size and self.anchor is not None and not self.history_known:
            if positions.min() < self.anchor.consumed_samples:
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
        """(iteration, micro-batch, DP rank) of each stream position of ``phase``, vectorised.

        Iterations past the phase's last iteration mean the run never reached the position.
        """
        iterations, inside = self._locate(np.asarray(positions, dtype=np.int64), phase)
        unit = self.samples_per_microbatch_step
        return iterations, inside // unit, (inside % unit) // self.micro_batch_size
