"""One gloo all-reduce across the nodes of a Slurm step; prints the addresses gloo connected.

Why: when a multi-node CPU run fails, the question is nearly always "which address did gloo
bind, and did the pair connect node to node?". By default gloo binds the address its host's
name resolves to (falling back to loopback, with a warning, when it resolves to nothing
bindable); GLOO_SOCKET_IFNAME picks an interface instead. This answers it in seconds, without
Megatron. Run under srun, one task per node::

    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    MASTER_PORT=29555 srun --ntasks-per-node=1 python tests/support/gloo_probe.py

Each rank prints one line ``GLOO_PROBE {"rank": .., "host": .., "sum": .., "pairs": [[local,
remote], ..]}`` (``pairs``: its established TCP connections other than the rendezvous store's).
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist


def _ip(addr: str) -> str:
    return addr.removeprefix("::ffff:")  # IPv4-mapped IPv6 (dual-stack sockets)


def main() -> None:
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    port = int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=float(os.environ.get("GLOO_PROBE_TIMEOUT", "60")))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], port, world, is_master=rank == 0, timeout=timeout
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    pairs = sorted(
        {
            (_ip(c.laddr.ip), _ip(c.raddr.ip))
            for c in psutil.Process().net_connections("tcp")
            if c.raddr
            and c.status == psutil.CONN_ESTABLISHED
            and port not in (c.laddr.port, c.raddr.port)
        }
    )
    print(
        "GLOO_PROBE "
        + json.dumps(
            {"rank": rank, "host": socket.gethostname(), "sum": total.item(), "pairs": pairs}
        ),
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
