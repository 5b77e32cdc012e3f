"""Two Slurm nodes on one machine (network namespaces), and the real launch script across them.

The cluster is ``tests/support/netns_slurm.py`` (via ``multinode.py``): nodes ``n1`` and
``n2`` are network namespaces with their own addresses on a private bridge, hostnames and
/etc/hosts, each with its own slurmd; slurmctld and munged run in the root namespace. Every
job goes through ``sbatch --nodes=2``; what the tests assert comes from ``sbatch --wait``'s exit
code, ``scontrol show job``, the job output and the files the training wrote.

* where tasks run: ``srun`` puts one task on each node, each sees its own name and address and
  resolves the first host of the allocation (MASTER_ADDR) to n1's address;
* gloo across nodes (``gloo_probe.py``): pairs connect n1's address to n2's, by default (each
  node's hostname resolves to its own address) and with ``GLOO_SOCKET_IFNAME`` on nodes whose
  hostname resolves to nothing (gloo would otherwise fall back to loopback and fail);
* three training jobs of ``launch/pretrain_gpt_ext.sbatch``, torchrun with one rank per node
  (DP=2) training the tiny model through the CPU harness, submitted together (they share the
  nodes; a launch costs far more than the iterations it trains):

  - ``normal``: completes; the c10d rendezvous endpoint is n1, its store listens there only
    and holds connections from both node addresses; both ranks train disjoint samples. It is
    the uninterrupted reference of the next one.
  - ``interrupted``: first the preemption warning (``scancel --signal=USR1 --batch``) once
    training runs: the job saves, requeues itself and resumes exactly where it stopped. Then,
    after the requeued run's first checkpoint, n2's training worker is SIGKILLed: the
    supervisor names the rank and node and requeues by the exit-code policy (137: restart
    within MAX_RESTARTS). Per-rank samples and losses equal ``normal``'s, bit for bit (what
    the kill lost is trained again after the resume).
  - ``drill``: the spike drill with the bad batches on DP rank 1 (n2): both nodes' ranks exit
    42, the batch step's supervisor (on n1) plans and applies one rollback, once, and the
    relaunch on both nodes completes.
  - ``hang``: rank 1's forward (on n2) sleeps for an hour at iteration 12, once: the hang
    watchdogs of both nodes meet in the launch state on the shared filesystem, both dump their
    stacks and exit 43, the supervisor names rank 1 and requeues; the job completes.
  - ``hang-again``: the same hang in every attempt: one requeue, then the supervisor says it
    repeats and the job fails with 43.

* the cluster tooling: teardown removes every namespace, link and /etc/netns entry it made
  and is idempotent; a second cluster with the same names is refused, not merged.

Skipped when this machine cannot build the cluster (not root, Slurm missing and not
installable, namespaces refused), and never when ``CI`` is set: then it fails with the reason.
Timings are printed (``pytest -s``) as ``[timing] ...`` lines.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.common.files import SKIPPED_ITERATIONS_FILE, incident_stem, rolled_back_dir
from megatron_ext.common.records.skip_ranges import read_windows
from megatron_ext.demo import TINY_DETECTOR
from tests.support.incidents import SITECUSTOMIZE
from tests.support.multinode import (
    PREFIX,
    TWO_NODES,
    TwoNodeSlurm,
    as_trained,
    ensure_two_nodes,
    run_together,
    start_two_node_training,
    worker_reports,
)
from tests.support.netns import ETC_NETNS, IFACE, sh
from tests.support.netns_slurm import ClusterUnavailable
from tests.support.netns_slurm import start as start_netns_cluster
from tests.support.netns_slurm import stop as stop_netns_cluster
from tests.support.slurm import (
    REPO,
    JobResult,
    PendingJob,
    free_port,
    latest_checkpoint,
    sample_records,
)

pytestmark = pytest.mark.timeout(900)

TRAIN_ITERS = 40  # iterations are cheap (~0.1 s); launches are not
SAVE_INTERVAL = 10
DRILL_ITERS = 50
HANG_ITERS = 20
DRILL_SKIPPED = range(26, 38)  # rollback to checkpoint 25, then 12 batches skipped
# As the single-node drill (tests/e2e/test_slurm.py): the same DP=2 numerics.
DRILL = [*TINY_DETECTOR, "--drill-corrupt-batch", "32-36:1"]
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


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    """A running two-node namespace cluster for the session, removed afterwards."""
    cluster = ensure_two_nodes(tmp_path_factory.mktemp("netns-slurm"))
    print(f"\n[timing] two-node cluster up (nodes idle): {cluster.netns.startup_s:.1f} s")
    try:
        yield cluster
    finally:
        t0 = time.monotonic()
        cluster.stop()
        print(f"\n[timing] two-node cluster teardown: {time.monotonic() - t0:.1f} s")


def _assert(job: JobResult, ok: bool, what: str) -> None:
    assert ok, f"{what}\n{job.describe()}"


def _completed(job: JobResult, restarts: int = 0) -> None:
    _assert(job, job.returncode == 0, "sbatch --wait must return the job's exit code 0")
    _assert(
        job,
        (job.state, job.exit_code, job.restarts) == ("COMPLETED", (0, 0), restarts),
        f"scontrol must show a completed job with {restarts} restart(s)",
    )
    _assert(job, job.fields.get("NodeList") == "n[1-2]", "the job must hold both nodes")


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_tasks_run_on_both_nodes_with_their_own_addresses(
    two_nodes: TwoNodeSlurm, tmp_path: Path
) -> None:
    job = two_nodes.submit(
        _script(tmp_path / "where.sh", WHERE_SCRIPT),
        {},
        tmp_path,
        TWO_NODES,
        job_name="mx-where",
        timeout=120,
    )
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
    job = two_nodes.submit(
        _script(tmp_path / "probe.sh", PROBE_SCRIPT),
        env,
        tmp_path,
        [*TWO_NODES, "--time=3"],
        job_name="mx-gloo",
        timeout=240,
    )
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


# ---------------------------------------------------------------------------------------------
# Three training jobs, submitted together
# ---------------------------------------------------------------------------------------------

_ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|")


class Interruptions:
    """The trigger of the ``interrupted`` job, in two acts. First the preemption warning,
    once iteration 2 is logged: it lands mid-run, between the periodic checkpoints, so the
    resume depends on the save the signal asks for. Then, in the requeued run and once it
    has committed a checkpoint of its own, a SIGKILL of the training worker on n2 (as the
    out-of-memory killer would do it)."""

    def __init__(self, cluster: TwoNodeSlurm, work: Path) -> None:
        self.cluster, self.work = cluster, work
        self.preempted_at: int | None = None  # the checkpoint the preempted run saved
        self.killed: list[int] = []

    def __call__(self, job: PendingJob) -> bool:
        log = job.output
        if self.preempted_at is None:
            if not any(int(m) >= 2 for m in _ITERATION.findall(log)):
                return False
            self.cluster.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
            self.preempted_at = -1
            return False
        if self.preempted_at < 0:
            if "requeueing Slurm job" in log:
                self.preempted_at = latest_checkpoint(self.work / "ckpt")
            return False
        if latest_checkpoint(self.work / "ckpt") <= self.preempted_at:
            return False
        workers = self.cluster.workers_on("n2", str(self.work))
        for worker in workers:
            worker.kill()
            self.killed.append(worker.pid)
        return bool(workers)


def _hang_job(cluster: TwoNodeSlurm, work: Path, data_args: list[str], once: bool) -> PendingJob:
    """Rank 1 (on n2) sleeps in its forward at iteration 12: in the first attempt only, or in
    every attempt; the hang watchdog's floor at 3 s (the tiny model steps in ~0.1 s)."""
    inject = work / "inject"
    inject.mkdir(parents=True)
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    extra_env = [
        *("PYTHONUNBUFFERED=1", "LOGLEVEL=INFO", f"MEGATRON_EXT_HARNESS_COUNTS={work}/counts"),
        *(f"PYTHONPATH={inject}:{REPO}", "INJECT_HANG_AT=12", "INJECT_HANG_RANK=1"),
        f"INJECT_ONCE_FILE={inject / 'fired'}",
        *(["INJECT_HANG_ONCE=1"] if once else []),
    ]
    return start_two_node_training(
        cluster,
        work,
        data_args,
        ["--signals-dir", str(work / "signals"), "--hang-min-timeout", "3"],
        train_iters=HANG_ITERS,
        save_interval=5,
        job_name=f"mx-{work.name}",
        EXTRA_ENV=" ".join(extra_env),
    )


@pytest.fixture(scope="module")
def jobs(two_nodes: TwoNodeSlurm, tmp_path_factory, data_args: list[str]) -> dict:
    """Submit the three jobs at once, act on the interrupted one at its moments, wait for all.
    (One job for both interruptions: every launch costs more than the iterations it trains.)"""
    root = tmp_path_factory.mktemp("netns-jobs")
    work = {name: root / name for name in ("normal", "interrupted", "drill")}
    t0 = time.monotonic()
    pending = {
        name: start_two_node_training(
            two_nodes,
            work[name],
            data_args,
            train_iters=TRAIN_ITERS,
            save_interval=SAVE_INTERVAL,
            job_name=f"mx-{name}",
        )
        for name in ("normal", "interrupted")
    }
    for name, once in (("hang", True), ("hang-again", False)):
        pending[name] = _hang_job(two_nodes, root / name, data_args, once)
        work[name] = root / name
    pending["drill"] = start_two_node_training(
        two_nodes,
        work["drill"],
        data_args,
        ["--signals-dir", str(work["drill"] / "signals"), *DRILL],
        train_iters=DRILL_ITERS,
        save_interval=5,
        job_name="mx-drill",
        MAX_ROLLBACKS="2",
        SKIPLIST_ARGS="--rollback-iters 5 --skip-batches 12",
    )
    interruptions = Interruptions(two_nodes, work["interrupted"])
    results, _ = run_together(pending, {"interrupted": interruptions}, timeout=800)
    print(f"\n[timing] five 2-node jobs, submitted together: {time.monotonic() - t0:.1f} s")
    for name, job in results.items():
        print(f"[timing]   {name}: Slurm RunTime {job.fields.get('RunTime')}")
    return {"results": results, "work": work, "interruptions": interruptions}


def test_dp2_job_with_one_rank_per_node_completes_rendezvousing_across_both_nodes(
    two_nodes: TwoNodeSlurm, jobs: dict
) -> None:
    job, work = jobs["results"]["normal"], jobs["work"]["normal"]
    _completed(job)
    log = job.output
    n1, n2 = two_nodes.addr["n1"], two_nodes.addr["n2"]
    _assert(
        job,
        re.search(
            r"\+ srun --nodes=2 --ntasks=2 --ntasks-per-node=1 .*--nnodes 2 "
            r"--nproc-per-node 1 .*--rdzv-backend c10d --rdzv-endpoint n1:",
            log,
        )
        is not None,
        "the launch script must start torchrun once per node, rendezvous at n1",
    )
    _assert(job, job.fields.get("BatchHost") == "n1", "the batch step runs on the first node")
    workers = {w["rank"]: w for w in worker_reports(log)}
    _assert(
        job,
        len(worker_reports(log)) == 2
        and [(workers[r]["host"], workers[r]["group_rank"]) for r in (0, 1)]
        == [("n1", 0), ("n2", 1)],
        f"one worker (rank) must run on each node, n1 being group rank 0: {workers}",
    )
    for w in workers.values():
        _assert(job, w["addrs"] == [two_nodes.addr[w["host"]]], f"node address: {w}")
        _assert(job, (w["master"], w["master_ip"]) == ("n1", n1), f"MASTER_ADDR is n1: {w}")
    # The c10d rendezvous across the two node addresses: the store listens on n1 only and
    # holds a connection from n2's address; n2's agent is connected from its address to n1's.
    _assert(job, workers[0]["rdzv_listener"], f"the store must listen on n1: {workers[0]}")
    _assert(job, not workers[1]["rdzv_listener"], f"and not on n2: {workers[1]}")
    _assert(job, [n1, n2] in workers[0]["rdzv_conns"], f"n1 store <- n2: {workers[0]}")
    _assert(job, [n2, n1] in workers[1]["rdzv_conns"], f"n2 agent -> n1: {workers[1]}")
    _assert(job, "data-parallel size: 2" in log, "Megatron must see DP=2")
    _assert(job, "loopback address as fallback" not in log, "gloo must not bind loopback")
    _assert(job, "training finished successfully" in log, "the supervisor must report it")
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


def _resumed_at(after: str) -> int | None:
    found = re.search(r"loading checkpoint from \S+ at iteration (\d+)", after) or re.search(
        r"successfully loaded checkpoint .* at iteration\s+(\d+)", after
    )
    return int(found[1]) if found else None


def _interrupted(jobs: dict) -> tuple[JobResult, Path, list[str]]:
    """The interrupted job, its work dir and its log cut at each requeue (3 runs)."""
    job, work = jobs["results"]["interrupted"], jobs["work"]["interrupted"]
    runs = job.output.split(f"requeueing Slurm job {job.job_id} ")
    _assert(job, len(runs) == 3, "the job must have been requeued twice")
    _completed(job, restarts=2)
    return job, work, runs


def test_preemption_of_the_two_node_job_saves_requeues_and_resumes_exactly(jobs: dict) -> None:
    job, work, (first, second, _) = _interrupted(jobs)
    _assert(
        job,
        "received SIGUSR1" in first and second.startswith("(time limit / preemption warning"),
        "the supervisor must requeue on the warning signal",
    )
    _assert(
        job,
        "exiting program after receiving SIGTERM" in first,
        "Megatron's --exit-signal-handler must have stopped the training",
    )
    saved = [
        int(m) for m in re.findall(r"successfully saved checkpoint from iteration\s+(\d+)", first)
    ]
    _assert(
        job,
        bool(saved) and 2 <= saved[-1] < TRAIN_ITERS and saved[-1] % SAVE_INTERVAL != 0,
        f"the signal must land mid-run and be followed by a save of its own (saves: {saved})",
    )
    _assert(job, f"--rdzv-id {job.job_id}-1-1" in second, "the rerun sees SLURM_RESTART_COUNT=1")
    _assert(job, _resumed_at(second) == saved[-1], f"the rerun must resume from {saved[-1]}")
    _assert(
        job,
        sorted(w["host"] for w in worker_reports(second)) == ["n1", "n2"],
        "the requeued job must run on both nodes again",
    )
    expected = sample_records(jobs["work"]["normal"] / "samples")
    got = sample_records(work / "samples")
    assert sorted(got) == [0, 1]
    for dp_rank in (0, 1):
        # Until the kill's replay: every iteration once, resumed right after the save, and
        # bit-exact (sample ids, token digests, token-summed losses, micro-batch by batch).
        recs = got[dp_rank]
        # (A kill between an iteration's last micro-batch and its save replays that iteration
        # from its first micro-batch: the order goes back, not necessarily the iteration.)
        order = [(r.iteration, r.microbatch) for r in recs]
        replay = next((i for i in range(1, len(recs)) if order[i] <= order[i - 1]), len(recs))
        assert recs[replay - 1].iteration > saved[-1], "the check must span the resume"
        assert recs[:replay] == expected[dp_rank][:replay]


def test_one_nodes_workers_killed_the_job_names_them_requeues_and_completes(jobs: dict) -> None:
    job, work, (_, second, third) = _interrupted(jobs)
    assert jobs["interruptions"].killed, "n2's worker was never found to kill"
    _assert(
        job,
        re.search(r"attempt 1: .*\brank 1 on n2 exited 137\b", second) is not None,
        "the supervisor must report how the rank on n2 ended (srun may have SIGKILLed n1's "
        "task, wrapper included, before rank 0 could report)",
    )
    _assert(
        job,
        third.startswith("(rank 1 on n2 killed by SIGKILL"),
        "the supervisor must requeue by the exit-code policy, naming the rank and node",
    )
    resumed, preempted = _resumed_at(third), _resumed_at(second)
    _assert(
        job,
        resumed is not None and preempted is not None and preempted < resumed < TRAIN_ITERS,
        f"the last run must resume from a checkpoint of the second ({preempted} < {resumed})",
    )
    _assert(job, f"--rdzv-id {job.job_id}-2-1" in third, "the rerun sees SLURM_RESTART_COUNT=2")
    assert latest_checkpoint(work / "ckpt") == TRAIN_ITERS
    expected = sample_records(jobs["work"]["normal"] / "samples")
    got = sample_records(work / "samples")
    for dp_rank in (0, 1):
        # What the kill lost was trained again after the resume; the result is the same.
        assert as_trained(got[dp_rank]) == expected[dp_rank]


def test_spike_drill_across_nodes_rolls_back_once_and_completes(jobs: dict) -> None:
    job, work = jobs["results"]["drill"], jobs["work"]["drill"]
    ckpt = work / "ckpt"
    _completed(job)
    log = job.output
    _assert(
        job,
        "attempt 1: rank 0 on n1 exited 42, rank 1 on n2 exited 42" in log,
        "the rollback exit must reach the rank on each node",
    )
    # The supervisor runs once per job, in the batch step on the first node: one plan, once.
    _assert(job, job.fields.get("BatchHost") == "n1", "the batch step runs on n1")
    _assert(
        job,
        log.count("running spike hook") == 1 and "spike hook done; relaunching" in log,
        "the planner must run once for the job, not once per node",
    )
    assert incident_stem(ckpt, 1).with_suffix(".json").is_file()
    report = incident_stem(ckpt, 1).with_suffix(".md").read_text()
    assert "culprit DP rank (max local loss): 1" in report
    assert not list(incident_stem(ckpt, 2).parent.glob(f"{incident_stem(ckpt, 2).name}*"))
    assert rolled_back_dir(ckpt, 1).is_dir() and not rolled_back_dir(ckpt, 2).exists()
    skipped = read_windows(ckpt / SKIPPED_ITERATIONS_FILE)
    assert [(w.first, w.last) for w in skipped] == [(26, 37)]  # with its samples window
    _assert(
        job,
        "attempt 2: launching" in log and "attempt 3:" not in log,
        "one relaunch in the allocation",
    )
    relaunch = log.split("attempt 2: launching", 1)[1]
    _assert(
        job,
        sorted(w["host"] for w in worker_reports(relaunch)) == ["n1", "n2"],
        "the relaunch must run on both nodes",
    )
    assert latest_checkpoint(ckpt) == DRILL_ITERS
    records = sample_records(work / "samples")
    for dp_rank in (0, 1):
        recs = records[dp_rank]
        restart = next(i for i, r in enumerate(recs) if r.iteration == DRILL_SKIPPED[-1] + 1)
        sequence = [r for r in recs[:restart] if r.iteration < DRILL_SKIPPED[0]] + recs[restart:]
        expected = [k for k in range(1, DRILL_ITERS + 1) if k not in DRILL_SKIPPED for _ in "mb"]
        assert [r.iteration for r in sequence] == expected


def test_a_hung_rank_on_the_second_node_is_named_and_the_job_completes(jobs: dict) -> None:
    job, work = jobs["results"]["hang"], jobs["work"]["hang"]
    _completed(job, restarts=1)  # under sbatch a restart is a requeue (RESTART_MODE)
    log = job.output
    _assert(
        job,
        "hang at iteration 12: rank 1 made no progress" in log
        and "attempt 1: rank 0 on n1 exited 43, rank 1 on n2 exited 43" in log
        and "requeueing Slurm job" in log,
        "the supervisor must name the hung rank and requeue",
    )
    (report,) = (work / "ckpt" / "megatron_ext_incidents").glob("hang-*.json")
    found = json.loads(report.read_text())
    assert found["hung_ranks"] == [1] and [r["host"] for r in found["ranks"]] == ["n2", "n1"]
    assert "time.sleep(3600)" in "".join(found["ranks"][0]["stacks"]["MainThread"])
    assert latest_checkpoint(work / "ckpt") == HANG_ITERS


def test_a_hang_that_comes_back_after_the_requeue_stops_the_job(jobs: dict) -> None:
    job, work = jobs["results"]["hang-again"], jobs["work"]["hang-again"]
    _assert(
        job,
        (job.returncode, job.state, job.exit_code, job.restarts) == (43, "FAILED", (43, 0), 1),
        "the repeated hang must stop the job with 43 after one requeue",
    )
    _assert(
        job,
        "the same hang as the previous attempt (same iteration, same place)" in job.output,
        "the supervisor must say the hang repeats",
    )
    reports = sorted((work / "ckpt" / "megatron_ext_incidents").glob("hang-*.md"))
    assert len(reports) == 2
    assert "repeat of the previous attempt's hang: yes" in reports[1].read_text()


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
    other.stop()
    stop_netns_cluster(other.root)  # again: nothing left to do, no error
    assert not set(made) & set(sh("ip", "netns", "list").stdout.split())
    assert sh("ip", "link", "show", "mxu-br", check=False).returncode != 0
    assert sh("ip", "link", "show", "mxu-n1h", check=False).returncode != 0
    assert not (ETC_NETNS / "mxu-n1").exists()
    assert two_nodes.netns.node_states() == {"n1": "idle", "n2": "idle"}
