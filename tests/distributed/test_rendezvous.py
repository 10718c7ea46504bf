"""The local rendezvous: the parent's store is bound before any rank starts (no probed port to lose), and bad
arguments are named. Joining it is exercised by every spawned test (``dist_utils.run_ranks``)."""

from __future__ import annotations

import socket

import pytest

from tritonrec.dist.rendezvous import hold_local_store, init_local_rank


def test_the_store_holds_its_port_until_released() -> None:
    store = hold_local_store()
    port = store.port
    with socket.socket() as sock, pytest.raises(OSError):  # taken: nobody else can bind it while it is held
        sock.bind(("127.0.0.1", port))
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # and it accepts the ranks
        pass
    del store


@pytest.mark.parametrize(("port", "rank", "world", "pattern"), [
    (0, 0, 2, r"port must be a TCP port in \[1, 65535\], got port=0"),
    (70000, 0, 2, r"got port=70000"),
    ("29500", 0, 2, r"got port='29500'"),
    (29500, 2, 2, r"rank must be in \[0, world_size=2\), got rank=2"),
    (29500, -1, 2, r"got rank=-1"),
])  # fmt: skip
def test_bad_arguments_are_named(port: object, rank: int, world: int, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        init_local_rank("gloo", port, rank, world)  # type: ignore[arg-type]
