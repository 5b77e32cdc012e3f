"""A multi-node Slurm cluster on one machine: every node is a network namespace.

Why: the single-node cluster (``tests/support/slurm_local_cluster.sh``) runs every task on
``localhost``, so it cannot catch what only breaks across nodes: resolving MASTER_ADDR, which
host serves the c10d rendezvous, which address gloo binds, srun talking to a remote slurmd.
Here node ``nK`` is the namespace ``<prefix>-nK`` (see :mod:`netns`) with its own
address on a private bridge, its own hostname (a UTS namespace: ``hostname`` says ``nK``, as on
a real node) and its own /etc/hosts and resolv.conf (bind-mounted from /etc/netns/<ns>/, as
``ip netns exec`` does), running its own slurmd (``-N nK``); job steps inherit all of that.
slurmctld and munged run in the root namespace, slurmctld on the bridge address, munge through
its unix-domain socket (filesystem sockets work across network namespaces).

Defaults (prefix ``mx``, subnet ``10.123.0``)::

    root ns  bridge mx-br 10.123.0.1/24; slurmctld (SlurmctldHost=localhost(10.123.0.1)); munged
    mx-n1    mx0 10.123.0.11/24 (veth, root end mx-n1h on mx-br), hostname n1, slurmd -N n1
    mx-n2    mx0 10.123.0.12/24 ...                                hostname n2, slurmd -N n2

Everything the cluster writes lives under one directory (``slurm.conf``, state/, spool/<node>,
run/, log/, munge/, ``cluster.json``) plus /etc/netns/<ns>/. :func:`stop` is idempotent and
removes exactly what :func:`start` recorded. Settings as in tests/support/slurm_local_cluster.sh
(cred_expire=5, sched_interval=2, config_overrides, no cgroups, SlurmUser=root), plus
``MessageTimeout=30`` (above KillWait=10): srun's kill-on-bad-exit goes through slurmctld,
and a slurmd answers it only after the step's processes are gone (up to KillWait); a reply
later than MessageTimeout makes slurmctld resend it ~60 s later, and with cred_expire=5 a
requeued job already runs again by then, under the same step id, and gets killed. Clients
(sbatch, scontrol) run in the root namespace with ``SLURM_CONF`` (:attr:`NetnsSlurm.env`).

CLI (root, from the repository root)::

    python -m tests.support.netns_slurm start DIR [--nodes 2]   # prints export SLURM_CONF=...
    python -m tests.support.netns_slurm exec DIR n2 -- hostname -I  # as a task on n2 would
    python -m tests.support.netns_slurm status DIR
    python -m tests.support.netns_slurm stop DIR
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.support.netns import (
    ClusterError,
    ClusterUnavailable,
    Node,
    State,
    alive,
    check_free,
    kill,
    make_network,
    remove_network,
)

__all__ = ["ClusterError", "ClusterUnavailable", "NetnsSlurm", "Node", "start", "stop"]

SBIN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
SLURMD_PORT = 6818  # Slurm's default: each slurmd has a network namespace of its own
NEEDED = (
    "ip",
    "unshare",
    "nsenter",
    "mount",
    "hostname",
    "munged",
    "slurmctld",
    "slurmd",
    "sinfo",
    "scontrol",
    "squeue",
    "scancel",
)
# What `ip netns exec NS` does (bind-mount /etc/netns/NS/* over /etc/*) minus its remount of
# /sys: a fresh sysfs has no /sys/fs/cgroup, and slurmd 22.05 then dies with "Unable to
# initialize cgroup plugin" even with proctrack/linuxproc. Run in private mount + UTS
# namespaces (unshare) and the node's network namespace (nsenter).
NODE_SHELL = (
    'for f in /etc/netns/"$1"/*; do mount --bind "$f" "/etc/${f##*/}" || exit 1; done && '
    'hostname "$2" && exec slurmd -D -N "$2" -f "$3"'
)
_LEAKY = re.compile(r"^(SLURM_|SBATCH_|SRUN_|SALLOC_)")


def client_env(conf: Path) -> dict[str, str]:
    """Caller's environment minus any surrounding job's SLURM_* variables, plus SLURM_CONF."""
    env = {k: v for k, v in os.environ.items() if not _LEAKY.match(k)}
    env["PATH"] = f"{env.get('PATH', '')}:{SBIN_PATH}".lstrip(":")
    env["SLURM_CONF"] = str(conf)
    return env


@dataclass
class NetnsSlurm:
    """A started cluster: its directory, nodes and controller address."""

    root: Path
    nodes: list[Node]
    controller_addr: str
    ctld_port: int
    startup_s: float = 0.0  # start() until every node was idle

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return client_env(self.conf)

    def run(
        self,
        *cmd: str,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        """A client command (sbatch, scontrol, ...) in the root namespace."""
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def on_node(self, name: str) -> list[str]:
        """Command prefix that runs in node ``name``'s network, UTS and mount namespaces, as its
        job steps do: nsenter into its slurmd."""
        state = State.load(self.root)
        if state is None or not alive(state.data["pids"].get(f"slurmd-{name}", -1)):
            raise ClusterError(f"node {name}'s slurmd is not running")
        pid = state.data["pids"][f"slurmd-{name}"]
        return ["nsenter", f"--target={pid}", "--net", "--uts", "--mount", "--"]

    def node_states(self) -> dict[str, str]:
        """``sinfo`` state per node (idle, alloc, down*, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def stop(self) -> None:
        stop(self.root)


def _preflight() -> None:
    if os.geteuid() != 0:
        raise ClusterUnavailable("network namespaces and SlurmUser=root need root; not root")
    path = f"{os.environ.get('PATH', '')}:{SBIN_PATH}"
    missing = [exe for exe in NEEDED if shutil.which(exe, path=path) is None]
    if missing:
        raise ClusterUnavailable(
            f"missing commands: {' '.join(missing)} (apt-get install -y "
            "iproute2 util-linux mount slurmctld slurmd slurm-client munge)"
        )


def _write_conf(root: Path, nodes: Sequence[Node], ctl_addr: str, ctld_port: int) -> Path:
    # More CPUs than the machine may have (config_overrides): tests run several jobs side by
    # side, 1 CPU per node each.
    cpus = max(8, os.cpu_count() or 2)
    match = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
    mem = int(match[1]) // 1024 if match else 4096
    node_lines = "".join(
        f"NodeName={n.name} NodeAddr={n.address} NodeHostname={n.name} "
        f"CPUs={cpus} RealMemory={mem} State=UNKNOWN\n"
        for n in nodes
    )
    conf = root / "slurm.conf"
    conf.write_text(f"""\
# Written by tests/support/netns_slurm.py: {len(nodes)} namespace nodes, cluster dir {root}
ClusterName=mxnetns
SlurmctldHost=localhost({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=5
KillWait=10
MessageTimeout=30
JobRequeue=1
{node_lines}PartitionName=netns Nodes={",".join(n.name for n in nodes)} Default=YES \
MaxTime=INFINITE State=UP
""")
    return conf


def _spawn(state: State, root: Path, name: str, cmd: Sequence[str]) -> None:
    """Start a daemon in its own session, output to log/<name>.out; record its PID."""
    with open(root / "log" / f"{name}.out", "ab") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=client_env(root / "slurm.conf"),
        )
    state.data["pids"][name] = proc.pid
    state.save()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logs(root: Path, lines: int = 15) -> str:
    parts = []
    for path in sorted([*root.glob("log/*"), root / "munge" / "munged.log"]):
        if path.is_file() and path.stat().st_size:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"---- {path}\n" + "\n".join(tail))
    return "\n".join(parts)


def _wait(state: State, what: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [name for name, pid in state.data["pids"].items() if not alive(pid)]
        if dead:
            raise ClusterError(f"{', '.join(dead)} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def start(
    root: Path | str | None = None,
    nodes: int = 2,
    prefix: str = "mx",
    subnet: str = "10.123.0",
    timeout: float = 60,
) -> NetnsSlurm:
    """Build the namespaces, start munged, slurmctld and one slurmd per node, and wait until
    every node is idle. Raises :class:`ClusterUnavailable` when this machine cannot do it and
    :class:`ClusterError` (with the daemons' logs) when a daemon fails; whatever was made by
    then is removed again."""
    t0 = time.monotonic()
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix) or not 1 <= nodes <= 99:
        raise ValueError(f"prefix {prefix!r} must be [a-z][a-z0-9]{{0,7}}; nodes 1..99")
    if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet):
        raise ValueError(f"subnet {subnet!r}: want the first three octets, e.g. 10.123.0")
    _preflight()
    root = Path(root or tempfile.mkdtemp(prefix=f"{prefix}-netns-slurm-")).resolve()
    old = State.load(root)
    if old is not None and old.leftovers():
        raise ClusterError(f"{root} holds a cluster ({old.leftovers()}); stop it first")
    try:
        check_free(prefix, subnet, nodes)
    except ClusterError as exc:
        raise ClusterUnavailable(str(exc)) from None
    for sub in ("state", "run", "log", "munge", *(f"spool/n{i}" for i in range(1, nodes + 1))):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    state = State(root / "cluster.json")
    state.save()
    ctl = f"{subnet}.1"
    try:
        try:
            node_list = make_network(state, prefix, subnet, nodes)
        except (ClusterError, OSError) as exc:
            raise ClusterUnavailable(f"cannot build the namespace network here: {exc}") from None
        ctld_port = _free_port()
        state.data["cluster"] = {
            "nodes": [asdict(n) for n in node_list],
            "controller_addr": ctl,
            "ctld_port": ctld_port,
        }
        state.save()
        conf = _write_conf(root, node_list, ctl, ctld_port)
        m = root / "munge"
        system_key = Path("/etc/munge/munge.key")
        (m / "munge.key").write_bytes(
            system_key.read_bytes() if os.access(system_key, os.R_OK) else os.urandom(1024)
        )
        (m / "munge.key").chmod(0o600)
        _spawn(
            state,
            root,
            "munged",
            [
                "munged",
                "-F",
                "--force",
                f"--socket={m}/munge.socket",
                f"--key-file={m}/munge.key",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
        )
        _wait(state, "the munge socket", (m / "munge.socket").is_socket, 10)
        _spawn(state, root, "slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)])
        for node in node_list:
            # unshare, nsenter and sh all exec in place: the PID recorded is slurmd's own.
            _spawn(
                state,
                root,
                f"slurmd-{node.name}",
                [
                    "unshare",
                    "--mount",
                    "--uts",
                    "--",
                    "nsenter",
                    f"--net=/run/netns/{node.namespace}",
                    "--",
                    "sh",
                    "-c",
                    NODE_SHELL,
                    "sh",
                    node.namespace,
                    node.name,
                    str(conf),
                ],
            )
        cluster = NetnsSlurm(root, node_list, ctl, ctld_port)
        resumed: set[str] = set()

        def all_idle() -> bool:
            states = cluster.node_states()
            for name, st in states.items():
                if st.startswith(("drain", "down")) and name not in resumed:
                    resumed.add(name)  # a stale reason; config_overrides should prevent it
                    cluster.run(
                        "scontrol", "update", f"nodename={name}", "state=resume", check=False
                    )
            return len(states) == nodes and all(st == "idle" for st in states.values())

        _wait(state, "every node to be idle", all_idle, timeout)
    except BaseException as exc:
        logs = _logs(root)
        stop(root)
        if isinstance(exc, ClusterError):
            raise type(exc)(f"{exc}\n{logs}" if logs else str(exc)) from None
        raise
    cluster.startup_s = time.monotonic() - t0
    return cluster


def stop(root: Path | str, timeout: float = 30) -> None:
    """Cancel jobs, stop the daemons by PID (slurmds, slurmctld, munged), then remove the
    network (:func:`netns.remove_network`). Idempotent; raises if anything is left."""
    root = Path(root)
    state = State.load(root)
    if state is None:
        return
    deadline = time.monotonic() + timeout
    env = client_env(root / "slurm.conf")
    pids: dict[str, int] = state.data["pids"]

    def queued() -> list[str]:
        return subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30
        ).stdout.split()

    if alive(pids.get("slurmctld", -1)) and queued():
        subprocess.run(["scancel", *queued()], env=env, capture_output=True, timeout=30)
        while queued() and time.monotonic() < deadline:
            time.sleep(0.2)
    for name in sorted(pids, key=lambda n: (not n.startswith("slurmd-"), n == "munged")):
        kill(pids[name], name.split("-")[0], grace=max(5.0, deadline - time.monotonic()))
    state.data["pids"] = {n: p for n, p in pids.items() if alive(p)}
    remove_network(state)
    if state.leftovers():
        raise ClusterError(f"teardown of {root} left {state.leftovers()}")


def _load(root: Path) -> NetnsSlurm:
    state = State.load(root)
    if state is None or "cluster" not in state.data or not state.leftovers():
        raise ClusterError(f"no running cluster in {root}")
    info = state.data["cluster"]
    return NetnsSlurm(
        root, [Node(**n) for n in info["nodes"]], info["controller_addr"], info["ctld_port"]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: start / stop / status / exec (see the module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_start = sub.add_parser("start", help="start a cluster in DIR")
    p_start.add_argument("dir")
    p_start.add_argument("--nodes", type=int, default=2)
    p_start.add_argument("--prefix", default="mx", help="namespace/link name prefix (mx)")
    p_start.add_argument("--subnet", default="10.123.0", help="a.b.c of the /24 (10.123.0)")
    sub.add_parser("stop", help="stop it and remove its namespaces").add_argument("dir")
    sub.add_parser("status", help="daemons and nodes").add_argument("dir")
    p_exec = sub.add_parser("exec", help="run a command on a node, as its job steps run")
    p_exec.add_argument("dir")
    p_exec.add_argument("node")
    p_exec.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    root = Path(args.dir).resolve()
    try:
        if args.cmd == "start":
            cluster = start(root, args.nodes, args.prefix, args.subnet)
            print(
                f"# {len(cluster.nodes)} nodes idle after {cluster.startup_s:.1f} s: "
                + " ".join(f"{n.name}={n.address}" for n in cluster.nodes),
                file=sys.stderr,
            )
            print(f"export SLURM_CONF={shlex.quote(str(cluster.conf))}")
        elif args.cmd == "stop":
            stop(root)
        elif args.cmd == "status":
            cluster = _load(root)
            for name, pid in State.load(root).data["pids"].items():  # type: ignore[union-attr]
                print(f"{name}: {'running' if alive(pid) else 'stopped'} (pid {pid})")
            print(cluster.run("sinfo", "-N", "-o", "%N %t %c %E", check=False).stdout, end="")
        else:
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            return subprocess.run([*_load(root).on_node(args.node), *command]).returncode
    except ClusterError as exc:
        print(f"netns_slurm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
