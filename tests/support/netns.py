"""Namespace "nodes" on one machine: a bridge, one network namespace and veth pair per node.

Why a module of its own: the network is what makes a node a node (its own address, hostname
resolution, loopback), and later drills (cutting a node off, killing one) act on it without
caring about Slurm. :mod:`netns_slurm` puts the Slurm daemons on top.

Containment rules of this workplace, enforced here: addresses only on interfaces made here
(``<subnet>.0/24``), no default route in the namespaces, no forwarding or NAT, IPv6 off on every
new interface, and each node's resolv.conf names its own loopback, so nothing but loopback and
these addresses is ever contacted. Everything made is recorded in a :class:`State` file as it is
made, so :func:`remove_network` deletes exactly that, also after a crash, and is idempotent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IFACE = "mx0"  # the same interface name on every node, as on a real cluster (GLOO_SOCKET_IFNAME)
STATE_FILE = "cluster.json"
ETC_NETNS = Path("/etc/netns")


class ClusterError(RuntimeError):
    """The cluster failed to start or stop; the message says why (with the daemon logs)."""


class ClusterUnavailable(ClusterError):
    """This machine cannot host the cluster at all (not root, commands missing, namespaces,
    veth or bridges refused, names or subnet taken): tests may skip on it, except on CI."""


@dataclass(frozen=True)
class Node:
    """One namespace node."""

    name: str  # Slurm NodeName, also its hostname and its name in the hosts files
    namespace: str  # network namespace
    address: str  # IPv4 address of IFACE inside the namespace
    host_link: str  # root-namespace end of its veth pair, on the bridge


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a set-up command; failures name the command and its stderr (the reason to report)."""
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise ClusterError(
            f"`{shlex.join(cmd)}` failed ({result.returncode}): "
            f"{(result.stderr or result.stdout).strip()}"
        )
    return result


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (PID 1 here does not reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _reap(pid: int) -> None:
    # Not our child (the CLI started it): PID 1 keeps the zombie.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def kill(pid: int, expect: str | None, grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; ``expect`` (a word of the command line)
    guards against a PID reused by someone else's process."""
    if not alive(pid):
        _reap(pid)
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return
    if expect and expect not in cmdline:
        return
    os.kill(pid, 15)
    until = time.monotonic() + grace
    while alive(pid) and time.monotonic() < until:
        _reap(pid)
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, 9)
        time.sleep(0.2)
    _reap(pid)


class State:
    """``cluster.json``: what exists, written as each thing is made (so teardown is exact)."""

    def __init__(self, path: Path, data: dict[str, Any] | None = None) -> None:
        self.path = path
        self.data: dict[str, Any] = data or {
            "namespaces": [],
            "links": [],
            "etc_netns": [],
            "pids": {},
        }

    @classmethod
    def load(cls, root: Path) -> State | None:
        path = root / STATE_FILE
        return cls(path, json.loads(path.read_text())) if path.exists() else None

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def add(self, key: str, value: str) -> None:
        self.data[key].append(value)
        self.save()

    def leftovers(self) -> dict[str, Any]:
        """Whatever still exists (empty after a complete teardown)."""
        return {k: v for k, v in self.data.items() if k != "cluster" and v}


def check_free(prefix: str, subnet: str, count: int) -> None:
    """Refuse names or a subnet that something else here already uses."""
    existing = set(sh("ip", "netns", "list").stdout.split())
    taken = [f"{prefix}-n{i}" for i in range(1, count + 1) if f"{prefix}-n{i}" in existing]
    if taken:
        raise ClusterUnavailable(
            f"namespaces {taken} exist already: another cluster with "
            f"prefix {prefix!r}? stop it or use another prefix"
        )
    if f" {subnet}." in sh("ip", "-4", "-o", "addr").stdout:
        raise ClusterUnavailable(f"{subnet}.0/24 is already used by an interface here")


def make_network(state: State, prefix: str, subnet: str, count: int) -> list[Node]:
    """Bridge ``<prefix>-br`` (``<subnet>.1``) and, per node, namespace ``<prefix>-nK`` with
    ``IFACE`` at ``<subnet>.(10+K)``, plus /etc/netns/<ns>/hosts naming every node."""
    bridge = f"{prefix}-br"
    sh("ip", "link", "add", bridge, "type", "bridge")
    state.add("links", bridge)
    _no_ipv6(bridge)
    sh("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    nodes = [
        Node(f"n{i}", f"{prefix}-n{i}", f"{subnet}.{10 + i}", f"{prefix}-n{i}h")
        for i in range(1, count + 1)
    ]
    # A node's own name must resolve to its bridge address, never to 127.x (as Debian's
    # "127.0.1.1 hostname" line would): gloo and torchrun resolve the hostname to pick theirs.
    hosts = "".join(
        [
            "127.0.0.1 localhost\n",
            f"{subnet}.1 {prefix}-ctl\n",
            *(f"{n.address} {n.name}\n" for n in nodes),
        ]
    )
    if not ETC_NETNS.is_dir():
        ETC_NETNS.mkdir(parents=True)
        state.add("etc_netns", str(ETC_NETNS))  # removed last, when empty
    for node in nodes:
        ns = node.namespace
        sh("ip", "netns", "add", ns)
        state.add("namespaces", ns)
        etc = ETC_NETNS / ns
        etc.mkdir(parents=True, exist_ok=False)
        state.add("etc_netns", str(etc))
        (etc / "hosts").write_text(hosts)
        # Lookups of unknown names go to this node's own loopback (refused at once), never out.
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        peer = f"{node.host_link[:-1]}p"
        sh("ip", "link", "add", node.host_link, "type", "veth", "peer", "name", peer)
        state.add("links", node.host_link)  # deleting one end deletes the pair
        _no_ipv6(node.host_link)
        sh("ip", "link", "set", node.host_link, "master", bridge, "up")
        sh("ip", "link", "set", peer, "netns", ns)
        sh("ip", "-n", ns, "link", "set", peer, "name", IFACE)
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "sh",
            "-c",
            "for f in /proc/sys/net/ipv6/conf/*/disable_ipv6; do echo 1 >$f; done 2>/dev/null; :",
        )
        sh("ip", "-n", ns, "addr", "add", f"{node.address}/24", "dev", IFACE)
        sh("ip", "-n", ns, "link", "set", IFACE, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    return nodes


def _no_ipv6(link: str) -> None:
    flag = Path(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6")
    if flag.exists():
        flag.write_text("1\n")


def remove_network(state: State) -> None:
    """Kill what still runs in the namespaces (only our jobs can: they are ours), delete the
    namespaces, links and /etc/netns entries recorded in ``state``. Idempotent."""
    listed = set(sh("ip", "netns", "list").stdout.split())
    for ns in list(state.data["namespaces"]):
        if ns in listed:
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                kill(int(pid), None, grace=5)
            sh("ip", "netns", "del", ns, check=False)
        if ns not in sh("ip", "netns", "list").stdout.split():
            state.data["namespaces"].remove(ns)
    for link in list(state.data["links"]):
        if sh("ip", "link", "show", link, check=False).returncode == 0:
            sh("ip", "link", "del", link, check=False)
        if sh("ip", "link", "show", link, check=False).returncode != 0:
            state.data["links"].remove(link)
    for etc in reversed(state.data["etc_netns"][:]):
        if Path(etc) == ETC_NETNS:  # made by us; another cluster may still have entries in it
            if Path(etc).is_dir() and not any(Path(etc).iterdir()):
                Path(etc).rmdir()
        else:
            shutil.rmtree(etc, ignore_errors=True)
            if Path(etc).exists():
                continue
        state.data["etc_netns"].remove(etc)
    state.save()
