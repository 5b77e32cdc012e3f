"""The two-node namespace cluster as the multi-node tests use it.

:func:`ensure_two_nodes` starts ``netns_slurm`` (nodes ``n1``, ``n2``: network namespaces with
their own addresses, hostnames and slurmds) or skips with the reason, and fails instead when
``CI`` is set. :class:`TwoNodeSlurm` adds to ``slurm.py``'s sbatch helpers what only a
multi-node cluster has: node addresses and the processes a node runs (by network namespace).
:func:`start_two_node_training` submits the real ``launch/pretrain_gpt_ext.sbatch`` with
``--nodes=2`` and one rank per node (DP=2), every worker started through
:data:`WORKER_PYTHON`, which prints a ``WORKER`` line (``worker_report.py``) first.
:func:`run_together` waits for several jobs at once and fires each one's trigger (a
preemption signal, a kill) when its moment comes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from megatron_ext.common.records.sample_log import SampleRecord
from tests.support.netns_slurm import ClusterUnavailable, NetnsSlurm
from tests.support.netns_slurm import start as start_netns_cluster
from tests.support.slurm import (
    FINAL_STATES,
    REPO,
    RUNNER,
    JobResult,
    PendingJob,
    SlurmCluster,
    cannot_run,
    free_port,
    require_slurm,
    start_training,
)

# Not the netns_slurm CLI's defaults (mx, 10.123.0): a cluster started by hand does not clash.
PREFIX, SUBNET = "mxt", "10.123.1"
# After slurm.py's --nodes=1; --oversubscribe lifts the script's --exclusive so that the
# scenario jobs share the two nodes and run side by side (each takes 1 CPU per node).
TWO_NODES = ["--nodes=2", "--oversubscribe"]
WORKER_REPORT = REPO / "tests" / "support" / "worker_report.py"

# PYTHON of the launch script's workers (test-only): report what this worker sees of the
# rendezvous, then exec the real interpreter (so the rank wrapper's child is Python itself).
WORKER_PYTHON = r"""#!/bin/bash
"@PYTHON@" "@REPORT@" || :
exec "@PYTHON@" "$@"
"""


class TwoNodeSlurm(SlurmCluster):
    """``slurm.py``'s sbatch helpers (submit, scontrol polling, output) on the namespace
    cluster; ``netns`` has its nodes, ``addr`` their addresses."""

    def __init__(self, netns: NetnsSlurm) -> None:
        super().__init__(netns.root)
        self.netns = netns
        self.addr = {node.name: node.address for node in netns.nodes}

    def stop(self) -> None:
        self.netns.stop()

    def workers_on(self, node: str, marker: str) -> list[psutil.Process]:
        """Training workers (Python running the CPU harness's ``run.py``, ``marker`` in their
        arguments, not their forked data-loader workers) that run on ``node``: in its network
        namespace."""
        namespace = next(n.namespace for n in self.netns.nodes if n.name == node)
        inode = os.stat(f"/run/netns/{namespace}").st_ino

        def is_worker(proc: psutil.Process) -> bool:
            argv = proc.cmdline()
            return len(argv) > 1 and argv[1] == str(RUNNER) and marker in " ".join(argv)

        found = []
        for proc in psutil.process_iter():
            try:
                if (
                    is_worker(proc)
                    and not is_worker(proc.parent())
                    and os.stat(f"/proc/{proc.pid}/ns/net").st_ino == inode
                ):
                    found.append(proc)
            except (OSError, psutil.Error):  # gone meanwhile, or no parent
                continue
        return found


def ensure_two_nodes(root: Path) -> TwoNodeSlurm:
    """Install Slurm if needed and start the two-node cluster in ``root``; skip (or, on CI,
    fail) with the reason when this machine cannot. For a pytest fixture."""
    what = "the two-node Slurm tests"
    require_slurm(what, "the namespace cluster needs root (network namespaces, SlurmUser=root)")
    try:
        netns = start_netns_cluster(root, nodes=2, prefix=PREFIX, subnet=SUBNET)
    except ClusterUnavailable as exc:
        cannot_run(what, f"cannot build a two-node cluster from network namespaces here: {exc}")
    return TwoNodeSlurm(netns)


def start_two_node_training(
    cluster: TwoNodeSlurm,
    work: Path,
    data_args: Sequence[str],
    extra_args: Sequence[str] = (),
    *,
    train_iters: int,
    save_interval: int,
    job_name: str,
    **env: str,
) -> PendingJob:
    """``slurm.start_training`` on both nodes, one rank per node (GPUS_PER_NODE=1, DP=2),
    with its own rendezvous port; the supervisor runs on the real interpreter, the workers
    through :data:`WORKER_PYTHON`."""
    work.mkdir(parents=True, exist_ok=True)
    worker_python = work / "worker_python.sh"
    worker_python.write_text(
        WORKER_PYTHON.replace("@PYTHON@", sys.executable).replace("@REPORT@", str(WORKER_REPORT))
    )
    worker_python.chmod(0o755)
    port = str(free_port())
    return start_training(
        cluster,
        work,
        data_args,
        extra_args,
        train_iters=train_iters,
        save_interval=save_interval,
        job_name=job_name,
        sbatch_options=TWO_NODES,
        GPUS_PER_NODE="1",
        MASTER_PORT=port,
        RDZV_PORT=port,
        PYTHON=str(worker_python),
        MEGATRON_EXT_PYTHON=sys.executable,
        **env,
    )


def worker_reports(log: str) -> list[dict]:
    """Every ``WORKER`` line of a job's output (one per worker start), in order."""
    return [json.loads(m) for m in re.findall(r"^WORKER (\{.*\})$", log, re.M)]


Trigger = Callable[[PendingJob], bool]  # acts once its moment has come; True when it has


def run_together(
    jobs: Mapping[str, PendingJob], triggers: Mapping[str, Trigger], timeout: float
) -> tuple[dict[str, JobResult], dict[str, float]]:
    """Wait for every job, firing ``triggers[name]`` on job ``name`` until it returns True.
    Returns the results and, per trigger, the monotonic time it fired (missing: never)."""
    waiting = dict(triggers)
    fired: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    next_poll = 0.0
    while any(job.proc.poll() is None for job in jobs.values()):
        for name, trigger in list(waiting.items()):
            if jobs[name].proc.poll() is None and trigger(jobs[name]):
                fired[name] = time.monotonic()
                del waiting[name]
        if time.monotonic() >= next_poll:  # scontrol records vanish soon after the end
            for job in jobs.values():
                if job.proc.poll() is None or job.fields.get("JobState") not in FINAL_STATES:
                    job.poll_fields()
            next_poll = time.monotonic() + 0.5
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    results = {
        name: job.result(max(1.0, deadline - time.monotonic())) for name, job in jobs.items()
    }
    return results, fired


def as_trained(records: list[SampleRecord]) -> list[SampleRecord]:
    """A rank's sample log with replays resolved: the last record of every (iteration,
    micro-batch), in iteration order. Work redone after a crash replaces what was lost."""
    latest = {(r.iteration, r.microbatch): r for r in records}
    return [latest[key] for key in sorted(latest)]
