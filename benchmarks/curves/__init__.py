"""Real, public training-loss curves for judging the loss-spike detector.

Every CSV here holds values copied verbatim from a public log (see SOURCES.md and
manifest.json for the source, licence and how each onset was labelled).  Columns:

    iteration,lm_loss,grad_norm,loss_scale,skipped

An empty cell means the log does not give that value; ``nan`` means the log shows a
NaN loss.  Pure standard library: ``load_curves()`` returns ``Curve`` objects.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["Curve", "load_curves", "load_curve", "CURVES_DIR"]

CURVES_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Curve:
    name: str
    kind: str  # "incident" | "clean"
    iterations: List[int]
    lm_loss: List[float]  # float("nan") where the log shows a NaN loss
    grad_norm: List[Optional[float]]  # None where the log has no grad norm
    loss_scale: List[Optional[float]]  # None where the log has no loss scale
    skipped: List[bool]  # True where the log says the step was skipped
    onsets: List[int]  # labelled incident onsets (iterations); [] for clean runs
    meta: Dict[str, Any] = field(default_factory=dict)  # the manifest entry

    def __len__(self) -> int:
        return len(self.iterations)

    @property
    def has_grad_norm(self) -> bool:
        return any(g is not None for g in self.grad_norm)


def _opt_float(cell: str) -> Optional[float]:
    cell = cell.strip()
    return float(cell) if cell else None


def _read_csv(path: str) -> Dict[str, list]:
    cols: Dict[str, list] = {k: [] for k in ("iteration", "lm_loss", "grad_norm", "loss_scale", "skipped")}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            cols["iteration"].append(int(row["iteration"]))
            loss = row["lm_loss"].strip()
            cols["lm_loss"].append(float(loss) if loss else math.nan)
            cols["grad_norm"].append(_opt_float(row["grad_norm"]))
            cols["loss_scale"].append(_opt_float(row["loss_scale"]))
            cols["skipped"].append(row["skipped"].strip() == "1")
    return cols


def _manifest(directory: str) -> List[Dict[str, Any]]:
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)


def load_curve(name: str, directory: str = CURVES_DIR) -> Curve:
    for entry in _manifest(directory):
        if entry["name"] == name:
            return _build(entry, directory)
    raise KeyError(name)


def _build(entry: Dict[str, Any], directory: str) -> Curve:
    cols = _read_csv(os.path.join(directory, entry["file"]))
    return Curve(
        name=entry["name"],
        kind=entry["kind"],
        iterations=cols["iteration"],
        lm_loss=cols["lm_loss"],
        grad_norm=cols["grad_norm"],
        loss_scale=cols["loss_scale"],
        skipped=cols["skipped"],
        onsets=list(entry.get("onsets", [])),
        meta=dict(entry),
    )


def load_curves(kind: Optional[str] = None, directory: str = CURVES_DIR) -> List[Curve]:
    """Load every curve in the manifest (optionally only ``kind`` "incident" or "clean")."""
    return [_build(e, directory) for e in _manifest(directory) if kind is None or e["kind"] == kind]
