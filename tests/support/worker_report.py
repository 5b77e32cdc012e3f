"""Test-only: what one training worker sees of the c10d rendezvous, printed before it starts.

Why: torchrun's own INFO lines print the rendezvous addresses as garbage (a torch bug), so
the multi-node tests run every worker through a wrapper (``multinode.WORKER_PYTHON``) that
runs this first. It prints one line to stderr (the job's output)::

    WORKER {"rank": 1, "group_rank": 1, "host": "n2", "addrs": ["10.123.1.12"],
            "master": "n1", "master_ip": "10.123.1.11", "rdzv_listener": false,
            "rdzv_conns": [["10.123.1.12", "10.123.1.11"]]}

``rdzv_conns``: established TCP connections of this node's network namespace with the
rendezvous port (``RDZV_PORT``) at either end, as (local, remote) addresses: on the endpoint's
node the store's accepted connections, elsewhere the agent's connection to it. The torchrun
agents hold them while the workers run, so they show the rendezvous across the node addresses.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import psutil


def _ip(addr: str) -> str:
    return addr.removeprefix("::ffff:")  # IPv4-mapped IPv6 (dual-stack sockets)


def main() -> None:
    port = int(os.environ["RDZV_PORT"])
    conns = psutil.net_connections("tcp")  # /proc/net/tcp*: this network namespace's sockets
    master = os.environ.get("MASTER_ADDR", "")
    try:
        master_ip = socket.gethostbyname(master)
    except OSError:
        master_ip = ""
    report = {
        "rank": int(os.environ["RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "host": socket.gethostname(),
        "addrs": sorted(
            a.address
            for nic, addrs in psutil.net_if_addrs().items()
            for a in addrs
            if a.family == socket.AF_INET and nic != "lo"
        ),
        "master": master,
        "master_ip": master_ip,
        "rdzv_listener": any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns
        ),
        "rdzv_conns": sorted(
            {
                (_ip(c.laddr.ip), _ip(c.raddr.ip))
                for c in conns
                if c.raddr
                and c.status == psutil.CONN_ESTABLISHED
                and port in (c.laddr.port, c.raddr.port)
            }
        ),
    }
    print("WORKER " + json.dumps(report), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
