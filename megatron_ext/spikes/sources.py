"""Per-source baselines for the spike detector (no Megatron imports).

Why: the averaged loss of a blend moves when the mixture moves (a new stage, or just this
batch's draw), and a bad source with a small share hides in it (spike-diagnosis material,
sections 一 and 三). Each blend member keeps its own rolling median/MAD of its own loss
(``lm_loss_by_dataset``), learned on healthy iterations only. A member's loss does not
depend on how much of the batch it is, so a change of mixture weights or stage moves no
member's statistics.

Mixture normalisation: the record's ``lm_loss`` is the token-weighted mean of the members'
losses, so ``lm_loss - Σ share_k·median_k = Σ share_k·(loss_k - median_k)``: what the average
moved by *beyond* what this batch's mixture explains. The detector judges (and learns) the
average as ``adjusted = aggregate median + Σ share_k·(loss_k - median_k)``, the average the
batch would have had under the baseline's mixture. A mixture change leaves it in its band; a
member's own jump moves it by its share. A member without a baseline yet (a source new in this
stage) counts as on its baseline until it has one.
"""

from __future__ import annotations

from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.spikes.windows import RollingWindow


class SourceBaselines:
    """One :class:`RollingWindow` per blend member, by name (members come and go with stages)."""

    def __init__(self, window: int) -> None:
        self.size = window
        self.windows: dict[str, RollingWindow] = {}

    def _armed(self, name: str) -> RollingWindow | None:
        window = self.windows.get(name)
        return window if window is not None and len(window) >= self.size // 2 else None

    def adjusted(self, record: SignalRecord, aggregate_median: float) -> float | None:
        """The mixture-adjusted average (module docstring), or None when the record has no
        per-source losses or no member of it has a baseline yet."""
        losses, tokens = record.lm_loss_by_dataset, record.tokens_by_dataset
        total = sum(tokens.get(n, 0) for n in losses)
        if not losses or total <= 0:
            return None
        moved, judged = 0.0, False
        for name, loss in losses.items():
            window = self._armed(name)
            if window is not None:
                moved += tokens.get(name, 0) / total * (loss - window.median())
                judged = True
        return aggregate_median + moved if judged else None

    def rising(self, record: SignalRecord, rel: float) -> bool:
        """Any member above ``median·(1+rel)`` (the cheap test, every step)."""
        for name, loss in record.lm_loss_by_dataset.items():
            window = self._armed(name)
            if window is not None and loss > window.median() * (1 + rel):
                return True
        return False

    def jump(self, record: SignalRecord, rel: float, k: float) -> str | None:
        """The member whose own loss is above both its relative and its MAD threshold, the
        one furthest above its median when several are; None when none is."""
        worst, name = 0.0, None
        for member, loss in record.lm_loss_by_dataset.items():
            window = self._armed(member)
            if window is None or not window.above(loss, rel, k):
                continue
            rise = loss / window.median() - 1 if window.median() else float("inf")
            if name is None or rise > worst:
                worst, name = rise, member
        return name

    def threshold(self, name: str, rel: float, k: float) -> float | None:
        window = self._armed(name)
        return window.threshold(rel, k) if window is not None else None

    def median(self, name: str) -> float | None:
        window = self._armed(name)
        return window.median() if window is not None else None

    def learn(self, record: SignalRecord) -> None:
        for name, loss in record.lm_loss_by_dataset.items():
            if loss == loss and abs(loss) != float("inf"):  # finite only
                self.windows.setdefault(name, RollingWindow(self.size)).push(loss)
