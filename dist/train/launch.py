"""How the training job's processes start: under torchrun (its environment variables), spawned by the job itself
(``dist.nproc=N``), or as one process. Also the stop request that SIGTERM raises.

torchrun sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in every rank; the job
then joins that group (gloo on CPU, NCCL on CUDA). ``dist.nproc=N`` without torchrun spawns N processes on this
host; the parent holds their rendezvous store on a port the OS assigned it while bound (so no other process can take
the port between its choice and its use, as with a free port probed and released), and the ranks join it as clients
(:mod:`tritonrec.dist.rendezvous`).
A job started by torchrun with another number of ranks than ``dist.nproc`` (when set above 1) stops with an error
instead of running as independent copies.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonrec.dist.rendezvous import hold_local_store, init_local_rank

_TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
# set by spawn() in its ranks: the store at MASTER_PORT is the parent's, every rank joins it as a client
_PARENT_STORE_VAR = "TRITONREC_PARENT_STORE"


def torchrun_world_size() -> int | None:
    """The world size torchrun (or another launcher setting its variables) started, None without one."""
    if not all(v in os.environ for v in _TORCHRUN_VARS):
        return None
    return int(os.environ["WORLD_SIZE"])


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"dist.backend=nccl needs device=cuda, got device={str(device)!r} (use gloo on the CPU)")
    return backend


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: ``cuda:<LOCAL_RANK>`` for a CUDA job without an index, else ``device``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def init_process_group(backend: str, timeout_s: int) -> None:
    """Join the group described by the environment (torchrun's variables, or those :func:`spawn` sets)."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get(_PARENT_STORE_VAR) == "1":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_local_rank(backend, int(os.environ["MASTER_PORT"]), rank, world, timeout)
        return
    dist.init_process_group(backend, timeout=timeout)


def _error_path(result_path: str, rank: int) -> str:
    return os.path.join(os.path.dirname(result_path), f"rank{rank}.error.pkl")


def _ready_path(result_path: str, rank: int) -> str:
    """Written by a spawned rank once its stop handler is in: the parent forwards a stop to it only then."""
    return os.path.join(os.path.dirname(result_path), f"rank{rank}.ready")


# The parent of spawned ranks passes a SIGTERM on to them as STOP_SIGNAL, a stop request (reported as SIGTERM). Not
# as SIGTERM itself: torch.multiprocessing ends the other ranks with SIGTERM when one fails, and a rank that took
# that for a stop request outside its training loop was only killed after torch's 30 s grace period.
STOP_SIGNAL = signal.SIGUSR1
# A spawned rank's stop request before its training loop took over (its process group was coming up): the loop's
# StopRequest picks it up and stops at the first step. One after the loop (its teardown) is kept here and changes
# nothing: the run completed.
_early_signal: int | None = None


def _remember_stop(signum: int, frame: Any) -> None:
    global _early_signal
    _early_signal = signal.SIGTERM


def _die_with_parent() -> None:
    """Linux: this rank is killed when the process that spawned it dies (a parent killed while its ranks start left
    them waiting for its rendezvous store until ``dist.timeout_s``). Best effort elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def _spawned_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, result_path: str) -> None:
    _die_with_parent()
    signal.signal(STOP_SIGNAL, _remember_stop)
    with open(_ready_path(result_path, rank), "wb"):
        pass
    os.environ.update(
        {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), _PARENT_STORE_VAR: "1"}
    )  # fmt: skip
    try:
        result = fn(*args)
    except Exception as error:
        # torch.multiprocessing passes only the traceback text on: keep the exception itself for the parent
        try:
            with open(_error_path(result_path, rank), "wb") as file:
                pickle.dump(error, file)
        except Exception:  # an exception that does not pickle: the parent reports torch's text instead
            pass
        raise
    if rank == 0:  # a file, not a pipe: a large result would block rank 0 while the parent waits for it to exit
        with open(result_path, "wb") as file:
            pickle.dump(result, file)


def spawn(fn: Callable[..., Any], nproc: int, *args: Any) -> Any:
    """Run ``fn(*args)`` in ``nproc`` spawned local ranks (each sees torchrun-like variables); returns rank 0's result.

    A rank that raises stops the others (torch.multiprocessing terminates them) and its error is raised here with
    its own type and message (a ValueError stays a ValueError), chained to torch's report holding the rank's
    traceback. A rank that only stopped because another failed (``PipelineStageError``) gives way to that rank's
    original error.
    """
    store = hold_local_store()  # bound for as long as the ranks run
    with tempfile.TemporaryDirectory(prefix="tritonrec-spawn-") as scratch:
        result_path = os.path.join(scratch, "rank0.pkl")
        ready = [_ready_path(result_path, rank) for rank in range(nproc)]
        processes: list[Any] = []  # filled once started: a SIGTERM while they start waits for them
        with _forwarding_sigterm(processes, ready) as forward_pending:
            context = mp.start_processes(_spawned_main, args=(nproc, store.port, fn, args, result_path),
                                         nprocs=nproc, join=False, start_method="spawn")  # fmt: skip
            processes.extend(context.processes)
            try:
                while not context.join(timeout=0.2):
                    forward_pending()
            except mp.ProcessRaisedException as report:
                error = _root_error(result_path, report.error_index, nproc)
                if error is None:
                    raise
                raise error from report
        if not os.path.exists(result_path):
            return None
        with open(result_path, "rb") as file:
            return pickle.load(file)


def _root_error(result_path: str, rank: int, nproc: int) -> BaseException | None:
    """The error to re-raise for rank ``rank``'s failure: its own, unless it only stopped because other ranks failed
    (a ``PipelineStageError``, naming them in ``failed_ranks``) and another rank saved its original error (a
    malformed line naming its file and line, say). torch reports whichever rank exited first, and the original error
    was lost whenever a rank that merely stopped with it won that race."""
    error = _rank_error(result_path, rank)
    if error is not None and not getattr(error, "failed_ranks", None):
        return error
    named = [r for r in getattr(error, "failed_ranks", None) or [] if isinstance(r, int)]
    for other in [*named, *range(nproc)]:
        original = _rank_error(result_path, other) if other != rank else None
        if original is not None and not getattr(original, "failed_ranks", None):
            return original
    return error


def _rank_error(result_path: str, rank: int) -> BaseException | None:
    """The exception rank ``rank`` saved before it died, None if it saved none (or it does not unpickle)."""
    try:
        with open(_error_path(result_path, rank), "rb") as file:
            error = pickle.load(file)
    except Exception:
        return None
    return error if isinstance(error, BaseException) else None


@contextmanager
def _forwarding_sigterm(processes: list[Any], ready: list[str]) -> Iterator[Callable[[], None]]:
    """SIGTERM to this (parent) process is passed on to the ranks (as :data:`STOP_SIGNAL`), which checkpoint and
    stop together. A rank not started yet (``processes`` is filled once they are), or still starting (its interpreter
    importing, before it wrote its ``ready`` file), would die of it: it gets the signal once it is ready, from the
    callable this yields (the parent calls it while it waits for the ranks)."""
    import threading

    pending: set[int] = set()

    def forward_pending() -> None:
        for rank in sorted(pending):
            if rank >= len(processes):
                continue
            process = processes[rank]
            if not process.is_alive():
                pending.discard(rank)
            elif os.path.exists(ready[rank]):
                pending.discard(rank)
                os.kill(process.pid, STOP_SIGNAL)

    if threading.current_thread() is not threading.main_thread():
        yield forward_pending
        return

    def forward(signum: int, frame: Any) -> None:
        pending.update(range(len(ready)))
        forward_pending()

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield forward_pending
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopRequest:
    """Set by SIGTERM (and SIGINT when asked): the training loop checks it at each step, writes a final checkpoint
    and returns instead of dying mid-step. Installs its handlers only in the main thread, restores them on exit."""

    def __init__(self) -> None:
        self.signal: int | None = None

    @contextmanager
    def installed(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[StopRequest]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in signals}

        def handler(signum: int, frame: Any) -> None:
            self.signal = signal.SIGTERM if signum == STOP_SIGNAL else signum  # the parent's SIGTERM, passed on

        if signal.SIGTERM in signals:
            signals = (*signals, STOP_SIGNAL)
            previous[STOP_SIGNAL] = signal.getsignal(STOP_SIGNAL)
            if _early_signal is not None:  # a spawned rank asked to stop while it was starting: at the first step
                self.signal = _early_signal
        for s in signals:
            signal.signal(s, handler)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signal).name if self.signal is not None else None


__all__ = ["StopRequest", "init_process_group", "rank_device", "resolve_backend", "spawn",
           "torchrun_world_size"]  # fmt: skip
