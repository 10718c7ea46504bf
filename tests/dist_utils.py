"""Run a function on several real ``torch.distributed`` ranks (gloo on loopback), for tests.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, gives each an initialised gloo process group,
calls ``fn(rank, world_size, *args)`` and returns the per-rank results in rank order. A rank that raises makes the
call raise with that rank's traceback; ranks that do not finish within ``timeout`` are killed and the call raises
``TimeoutError`` naming them, so a hung collective fails a test instead of hanging the suite (each such rank first
prints every thread's stack to its stderr, which pytest shows with the failure).

``fn`` must be a module-level function: a spawned rank unpickles it by its module's name, which pytest's importlib
mode makes ``tests.<folder>.<module>``, so ``run_ranks`` puts the repository root on ``sys.path`` before spawning
(children inherit it; ``python -m pytest`` has it already, the bare ``pytest`` script does not). Spawning costs
~2-4 s (each child imports torch), so put several cases in one spawned function rather than one spawn per case.

(The multi-process test folder is ``tests/distributed``, not ``tests/dist``: ``dist`` is in pytest's default
``norecursedirs``, so pytest would silently skip it.)
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonrec.dist.rendezvous import hold_local_store, init_local_rank

_REPO_ROOT = str(Path(__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def one_rank_environment() -> Iterator[None]:
    """torchrun's variables for a world of one rank (this process) on a free port, restored afterwards: what
    ``init_process_group`` and the training job read. One GPU holds one NCCL rank, so GPU tests run a world of 1."""
    variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any, pg_timeout_s: float
) -> None:
    # One intra-op thread per rank: W ranks share the machine's cores, and torch's default (one thread per core) in
    # every rank oversubscribes them (tiny ops then stall at each parallel region). The environment variable alone is
    # too late here (the spawned child has already imported torch), so set both.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a rank that overruns is asked for its stacks
    try:
        init_local_rank("gloo", port, rank, world_size, datetime.timedelta(seconds=pg_timeout_s))
        # Pickled here, by value: the queue's own pickler would share tensors through handles that the parent
        # fetches from this process later (gone once it exits), and its feeder thread drops an object it cannot
        # pickle with only a printed error, so the parent would wait for a result that never comes.
        payload = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # report everything, including assertion errors, to the parent
        payload = (rank, False, traceback.format_exc())
    try:
        results.put(payload)
        results.close()
        results.join_thread()  # the result is in the pipe before this rank tears anything down
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, pg_timeout_s: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results in rank order."""
    if _REPO_ROOT not in sys.path:  # see the module docstring
        sys.path.append(_REPO_ROOT)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = hold_local_store()  # the ranks' rendezvous, bound here until they finish (no probed port to race for)
    port = store.port
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results, pg_timeout_s), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(outputs) + len(errors) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if not ok:  # the other ranks may now block in a collective until the group timeout: do not wait for it
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=3))
    finally:
        overran = [proc for rank, proc in enumerate(procs) if rank not in outputs and rank not in errors]
        if overran and not errors:  # stacks of the ranks that did not finish, on their stderr, before the kill
            for proc in overran:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
        for proc in procs:
            proc.join(timeout=1 if errors else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        first = min(errors)
        raise AssertionError(f"rank {first} of {world_size} failed:\n{errors[first]}")
    missing = [r for r in range(world_size) if r not in outputs]
    if missing:
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout} s")
    return [outputs[r] for r in range(world_size)]
