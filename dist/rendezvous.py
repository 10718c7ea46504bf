"""Rendezvous of ranks spawned on this host, without a port race.

Probing a free port (bind to port 0, read it, close) and handing it to the ranks leaves a window in which any other
process (another test's gloo pairs, a parallel job) can take the port before rank 0 binds it, and the group then
fails to form. Instead the parent binds the rendezvous store itself, on a port the OS assigns while it is bound, and
holds it while the ranks run; every rank joins it as a client.

    store = hold_local_store()                        # parent, kept alive until the ranks finish
    ... spawn ranks with store.port ...
    init_local_rank("gloo", store.port, rank, world)  # in each rank
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from tritonrec.kernels.checks import check_int

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch.distributed's default for gloo


def hold_local_store() -> dist.TCPStore:
    """A rendezvous store on an OS-assigned loopback port (``.port``); keep a reference while the ranks run."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def init_local_rank(
    backend: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta | None = None
) -> None:
    """Join the process group of ``world_size`` local ranks whose store the parent holds at ``port``."""
    port = check_int(port, "port", 1, 65535, what="a TCP port in [1, 65535]")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
    timeout = timeout or _DEFAULT_TIMEOUT
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


__all__ = ["hold_local_store", "init_local_rank"]
