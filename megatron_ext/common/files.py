"""Every file name megatron-ext reads or writes, and the Megatron names it must match: one
place, so a reader and the writer never disagree about a name.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_ext.common.errors import Refusal

# -- Megatron's own names (megatron-core 0.19.2, training/checkpointing.py) -----------------
CHECKPOINT_TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_DIR = re.compile(r"^iter_(\d{7})$")
# Inside iter_NNNNNNN (dist_checkpointing): torch_dist's marker, torch DCP's storage index (a
# pickle) and the legacy common-state file; read by megatron_ext.common.checkpoint_state.
CHECKPOINT_METADATA_FILE = "metadata.json"
DCP_METADATA_FILE = ".metadata"
CHECKPOINT_COMMON_FILE = "common.pt"
# A legacy (non-dist) checkpoint: one folder per model-parallel rank, mp_rank_TT[_PPP][_EEE],
# holding model_optim_rng.pt (and distrib_optim.pt with the distributed optimizer).
LEGACY_RANK_DIR_GLOB = "mp_rank_*"
LEGACY_MODEL_FILE = "model_optim_rng.pt"
# -- Megatron-Bridge's own names (megatron-bridge 0.6.2, training/utils/checkpoint_utils.py;
# registry megatron_ext.bridge.table bridge-train-state-files) ------------------------------
# Bridge resumes from ROOT/latest_train_state.pt (a copy of the newest iter_*/train_state.pt)
# before it reads Megatron's tracker; each checkpoint holds its run_config.yaml, not args.
BRIDGE_TRAIN_STATE_FILE = "train_state.pt"
BRIDGE_TRACKER_FILE = "latest_train_state.pt"
BRIDGE_RUN_CONFIG_FILE = "run_config.yaml"
# megatron-ext's beside them (megatron_ext.bridge.checkpoints): the world and DP sizes.
BRIDGE_LAYOUT_FILE = "megatron_ext_bridge_layout.json"


def checkpoint_dir(root: str | Path, iteration: int) -> Path:
    """``ROOT/iter_NNNNNNN``, as Megatron names a checkpoint."""
    return Path(root) / f"iter_{iteration:07d}"


# -- in --signals-dir ------------------------------------------------------------------------
SIGNALS_FILE = "signals.jsonl"  # one record per iteration, every attempt appended
SPIKE_LEDGER_FILE = "spikes.jsonl"  # spike detector events (unless --spike-ledger)
SIGNALS_PLOT_FILE = "signals.png"  # default output of `megatron-ext plot`
VALIDATION_FILE = "validation.jsonl"  # per-dataset validation loss, one line per set

# -- in --sample-log-dir -----------------------------------------------------------------------


def sample_log_file(directory: str | Path, dp_rank: int) -> Path:
    """Per-DP-rank sample log."""
    return Path(directory) / f"samples-dp{dp_rank}.jsonl"


def sample_log_attempts_file(directory: str | Path, dp_rank: int) -> Path:
    """Per-DP-rank attempt index: where each writer's run of records starts in the log."""
    return Path(directory) / f"attempts-dp{dp_rank}.jsonl"


SAMPLE_LOG_GLOB = "samples-dp*.jsonl"
LAYOUT_FILE = "layout.jsonl"  # one line per attempt: DP, micro/global batch, skips, start

# -- in the checkpoint directory (--save / --load) ----------------------------------------------
SKIPPED_ITERATIONS_FILE = "megatron_ext_skipped_iterations.txt"  # applied skips, absolute
LAST_PLAN_SKIP_FILE = "megatron_ext_skip.txt"  # the last plan's skips (maybe never applied)
# incident-NNN.{json,md}, incident-NNN-blocklist.jsonl, applied.jsonl
INCIDENTS_DIR = "megatron_ext_incidents"
APPLIED_INCIDENTS_FILE = "applied.jsonl"  # in INCIDENTS_DIR: one line per applied incident
APPLY_JOURNAL_FILE = "megatron_ext_apply_journal.json"  # a `skiplist --apply` in progress
ROLLED_BACK_DIR = "rolled_back"  # rolled_back/incident-NNN/iter_NNNNNNN (nothing deleted)
RESULT_REJECTED_TRACKER_FILE = "result_rejected_tracker.txt"
LAUNCH_STATE_DIR = "launch_state"  # per-rank exit codes of each attempt (shared filesystem)
ATTEMPT_END_FILE = "attempt_end.json"  # in LAUNCH_STATE_DIR: how the attempt ended (rank 0)
UNCHARGED_REQUEUES_FILE = "uncharged_requeues"  # in LAUNCH_STATE_DIR: requeues with progress
RUN_LOCK_FILE = "megatron_ext_run.lock"  # the one writer's lease (megatron_ext.runlock)


def incident_stem(ckpt_dir: str | Path, number: int) -> Path:
    """``CKPT/megatron_ext_incidents/incident-NNN`` (add ``.json`` / ``.md``)."""
    return Path(ckpt_dir) / INCIDENTS_DIR / f"incident-{number:03d}"


def incident_blocklist(ckpt_dir: str | Path, number: int) -> Path:
    """Where the incident report suggests ``megatron-ext lookup --emit-blocklist`` writes."""
    return incident_stem(ckpt_dir, number).with_name(f"incident-{number:03d}-blocklist.jsonl")


def applied_incidents_file(ckpt_dir: str | Path) -> Path:
    """``CKPT/megatron_ext_incidents/applied.jsonl``: the incidents ``--apply`` carried out."""
    return Path(ckpt_dir) / INCIDENTS_DIR / APPLIED_INCIDENTS_FILE


def rolled_back_dir(ckpt_dir: str | Path, number: int) -> Path:
    """Where ``skiplist --apply`` moves the checkpoints newer than the rollback target."""
    return Path(ckpt_dir) / ROLLED_BACK_DIR / f"incident-{number:03d}"


class TrackerError(Refusal, ValueError):
    """Megatron's checkpoint tracker holds something other than an iteration number."""


def read_checkpoint_tracker(root: str | Path) -> int | None:
    """The iteration ``ROOT/latest_checkpointed_iteration.txt`` names (None: no tracker); a
    damaged tracker (not an integer or ``release``) is an error naming the file and the fix."""
    path = Path(root) / CHECKPOINT_TRACKER_FILE
    try:
        text = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    if text.isdigit():
        return int(text)
    shown = text if len(text) <= 40 else text[:40] + "..."
    raise TrackerError(
        f"{path} holds {shown!r}, not an iteration number: write the iteration of the newest "
        f"complete checkpoint in {root} (an iter_NNNNNNN directory) into it, e.g. `echo 35 > "
        f"{path}`"
    )
