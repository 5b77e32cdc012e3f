"""The incident report of ``megatron-ext skiplist`` (``incident-NNN.{md,json}``): the plan, the
cause tree's walk, and the onset batch's worst documents from ``megatron-ext lookup --worst``
(a subprocess, so the planner loads no Megatron; a failed lookup never blocks the plan).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.files import incident_blocklist
from megatron_ext.common.records.provenance import place
from megatron_ext.common.records.signals import SignalRecord, latest_per_iteration
from megatron_ext.incidents.causes import Diagnosis, diagnose
from megatron_ext.incidents.planner import Plan, reproduced

LOOKUP_TIMEOUT = 600  # seconds; a lookup on a huge blend opens many index caches
SNIPPET = 200  # characters of each document's text in the report
DEFAULT_WORST = 8  # samples listed (skiplist --worst), and suggested with --no-lookup
WARNING_HORIZON = 1000  # iterations before an onset in which a precursor warning counts


def _num(value: Any) -> str:
    """A signal for a table: 6 significant digits (the log keeps every digit)."""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _nonfinite(incident: dict[str, Any]) -> str:
    """The title's note when the incident's loss was not a number."""
    loss = incident.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        return f" (loss {loss}: non-finite at iteration {incident['iteration']})"
    return ""


@dataclass
class Report:
    """One incident's report; ``markdown()`` for people, ``as_json()`` next to it."""

    plan: Plan
    number: int
    diagnosis: Diagnosis
    lookup_command: list[str]
    blocklist: Path  # where --emit-blocklist writes these documents
    documents: list[dict[str, Any]] = field(default_factory=list)
    lookup_lines: list[str] = field(default_factory=list)
    lookup_error: str | None = None
    warnings: list[dict[str, Any]] = field(default_factory=list)  # precursors before onset

    def lead_time(self) -> int | None:
        """Iterations from the first precursor warning to the onset (None: no warning)."""
        first = min((w["iteration"] for w in self.warnings), default=None)
        return None if first is None else self.plan.onset - first

    def _warning_line(self) -> str:
        if not self.warnings:
            return (
                f"- early warning: none in the {WARNING_HORIZON} iterations before the onset "
                "(a transient spike has no precursor)"
            )
        first = min(self.warnings, key=lambda w: w["iteration"])
        return (
            f"- early warning: **{self.lead_time()} iterations before the onset** "
            f"({first['signal']} at iteration {first['iteration']}: {first['classification']})"
        )

    def blocklist_command(self) -> str:
        """The lookup that writes these documents as a blocklist (``--emit-blocklist``)."""
        command = [a for a in self.lookup_command[3:] if a != "--json"]
        return " ".join(["megatron-ext", *command, "--emit-blocklist", str(self.blocklist)])

    def apply_command(self) -> str | None:
        """The command that writes the raw shards without these documents' records (None: no
        document names its raw record)."""
        documents = (d for r in self.documents for d in r.get("documents", []))
        files = {d["source"]["file"] for d in documents if d.get("source")}
        if not files:
            return None
        common = os.path.commonpath([os.path.dirname(f) for f in files])
        out = Path(common) / f"filtered-incident-{self.number:03d}"
        return f"megatron-ext blocklist apply --blocklist {self.blocklist} --out-dir {out}"

    def as_json(self) -> dict[str, Any]:
        return {
            **self.plan.as_json(),
            "diagnosis": self.diagnosis.as_json(),
            "top_documents": self.documents,
            "lookup": self.lookup_error or "\n".join(self.lookup_lines),
            "blocklist_command": self.blocklist_command(),
            "apply_command": self.apply_command(),
            "early_warnings": self.warnings,
            "lead_time": self.lead_time(),
        }

    def markdown(self) -> str:
        plan, incident, d = self.plan, self.plan.incident, self.diagnosis
        return "\n".join(
            [
                f"# Incident {self.number:03d}: {incident['kind']} at iteration "
                f"{incident['iteration']}{_nonfinite(incident)}\n",
                f"{plan.summary}\n",
                f"- action: **{plan.action}**",
                f"- onset: {plan.onset}",
                f"- culprit DP rank (max local loss): {incident.get('culprit_dp_rank')}",
                f"- culprit source (its own loss jumped): "
                f"{d.culprit_source or incident.get('culprit_source')}",
                f"- layer whose grad norm rose first: {d.first_layer or 'not recorded'}",
                f"- classification: {incident.get('classification')}",
                f"- likely cause: **{d.label}**{' (diverged)' if d.diverged else ''}: {d.action}",
                self._warning_line(),
                f"- rollback to checkpoint: {plan.rollback_to} (moved aside: "
                f"{plan.moved_checkpoints})",
                f"- skip window: {plan.skip_window}",
                f"- all skipped: {plan.skip_ranges}",
                f"- restart with: `{' '.join(plan.restart_args)}`\n",
                "## Likely cause (seed 000 decision tree)\n",
                "| step | question | answer | evidence |",
                "|---|---|---|---|",
                *(f"| {s.name} | {s.question} | **{s.answer}** | {s.evidence} |" for s in d.steps),
                "",
                "Signals this run did not record: "
                + (", ".join(d.missing) if d.missing else "none")
                + "\n",
                "## Signals before the incident\n",
                "| iteration | lm loss | grad norm | max local loss | worst DP rank | "
                "update ratio |",
                "|---|---|---|---|---|---|",
                *(
                    f"| {w['iteration']} | {_num(w['lm_loss'])} | {_num(w['grad_norm'])} | "
                    f"{_num(w['max_local_loss'])} | {w['max_loss_dp_rank']} | "
                    f"{_num(w['update_ratio'])} |"
                    for w in incident.get("window", [])
                ),
                "",
                self._documents(),
            ]
        )

    def _documents(self) -> str:
        rank = self.diagnosis.culprit_dp_rank
        head = (
            f"## Top documents of iteration {self.plan.onset} by loss (culprit DP rank "
            f"{rank} first)\n"
        )
        if self.lookup_error:
            return head + f"not available: {self.lookup_error}\n"
        rows = []
        for r in self.documents:
            documents = ", ".join(
                f"{Path(r['dataset_path']).name} doc {d['document']} (tokens {d['offset']}+"
                f"{d['count']}){_raw(d.get('source'))}"
                for d in r["documents"]
            )
            text = " ".join(r.get("text", "").split())[:SNIPPET].replace("|", "\\|")
            flag = " (trained tokens differ from disk)" if r.get("trained_tokens_differ") else ""
            rows.append(
                f"| {r['rank_by_loss']} | {r['loss']:.4f} | {r['dp_rank']} | {r['microbatch']} | "
                f"{r['sample_index']} | {documents}{flag} | {text} |"
            )
        return "\n".join(
            [
                head,
                *(f"    {line}" for line in self.lookup_lines),
                "",
                "| # by loss | loss | DP rank | micro-batch | sample | documents | text |",
                "|---|---|---|---|---|---|---|",
                *rows,
                "",
                f"Blocklist these documents: `{self.blocklist_command()}`",
                "",
                self._apply_line(),
                "",
            ]
        )

    def _apply_line(self) -> str:
        """How to remove the records from the raw shards, or why it cannot be said."""
        command = self.apply_command()
        if command is None:
            return (
                "The data has no provenance sidecar, so no raw record is named: "
                "`megatron-ext provenance rebuild` writes one for data Megatron preprocessed."
            )
        return f"Then write the raw shards without their records (filtered copies): `{command}`"


def _raw(source: dict[str, Any] | None) -> str:
    """`` from FILE:LINE (id X)`` for the report's table, or nothing."""
    if not source:
        return ""
    record_id = "" if source.get("id") is None else f" (id {source['id']})"
    return f" from {place(source)}{record_id}"


def culprit_first(samples: list[dict[str, Any]], rank: int | None) -> list[dict[str, Any]]:
    """The culprit DP rank's samples first, each group by loss (stable)."""
    return sorted(samples, key=lambda s: (s["dp_rank"] != rank, s["rank_by_loss"]))


def build_report(
    plan: Plan,
    ledger: list[dict[str, Any]],
    history: list[SignalRecord],
    ckpt_dir: Path,
    number: int,
    worst: int | None,
) -> Report:
    """Diagnose the incident over the iterations its attempt trained on, collect that
    attempt's precursor warnings within :data:`WARNING_HORIZON` iterations up to the onset,
    and (unless ``worst`` is None) look up its top documents."""
    incident, attempt = plan.incident, plan.incident.get("attempt")
    trained = attempt or max((r.attempt for r in history), default=0)
    timeline = latest_per_iteration([r for r in history if r.attempt <= trained])
    diagnosis = diagnose({**incident, "onset": plan.onset}, timeline, reproduced(incident, ledger))
    command = [
        *(sys.executable, "-m", "megatron_ext.cli", "lookup", "--from-checkpoint", str(ckpt_dir)),
        *("--ckpt-step", str(plan.rollback_to), "--iteration", str(plan.onset)),
        *("--worst", str(worst or DEFAULT_WORST), "--text", "--json"),
    ]
    warnings = [
        e
        for e in ledger
        if e.get("kind") == "warning"
        and e.get("attempt") == attempt
        and plan.onset - WARNING_HORIZON <= e.get("iteration", -1) <= plan.onset
    ]
    blocklist = incident_blocklist(ckpt_dir, number)
    report = Report(plan, number, diagnosis, command, blocklist, warnings=warnings)
    if worst is None:
        report.lookup_error = "not looked up (--no-lookup)"
        return report
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=LOOKUP_TIMEOUT)
    except subprocess.TimeoutExpired:
        report.lookup_error = f"lookup timed out after {LOOKUP_TIMEOUT} s"
        return report
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
        report.lookup_error = f"lookup failed ({result.returncode}): {last}"
        return report
    answer = json.loads(result.stdout)
    report.lookup_lines = list(answer.get("lines", []))
    report.documents = culprit_first(answer["samples"], diagnosis.culprit_dp_rank)
    return report
