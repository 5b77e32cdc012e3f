"""A rollback request left pending by a launcher that restarts in place (``ft_launcher`` or
torchrun ``--max-restarts``, a manual rerun): applied by the restarted training before it
reads the tracker. Rank 0 runs ``skiplist --apply`` (``SKIPLIST_ARGS`` adds flags), the other
ranks wait for it on the shared filesystem; under megatron-ext's supervisor, nothing to do.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from megatron_ext.common.files import SPIKE_LEDGER_FILE, read_checkpoint_tracker
from megatron_ext.common.io import read_jsonl
from megatron_ext.common.run_lock import TOKEN_ENV
from megatron_ext.incidents import cli, transaction
from megatron_ext.incidents.planner import incident_id, latest_incident


def pending(load: Path, ledger: Path) -> str | None:
    """The newest rollback request's identity when neither applied nor trained past."""
    if not ledger.is_file():
        return None
    requests = [e for e in read_jsonl(ledger, warn=False).records if e.get("kind") == "rollback"]
    if not requests:
        return None
    request = latest_incident(requests)  # a damaged line: PlanError, as `skiplist` says it
    ident = incident_id(request)
    if any(r.get("incident_id") == ident for r in transaction.applied_records(load)):
        return None
    tracker = read_checkpoint_tracker(load)
    return ident if tracker is None or tracker <= request["iteration"] else None


def apply_at_startup(argv: list[str], rank: int) -> str | None:
    """Apply (rank 0) or wait for (the others) a pending rollback request; its identity."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--load", "--signals-dir", "--spike-ledger", "--result-rejected-tracker-filename"):
        parser.add_argument(flag)
    parser.add_argument("--spike-detect", action="store_true")
    facts = parser.parse_known_args(argv)[0]
    if os.environ.get(TOKEN_ENV) or not (facts.load and facts.signals_dir and facts.spike_detect):
        return None
    load = Path(facts.load)
    ledger = Path(facts.spike_ledger or Path(facts.signals_dir) / SPIKE_LEDGER_FILE)
    ident = pending(load, ledger)
    if ident is None:
        return None
    if rank == 0:
        print(
            f"megatron-ext: applying the pending rollback request {ident} before loading "
            "(the launcher restarted the training in place)",
            flush=True,
        )
        words = ["--apply", "--ckpt-dir", str(load), "--signals-dir", facts.signals_dir]
        words += ["--ledger", str(ledger)]
        if facts.result_rejected_tracker_filename:
            words += ["--tracker-file", facts.result_rejected_tracker_filename]
        status = cli.main([*words, *shlex.split(os.environ.get("SKIPLIST_ARGS", ""))])
        if status != 0:
            raise SystemExit(
                f"megatron-ext: the pending rollback request {ident} could not be applied (exit "
                f"{status}, above); fix it and apply it with `megatron-ext skiplist --apply "
                f"--ckpt-dir {load} --signals-dir {facts.signals_dir}`, or undo it with --undo"
            )
        return ident
    transaction.wait_for_rank_0(
        lambda: pending(load, ledger) is None,
        f"rank {rank}: rank 0 did not apply the pending rollback request {ident} in {load}",
    )
    return ident
