"""The spike detector replayed over a long log without a Python call per quiet record
(``megatron-ext plot``): exactly the events of :func:`~megatron_ext.spikes.detector.replay`.
Quiet records (the arrays show they only feed the baselines) are skipped once ``R`` learned
ones in a row fill the windows; the first skip is checked against a live twin. How and why:
docs/signals.md "The plot". No Megatron imports.
"""

from __future__ import annotations

import copy
import math
from collections import deque

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from megatron_ext.common.records.signals import Block, SignalRecord, replay_records
from megatron_ext.spikes.detector import SpikeDetector, SpikeEvent

Chunk = tuple[Block, np.ndarray]  # rows of a block, in order


def state_of(value: object) -> object:
    """A detector's whole state as nested plain values (floats by ``repr``: NaN equals NaN)."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return {k: state_of(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, deque)):
        return [state_of(v) for v in value]
    slots = getattr(type(value), "__slots__", None)
    if hasattr(value, "__dict__") or slots:
        names = list(vars(value)) if hasattr(value, "__dict__") else list(slots)  # type: ignore[arg-type]
        return (type(value).__name__, {n: state_of(getattr(value, n)) for n in names})
    return value


def _windows(tail: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """Row i: the ``size`` values before ``values[i]`` in ``tail`` + ``values`` (a view; NaN
    where the stream had fewer)."""
    padded = np.concatenate([np.full(max(0, size - len(tail)), np.nan), tail[-size:], values])
    return sliding_window_view(padded, size)[: len(values)]


class FastReplay:
    """Feed :meth:`feed` a line's rows in order; it returns the events ``replay`` would."""

    def __init__(self, detector: SpikeDetector) -> None:
        self.detector = detector
        config = detector.config
        self.size = max(config.window, config.context)  # R: what a fast-forward replays
        self.skipping = False
        self.verified: bool | None = None  # None: not yet checked; False: always live
        self.twin: SpikeDetector | None = None  # the copy fast-forwarded while checking
        self.checking: list[SignalRecord] = []
        self.streak = 0  # learned records in a row with an unchanged pattern
        self.live_pattern = -1  # the pattern of the last record observed
        self.stretch: deque[Chunk] = deque()  # the skipped records' last R (at least)
        self.stretch_length = 0
        self.losses = np.array([], dtype=np.float64)  # the stream's last `window` losses
        self.excess = np.array([], dtype=np.float64)  # its last `window` excess values
        self.scale = math.nan  # its last finite loss scale
        self.pattern = -1  # of its last record
        self.member_ids: dict[str, int] = {}
        self.observed = 0  # records that went through observe (tests, benchmarks)

    def feed(self, block: Block, rows: np.ndarray) -> list[SpikeEvent]:
        """The events of ``rows`` (the next records of the line, in order)."""
        quiet, patterns, skipped = self._quiet(block, rows)
        events: list[SpikeEvent] = []
        index = 0
        while index < len(rows):
            if self.skipping:
                loud = np.flatnonzero(~quiet[index:])
                end = len(rows) if not len(loud) else index + int(loud[0])
                self._skip(block, rows[index:end], int(patterns[end - 1]) if end > index else -1)
                if not len(loud):
                    break
                self._forward()
                index = end
                continue
            row = rows[index : index + 1]
            events += self._live(block, row, int(patterns[index]), bool(skipped[index]))
            index += 1
        return events

    def _live(self, block: Block, row: np.ndarray, pattern: int, skipped: bool) -> list[SpikeEvent]:
        """Observe one record; count the learned streak; start skipping once it is long."""
        detector = self.detector
        (record,) = replay_records(block, row)
        events = detector.observe(record)
        self.observed += 1
        learned = not (events or skipped) and detector.raised_since is None
        learned = learned and detector.state == "healthy"
        if detector.state == "rollback":
            detector.resume()
        self.streak = (self.streak + 1 if pattern == self.live_pattern else 1) if learned else 0
        self.live_pattern = pattern
        if self.twin is not None:
            self._check(record, learned)
        synced = learned and self.streak >= self.size and detector.armed()
        if synced and self.verified is None and self.twin is None:
            self.twin, self.checking = copy.deepcopy(detector), []
        elif synced and self.verified:
            self.skipping = True
        return events

    def _check(self, record: SignalRecord, learned: bool) -> None:
        """The first skipping, done both ways: live here, fast-forwarded on the twin."""
        if not learned:
            self.twin = None  # not a quiet stretch: check at the next one
            return
        self.checking.append(record)
        if len(self.checking) < self.size:
            return
        twin, self.twin = self.twin, None
        assert twin is not None
        _fast_forward(twin, self.checking, len(self.checking))
        self.verified = state_of(vars(twin)) == state_of(vars(self.detector))

    def _skip(self, block: Block, rows: np.ndarray, pattern: int) -> None:
        """Quiet rows, not observed: only the stretch's last R are kept (to fast-forward)."""
        if not len(rows):
            return
        self.stretch.append((block, rows))
        self.stretch_length += len(rows)
        self.live_pattern = pattern
        kept = sum(len(r) for _, r in self.stretch)
        while kept - len(self.stretch[0][1]) >= self.size:
            kept -= len(self.stretch.popleft()[1])

    def _forward(self) -> None:
        """Bring the detector past the skipped stretch (all learned: the streak goes on)."""
        records: list[SignalRecord] = []
        for block, rows in reversed(self.stretch):
            wanted = self.size - len(records)
            records = replay_records(block, rows[-wanted:]) + records
            if len(records) >= self.size:
                break
        _fast_forward(self.detector, records, self.stretch_length)
        self.streak += self.stretch_length
        self.stretch.clear()
        self.stretch_length = 0
        self.skipping = False

    def _quiet(self, block: Block, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row: whether it is quiet given the stream before it (see the module), its
        pattern, and whether it is a skipped step; the stream's tails move past the rows."""
        config = self.detector.config
        values, present = block.values, block.present
        loss = np.where(present["lm_loss"][rows], values["lm_loss"][rows], np.nan)
        grad, has_grad = values["grad_norm"][rows], present["grad_norm"][rows]
        worst = np.where(present["max_local_loss"][rows], values["max_local_loss"][rows], np.nan)
        with np.errstate(invalid="ignore"):
            excess = worst - loss
        has_excess = np.isfinite(excess)
        scale = np.where(present["loss_scale"][rows], values["loss_scale"][rows], np.nan)
        finite_scale = np.isfinite(scale)
        before = np.concatenate([[self.scale], scale])
        where = np.maximum.accumulate(np.where(np.isfinite(before), np.arange(len(before)), 0))
        with np.errstate(invalid="ignore"):
            drop = finite_scale & (scale < before[where][:-1])  # below the last finite one
        members, member = self._members(block, rows)
        bits = [has_grad, has_excess, finite_scale]
        bits += [present[n][rows] for n in ("log_z", "max_attention_logit")]
        patterns = sum(b.astype(np.int64) << k for k, b in enumerate(bits)) + (member << 8)
        changed = patterns != np.concatenate([[self.pattern], patterns[:-1]])
        skipped = drop | values["skipped_iter"][rows] | values["update_skipped"][rows]
        quiet = np.isfinite(loss) & ~(has_grad & ~np.isfinite(grad)) & ~skipped & ~changed
        if config.per_source:
            quiet &= members <= 1  # a blend record: judged by its sources
        quiet &= self._below(loss, excess, has_excess, quiet)
        self.losses = np.concatenate([self.losses, loss])[-config.window :]
        self.excess = np.concatenate([self.excess, excess[has_excess]])[-config.window :]
        if finite_scale.any():
            self.scale = float(scale[finite_scale][-1])
        self.pattern = int(patterns[-1]) if len(patterns) else self.pattern
        return quiet, patterns, skipped

    def _members(self, block: Block, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row: how many sources it has, and an id of the one it has (finite), -1 when it
        has none, -2 when more or not finite."""
        sources = block.sources
        if sources is None or not self.detector.config.per_source:
            return np.zeros(len(rows), dtype=np.int64), np.full(len(rows), -1, dtype=np.int64)
        has = sources.has_loss[rows]
        finite = has & np.isfinite(sources.losses[rows])
        ids = np.array([self.member_ids.setdefault(n, len(self.member_ids)) for n in sources.names])
        count = has.sum(axis=1)
        single = (count == 1) & (finite.sum(axis=1) == 1)
        first = ids[finite.argmax(axis=1)] if len(ids) else np.zeros(len(rows), dtype=np.int64)
        return count, np.where(count == 0, -1, np.where(single, first, -2))

    def _below(
        self, loss: np.ndarray, excess: np.ndarray, has_excess: np.ndarray, asked: np.ndarray
    ) -> np.ndarray:
        """Rows of ``asked`` under both rising tests, by the windows the arrays give (False
        where they cannot say: fewer values than a window)."""
        config = self.detector.config
        size, rel = config.window, config.loss_rel
        rows = np.flatnonzero(asked)
        windows = _windows(self.losses, loss, size)
        low = windows.min(axis=1)[rows]
        with np.errstate(invalid="ignore"):
            # The threshold grows with the median, which is at least the window's minimum.
            certain = (low >= 0) & (loss[rows] <= low + low * rel)
        median = low.copy()  # where certain: a lower bound, enough for the excess test too
        unsure = np.flatnonzero(~certain & np.isfinite(low))
        median[unsure] = np.median(windows[rows[unsure]], axis=1)
        with np.errstate(invalid="ignore"):
            fine = certain | (loss[rows] <= median + np.abs(median) * rel)
        # The worst rank's excess, against its last `window` values (none yet: not judged).
        dense = np.concatenate([self.excess, excess[has_excess]])
        count = len(self.excess) + np.cumsum(has_excess) - has_excess  # values before a row
        judged = has_excess[rows] & (count[rows] > 0)
        fine &= ~(judged & (count[rows] < size))  # a partial window: the arrays cannot say
        full = np.flatnonzero(judged & (count[rows] >= size))
        if len(full):
            windows_x = sliding_window_view(dense, size)[count[rows][full] - size]
            margin = np.abs(median[full]) * rel
            with np.errstate(invalid="ignore"):
                x_fine = excess[rows][full] <= windows_x.min(axis=1) + margin
            unsure = np.flatnonzero(~x_fine)
            if len(unsure):
                exact = np.median(windows[rows[full[unsure]]], axis=1)
                with np.errstate(invalid="ignore"):
                    x_fine[unsure] = (
                        excess[rows][full][unsure]
                        <= np.median(windows_x[unsure], axis=1) + np.abs(exact) * rel
                    )
            fine[full] &= x_fine
        below = np.zeros(len(loss), dtype=bool)
        below[rows] = fine
        return below


def _fast_forward(detector: SpikeDetector, records: list[SignalRecord], total: int) -> None:
    """``detector`` as if it had observed ``total`` quiet records ending with ``records``
    (which hold every value its windows keep): the steps ``observe`` takes for a record that
    is healthy and not rising."""
    detector.seen += total - len(records)
    for record in records:
        detector.recent.append(record)
        detector.seen += 1
        loss, grad, excess, skipped = detector._read(record)
        if not skipped:  # never, in a quiet stretch
            detector._learn(record, loss, grad, excess)
