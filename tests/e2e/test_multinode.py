"""Two Slurm nodes on one machine (network namespaces), and the real launch script across them.

The cluster is ``tests/support/netns_slurm.py``: nodes ``n1`` and ``n2`` are network namespaces
with their own addresses on a private bridge, hostnames and /etc/hosts, each with its own
slurmd; slurmctld and munged run in the root namespace. Everything is asserted from what Slurm
and the jobs report: ``sbatch --wait``'s exit code, ``scontrol show job`` and the job output.

* where tasks run: ``srun`` puts one task on each node, and each sees its own name and address
  and resolves the first host of the allocation (MASTER_ADDR) to n1's address;
* gloo across nodes (``tests/support/gloo_probe.py``): pairs connect n1's address to n2's,
  both by default (each node's hostname resolves to its own address, as on a real cluster)
  and with ``GLOO_SOCKET_IFNAME`` on nodes whose hostname resolves to nothing (gloo would
  otherwise fall back to loopback and fail), the variable reaching the tasks through sbatch
  and srun as a user's would;
* ``launch/pretrain_gpt_ext.sbatch`` with ``--nodes=2``, torchrun with one rank per node
  (GPUS_PER_NODE=1, DP=2) training the tiny model through the CPU harness: the job completes,
  the rendezvous endpoint is n1 (``scontrol show hostnames``), its store listens on n1 only,
  the worker on each node has that node's address and resolves MASTER_ADDR to n1's, and both
  data-parallel ranks trained every iteration on disjoint samples;
* the cluster tooling itself: teardown removes every namespace, link and /etc/netns entry it
  made and is idempotent; a second cluster with the same names is refused, not merged.

Skipped when this machine cannot build the cluster (not root, Slurm missing and not installable,
iproute2 missing (tools/setup.sh installs it), namespaces refused), and never when ``CI`` is
set: then it fails with the reason.
Timings are printed (``pytest -s``) as ``[timing] ...`` lines.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from netns import ETC_NETNS, IFACE, sh
from netns_slurm import ClusterUnavailable, NetnsSlurm
from netns_slurm import start as start_netns_cluster
from netns_slurm import stop as stop_netns_cluster
from slurm import (
    REPO,
    JobResult,
    SlurmCluster,
    free_port,
    latest_checkpoint,
    on_ci,
    sample_records,
    start_training,
)

pytestmark = pytest.mark.timeout(900)

# Not the CLI's defaults (mx, 10.123.0), so a cluster started by hand does not clash.
PREFIX, SUBNET = "mxt", "10.123.1"
TWO_NODES = ["--nodes=2"]  # after slurm.py's --nodes=1: the last one wins
TRAIN_ITERS = 12
SAVE_INTERVAL = 6  # a distributed checkpoint mid-run and one at the end, written from both nodes
GLOO_PROBE = REPO / "tests" / "support" / "gloo_probe.py"

WHERE_SCRIPT = r"""#!/bin/bash
master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export master
# shellcheck disable=SC2016  # expanded by each task's bash, on its node
srun -l bash -c 'echo "TASK rank=$SLURM_PROCID node=$SLURMD_NODENAME host=$(hostname)" \
    "addr=$(hostname -I | tr -d " ") master=$master" \
    "master_ip=$(getent hosts "$master" | cut -d" " -f1)"'
"""

PROBE_SCRIPT = r"""#!/bin/bash
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_ADDR
# shellcheck disable=SC2086  # PROBE_WRAP: zero or more words
srun -l --kill-on-bad-exit=1 $PROBE_WRAP "$PROBE_PYTHON" "$PROBE_SCRIPT"
"""

# A node whose hostname resolves to nothing (private UTS namespace for the task only).
NO_NAME_WRAPPER = r"""#!/bin/bash
exec unshare --uts sh -c 'hostname unresolvable && exec "$@"' sh "$@"
"""


# PYTHON for the launch script's workers (test-only): say where this worker runs, whether the
# c10d rendezvous store listens on its node (RDZV_PORT in its network namespace's
# /proc/net/tcp*), and what MASTER_ADDR (set by torchrun) resolves to; then exec Python.
WORKER_PYTHON = r"""#!/bin/bash
hex=$(printf ':%04X' "$RDZV_PORT")
if cat /proc/net/tcp /proc/net/tcp6 2>/dev/null |
    awk -v p="$hex" '$4 == "0A" && substr($2, length($2) - 4) == p {f = 1} END {exit !f}'; then
    rdzv=yes
else
    rdzv=no
fi
echo "WORKER rank=$RANK group_rank=$GROUP_RANK host=$(hostname)" \
    "addr=$(hostname -I | tr -d ' ') master=$MASTER_ADDR" \
    "master_ip=$(getent hosts "$MASTER_ADDR" | cut -d' ' -f1) rdzv_listener=$rdzv" >&2
exec @PYTHON@ "$@"
"""


class TwoNodeSlurm(SlurmCluster):
    """``slurm_cluster``'s sbatch helpers (submit, scontrol polling, output) on the namespace
    cluster; ``netns`` has its nodes and addresses."""

    def __init__(self, netns: NetnsSlurm) -> None:
        super().__init__(netns.root)
        self.netns = netns
        self.addr = {node.name: node.address for node in netns.nodes}

    def stop(self) -> None:
        self.netns.stop()


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    """A running two-node namespace cluster for the session, removed afterwards."""

    def cannot(reason: str) -> None:
        if on_ci():
            pytest.fail(f"CI is set, so the two-node Slurm tests must run, but: {reason}")
        pytest.skip(f"{reason} (set CI=1 to fail instead)")

    if os.geteuid() != 0:
        cannot("the namespace cluster needs root (network namespaces, SlurmUser=root)")
    installed = SlurmCluster.install()
    if installed.returncode != 0:
        cannot(
            f"Slurm is not installed and could not be installed: {installed.stderr.strip()[-800:]}"
        )
    try:
        netns = start_netns_cluster(
            tmp_path_factory.mktemp("netns-slurm"), nodes=2, prefix=PREFIX, subnet=SUBNET
        )
    except ClusterUnavailable as exc:
        cannot(f"cannot build a two-node cluster from network namespaces here: {exc}")
    print(
        f"\n[timing] two-node cluster up (namespaces + daemons, nodes idle): "
        f"{netns.startup_s:.1f} s"
    )
    cluster = TwoNodeSlurm(netns)
    try:
        yield cluster
    finally:
        t0 = time.monotonic()
        cluster.stop()
        print(f"\n[timing] two-node cluster teardown: {time.monotonic() - t0:.1f} s")


def _assert(job: JobResult, ok: bool, what: str) -> None:
    assert ok, f"{what}\n{job.describe()}"


def _completed(job: JobResult) -> None:
    _assert(job, job.returncode == 0, "sbatch --wait must return the job's exit code 0")
    _assert(
        job,
        (job.state, job.exit_code, job.restarts) == ("COMPLETED", (0, 0), 0),
        "scontrol must show a completed job with no restart",
    )
    _assert(job, job.fields.get("NodeList") == "n[1-2]", "the job must hold both nodes")


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_tasks_run_on_both_nodes_with_their_own_addresses(
    two_nodes: TwoNodeSlurm, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    job = two_nodes.submit(
        _script(tmp_path / "where.sh", WHERE_SCRIPT),
        {},
        tmp_path,
        TWO_NODES,
        job_name="mx-where",
        timeout=120,
    )
    print(f"\n[timing] sbatch -N 2 + srun on both nodes: {time.monotonic() - t0:.1f} s")
    _completed(job)
    tasks = [
        dict(kv.split("=", 1) for kv in m.split()) for m in re.findall(r"TASK (.*)", job.output)
    ]
    _assert(job, sorted(t["node"] for t in tasks) == ["n1", "n2"], "one task must run on each node")
    for task in tasks:
        _assert(job, task["host"] == task["node"], "a node's hostname must be its node name")
        _assert(
            job,
            task["addr"] == two_nodes.addr[task["node"]],
            f"{task['node']} must have its own address",
        )
        _assert(
            job,
            (task["master"], task["master_ip"]) == ("n1", two_nodes.addr["n1"]),
            "the first host of the allocation (MASTER_ADDR) must resolve to n1's address "
            "on every node",
        )


@pytest.mark.parametrize("binding", ["hostname", "GLOO_SOCKET_IFNAME"])
def test_gloo_pairs_connect_the_node_addresses(
    two_nodes: TwoNodeSlurm, tmp_path: Path, binding: str
) -> None:
    env = {
        "PROBE_PYTHON": sys.executable,
        "PROBE_SCRIPT": str(GLOO_PROBE),
        "MASTER_PORT": str(free_port()),
        "GLOO_PROBE_TIMEOUT": "60",
        "PROBE_WRAP": "",
    }
    if binding == "GLOO_SOCKET_IFNAME":
        # Hostnames that resolve to nothing would make gloo fall back to loopback (and fail
        # across nodes); the interface name from the job's environment must win.
        env["PROBE_WRAP"] = str(_script(tmp_path / "no_name.sh", NO_NAME_WRAPPER))
        env["GLOO_SOCKET_IFNAME"] = IFACE
    t0 = time.monotonic()
    job = two_nodes.submit(
        _script(tmp_path / "probe.sh", PROBE_SCRIPT),
        env,
        tmp_path,
        [*TWO_NODES, "--time=3"],
        job_name="mx-gloo",
        timeout=240,
    )
    print(f"\n[timing] gloo probe job ({binding}): {time.monotonic() - t0:.1f} s")
    _completed(job)
    probes = {
        p["rank"]: p
        for p in (json.loads(m) for m in re.findall(r"GLOO_PROBE (\{.*\})", job.output))
    }
    n1, n2 = two_nodes.addr["n1"], two_nodes.addr["n2"]
    _assert(
        job,
        sorted(probes) == [0, 1] and all(p["sum"] == 3.0 for p in probes.values()),
        "both ranks must finish the all-reduce (1 + 2)",
    )
    _assert(
        job,
        probes[0]["pairs"] == [[n1, n2]] and probes[1]["pairs"] == [[n2, n1]],
        "gloo's pair must connect n1's address to n2's (rank 0 runs on n1)",
    )
    _assert(
        job, "loopback address as fallback" not in job.output, "gloo must not fall back to loopback"
    )


def test_two_node_training_one_rank_per_node(
    two_nodes: TwoNodeSlurm, tmp_path_factory, data_args: list[str]
) -> None:
    work = tmp_path_factory.mktemp("netns-train")
    rdzv_port = str(free_port())
    worker_python = _script(
        work / "worker_python.sh", WORKER_PYTHON.replace("@PYTHON@", sys.executable)
    )
    t0 = time.monotonic()
    job = start_training(
        two_nodes,
        work,
        data_args,
        train_iters=TRAIN_ITERS,
        save_interval=SAVE_INTERVAL,
        job_name="mx-2node",
        sbatch_options=TWO_NODES,
        GPUS_PER_NODE="1",
        MASTER_PORT=rdzv_port,
        RDZV_PORT=rdzv_port,
        PYTHON=str(worker_python),
    ).result(timeout=600)
    print(
        f"\n[timing] 2-node training job ({TRAIN_ITERS} iterations, submit to end): "
        f"{time.monotonic() - t0:.1f} s (Slurm RunTime {job.fields.get('RunTime')})"
    )
    _completed(job)
    log = job.output
    _assert(
        job,
        re.search(
            r"\+ srun --nodes=2 --ntasks=2 --ntasks-per-node=1 .*--nnodes 2 "
            r"--nproc-per-node 1 .*--rdzv-backend c10d "
            rf"--rdzv-endpoint n1:{rdzv_port} ",
            log,
        )
        is not None,
        "the launch script must start torchrun once per node, rendezvous at n1",
    )
    workers = {
        int(w["rank"]): w
        for w in (
            dict(kv.split("=", 1) for kv in m.split()) for m in re.findall(r"WORKER (.*)", log)
        )
    }
    _assert(
        job,
        sorted(workers) == [0, 1] and sorted(w["host"] for w in workers.values()) == ["n1", "n2"],
        f"one worker (rank) must run on each node: {workers}",
    )
    for w in workers.values():
        _assert(
            job,
            w["addr"] == two_nodes.addr[w["host"]],
            f"the worker on {w['host']} must have that node's address: {w}",
        )
        _assert(
            job,
            (w["master"], w["master_ip"]) == ("n1", two_nodes.addr["n1"]),
            f"torchrun's MASTER_ADDR must be n1 and resolve to n1's address: {w}",
        )
        _assert(
            job,
            w["rdzv_listener"] == ("yes" if w["host"] == "n1" else "no"),
            f"the c10d rendezvous store must listen on n1 (only): {w}",
        )
    for group_rank in (0, 1):
        _assert(
            job,
            re.search(
                rf"group_rank={group_rank}\s.*?group_world_size=2\s.*?"
                r"global_world_sizes=\[2\]",
                log,
                re.S,
            )
            is not None,
            f"torchrun on some node must be group rank {group_rank} of 2 (one rank each)",
        )
    _assert(job, "data-parallel size: 2" in log, "Megatron must see DP=2")
    _assert(job, "loopback address as fallback" not in log, "gloo must not bind loopback")
    _assert(job, "training finished successfully" in log, "the launch script must report it")
    assert latest_checkpoint(work / "ckpt") == TRAIN_ITERS
    records = sample_records(work / "samples")
    assert sorted(records) == [0, 1], "both data-parallel ranks must have written sample logs"
    for recs in records.values():  # global batch 8 = DP 2 x micro-batch 2 x 2 micro-batches
        assert [r.iteration for r in recs] == [k for k in range(1, TRAIN_ITERS + 1) for _ in "mb"]
    for iteration in range(1, TRAIN_ITERS + 1):
        ids = [
            sorted(i for r in records[dp] if r.iteration == iteration for i in r.sample_ids)
            for dp in (0, 1)
        ]
        assert len(ids[0]) == len(ids[1]) == 4 and not set(ids[0]) & set(ids[1]), (
            f"iteration {iteration}: the ranks must train disjoint samples, 4 each: {ids}"
        )
    counts = sorted(p.name for p in (work / "counts").glob("rank*.json"))
    assert counts == ["rank0.json", "rank1.json"], "both ranks must have run the CPU harness"


def test_teardown_removes_everything_and_is_idempotent(
    two_nodes: TwoNodeSlurm, tmp_path: Path
) -> None:
    with pytest.raises(ClusterUnavailable, match="exist already"):
        start_netns_cluster(tmp_path / "clash", nodes=2, prefix=PREFIX, subnet="10.123.3")
    assert two_nodes.netns.node_states() == {"n1": "idle", "n2": "idle"}, (
        "a refused second cluster must leave the running one alone"
    )

    other = start_netns_cluster(tmp_path / "other", nodes=1, prefix="mxu", subnet="10.123.2")
    made = ["mxu-n1"]
    assert set(made) <= set(sh("ip", "netns", "list").stdout.split())
    t0 = time.monotonic()
    other.stop()
    print(
        f"\n[timing] one-node namespace cluster: up {other.startup_s:.1f} s, "
        f"down {time.monotonic() - t0:.1f} s"
    )
    stop_netns_cluster(other.root)  # again: nothing left to do, no error
    assert not set(made) & set(sh("ip", "netns", "list").stdout.split())
    assert sh("ip", "link", "show", "mxu-br", check=False).returncode != 0
    assert sh("ip", "link", "show", "mxu-n1h", check=False).returncode != 0
    assert not (ETC_NETNS / "mxu-n1").exists()
    assert two_nodes.netns.node_states() == {"n1": "idle", "n2": "idle"}
