"""The spike ledger (``SIGNALS_DIR/spikes.jsonl``: the detector's events and a ``config`` line
per attempt) and the incident plans (``CKPT/megatron_ext_incidents/incident-NNN.json``), as
readers see them (no Megatron imports).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.files import INCIDENTS_DIR
from megatron_ext.common.gap_log import is_gap
from megatron_ext.common.io import read_jsonl
from megatron_ext.common.records.spike_config import SpikeConfig

CONFIG_KIND = "config"


def config_record(
    iteration: int, attempt: int, config: SpikeConfig, save: str | None, sample_log: str | None
) -> dict[str, Any]:
    """The ledger line an attempt writes before its first event (``iteration`` first, as
    every ledger line, so range reads work)."""
    return {
        "iteration": iteration,
        "kind": CONFIG_KIND,
        "attempt": attempt,
        "config": config.as_json(),
        "save": save,
        "sample_log_dir": sample_log,
    }


@dataclass
class Ledger:
    configs: dict[int, dict[str, Any]] = field(default_factory=dict)  # attempt -> config line
    events: list[dict[str, Any]] = field(default_factory=list)  # everything else, in order

    def config(self, attempt: int) -> SpikeConfig | None:
        """The thresholds ``attempt`` ran with (the nearest earlier attempt's if it wrote none)."""
        known = [a for a in self.configs if a <= attempt]
        return SpikeConfig.from_json(self.configs[max(known)]["config"]) if known else None

    def save_dir(self) -> str | None:
        """The run's checkpoint directory, as the latest attempt recorded it."""
        return next(
            (c["save"] for _, c in sorted(self.configs.items(), reverse=True) if c.get("save")),
            None,
        )


def read_ledger(path: str | os.PathLike[str]) -> Ledger:
    ledger = Ledger()
    for record in read_jsonl(path).records:
        if is_gap(record):
            continue  # lines a full disk kept out (megatron_ext.common.gap_log)
        if record.get("kind") == CONFIG_KIND:
            ledger.configs[int(record.get("attempt") or 0)] = record
        else:
            ledger.events.append(record)
    return ledger


def read_incidents(ckpt_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every plan ``megatron-ext skiplist`` wrote for the run, oldest first."""
    directory = Path(ckpt_dir) / INCIDENTS_DIR
    plans = []
    for path in sorted(directory.glob("incident-[0-9][0-9][0-9].json")):
        plans.append({**json.loads(path.read_text()), "number": int(path.stem.split("-")[1])})
    return plans
