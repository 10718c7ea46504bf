"""Cross-rank consistency of collective metadata: ranks that disagree get a ``ValueError`` before any data moves.

Every rank must call a collective with the same metadata (splits, dims, keys, batch sizes, dtype, codecs) and with
send sizes that match what its peers expect. A backend checks neither: when the byte counts happen to match, data is
silently mixed (rank 1 reads rank 0's 2-wide rows as 4-wide ones); when they do not, gloo aborts the process
(``terminate called ... EnforceNotMet``) and the peers see "Connection reset by peer". So before a checked call
issues its collective, the ranks exchange a digest of their metadata:

* phase 1: one ``all_gather`` of a small int64 tensor per rank, ``[digest, failed, sent to each rank, expected from
  each rank]`` (``2 + 2W`` values);
* only when the digests differ or a rank failed its own input checks, phase 2 gathers the metadata itself
  (``all_gather_object``) so that the error names the collective, the field and each rank's value.

Every rank computes the same verdict from the same gathered data, so every rank raises the same ``ValueError`` (a
rank whose own input checks failed re-raises its own error, and its peers say which rank rejected what). No
collective of the call is issued, so the group stays usable.

When: the first :data:`DEFAULT_CHECKED_CALLS` calls of each module instance (and of each functional op called
directly) are checked, then none, so the steady state pays nothing: configuration mistakes (a rank built with other
splits or keys) show on the first call. ``TRITONREC_DIST_CHECKS=1`` checks every call (use it while debugging
data-dependent metadata such as per-step batch sizes); ``TRITONREC_DIST_CHECKS=0`` checks none. Every rank must see
the same setting.

Cost of a checked call: one blocking all-gather of ``2 + 2W`` int64 values plus hashing the metadata; it also makes
the call wait for its peers, which ends any overlap for that call. ``benchmarks/bench_dist_checks.py`` measures it
(README, "Checks across ranks"): about 0.1 ms for the all-gather alone over gloo with 2 ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.dist.tensor_collectives import all_gather_tensor
from tritonrec.kernels.checks import check_int

ENV_VAR = "TRITONREC_DIST_CHECKS"
DEFAULT_CHECKED_CALLS = 8


def checks_setting() -> bool | None:
    """``TRITONREC_DIST_CHECKS``: ``True`` (check every call), ``False`` (none) or ``None`` (unset: the first
    :data:`DEFAULT_CHECKED_CALLS` calls of each instance)."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw == "":
        return None
    if raw in ("1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ENV_VAR} must be '0' or '1' (or unset: check the first calls), got {ENV_VAR}={raw!r}")


def describe_codecs(codecs: Any) -> object:
    """What must match across ranks about ``QuantizedCommCodecs`` (or None): per direction, the codec's type, its
    precision and row size where it has them, and its wire dtype."""
    if codecs is None:
        return None
    described = []
    for codec in (codecs.forward, codecs.backward):
        inner = getattr(codec, "codec", codec)  # ErrorFeedbackCodec wraps one
        wire = codec.quantized_dtype
        wire = wire() if callable(wire) else wire  # torchrec's NoOp codec declares it as a method
        precision = getattr(inner, "comm_precision", None)
        described.append([type(codec).__name__, str(precision), getattr(inner, "row_dim", None), str(wire)])
    return described


class _PendingCall:
    """The metadata of one checked call, recorded by the op (and the module around it) before the exchange."""

    def __init__(self, group: dist.ProcessGroup, name: str, due: bool) -> None:
        self.group = group
        self.names = [name]
        self.due = due
        self.exchanged = False
        self.fields: dict[str, object] = {}
        self.pairwise: tuple[str, list[int], str, list[int], str] | None = None

    @property
    def collective(self) -> str:
        return " / ".join(self.names)

    def same(self, **fields: object) -> None:
        """Fields every rank must pass identically (plain ints, strings and lists of them)."""
        self.fields.update(fields)

    def sizes(self, send_label: str, sends: Sequence[int], recv_label: str, recvs: Sequence[int], unit: str) -> None:
        """Per-peer sizes that must match transposed: what this rank sends to rank ``r`` (``sends[r]``) is what rank
        ``r`` expects from it (rank ``r``'s ``recvs[me]``). The labels say where the sizes come from, with ``{peer}``
        standing for the other rank (``"its output_splits[{peer}]"``)."""
        self.pairwise = (send_label, list(sends), recv_label, list(recvs), unit)

    def exchange(self, error: BaseException | None = None) -> None:
        """Phase 1 (and phase 2 on a mismatch); raises the verdict. With ``error`` (this rank's own input check
        failed), tells the peers and returns so the caller re-raises it."""
        if not self.due or self.exchanged:
            return
        self.exchanged = True
        world = self.group.size()
        if world == 1:
            return
        local = torch.zeros(2 + 2 * world, dtype=torch.int64)
        local[0] = _digest(self.collective, self.fields)
        local[1] = int(error is not None)
        if self.pairwise is not None and error is None:
            local[2 : 2 + world] = torch.tensor(self.pairwise[1], dtype=torch.int64)
            local[2 + world :] = torch.tensor(self.pairwise[3], dtype=torch.int64)
        gathered = _gather(local, self.group, self.collective)
        digests, failed = gathered[:, 0].tolist(), gathered[:, 1].tolist()
        if len(set(digests)) == 1 and not any(failed):
            if self.pairwise is not None:
                self._check_sizes(gathered[:, 2 : 2 + world].tolist(), gathered[:, 2 + world :].tolist())
            return
        mine = {"collective": self.collective, "fields": self.fields, "error": _describe_error(error)}
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=self.group)
        if error is None:
            raise ValueError(_disagreement(everyone))

    def _check_sizes(self, sends: list[list[int]], recvs: list[list[int]]) -> None:
        assert self.pairwise is not None
        send_label, _, recv_label, _, unit = self.pairwise
        for src, row in enumerate(sends):
            for dst, sent in enumerate(row):
                if sent != recvs[dst][src]:
                    raise ValueError(
                        f"{self.collective}: ranks disagree on sizes (nothing was sent): rank {src} sends {sent} "
                        f"{unit} to rank {dst} ({send_label.format(peer=dst)}) but rank {dst} expects "
                        f"{recvs[dst][src]} ({recv_label.format(peer=src)}); sent per rank: {sends}, expected per "
                        f"rank: {recvs}"
                    )


class MetadataCheck:
    """Decides which calls of one module instance (or one functional op) are checked, and runs the check.

    Usage inside an op (a module around it may open the same check first, to have its own input checks covered)::

        with check.call(group, "alltoall_pooled") as meta:
            ...input checks...
            meta.same(batch_size_per_rank=batch_size_per_rank, dim_sum_per_rank=dim_sum_per_rank)
        # leaving the innermost block exchanges the metadata (and raises on disagreement); then launch

    ``calls`` counts the calls, ``checks_run`` the checked ones.
    """

    def __init__(self, checked_calls: int = DEFAULT_CHECKED_CALLS) -> None:
        self.checked_calls = check_int(checked_calls, "checked_calls", 0)
        self.calls = 0
        self.checks_run = 0
        self._pending: _PendingCall | None = None

    def _due(self) -> bool:
        self.calls += 1
        setting = checks_setting()
        due = self.calls <= self.checked_calls if setting is None else setting
        self.checks_run += int(due)
        return due

    @contextlib.contextmanager
    def call(self, group: dist.ProcessGroup, name: str) -> Iterator[_PendingCall]:
        outer = self._pending is None
        if outer:
            pending = _PendingCall(group, name, self._due())
            self._pending = pending
        else:
            pending = self._pending
            pending.names.append(name)
        try:
            yield pending
        except Exception as error:
            if outer:
                self._pending = None
                pending.exchange(error)  # the peers learn that this rank refused the call; then re-raise
            raise
        finally:
            if outer:
                self._pending = None
        pending.exchange()


_OP_CHECKS: dict[str, MetadataCheck] = {}


def checked_call(
    name: str, group: dist.ProcessGroup, check: MetadataCheck | None
) -> contextlib.AbstractContextManager[_PendingCall]:
    """``check.call(group, name)`` with ``check`` the caller's (a module's), or else the functional op ``name``'s own
    (one per op per process)."""
    if check is None:
        check = _OP_CHECKS.setdefault(name, MetadataCheck())
    elif not isinstance(check, MetadataCheck):
        raise TypeError(f"metadata_check must be a MetadataCheck or None, got {type(check).__name__}")
    return check.call(group, name)


def _digest(collective: str, fields: dict[str, object]) -> int:
    text = repr((collective, sorted(fields.items())))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _gather(local: torch.Tensor, group: dist.ProcessGroup, collective: str) -> torch.Tensor:
    if dist.get_backend(group) == "nccl":  # NCCL moves device memory only
        local = local.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = local.new_empty(group.size() * local.numel())  # gloo wants the flat output
    work = all_gather_tensor(gathered, local, group=group, async_op=True)
    wait_for_work(work, f"{collective} (metadata check)", group)
    return gathered.view(group.size(), -1).cpu()


def _describe_error(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _disagreement(everyone: list[dict[str, Any]]) -> str:
    """The message every rank raises, from every rank's metadata (identical on every rank)."""
    failed = [(rank, meta["error"]) for rank, meta in enumerate(everyone) if meta["error"] is not None]
    if failed:
        listing = "; ".join(f"rank {rank} rejected its input ({error})" for rank, error in failed)
        return f"{everyone[0]['collective']}: {listing}; no collective was issued on any rank"
    names = [meta["collective"] for meta in everyone]
    if len(set(names)) > 1:
        listing = ", ".join(f"rank {rank}: {name}" for rank, name in enumerate(names))
        return f"ranks call different collectives ({listing}); every rank must make the same calls in the same order"
    keys = list(dict.fromkeys(key for meta in everyone for key in meta["fields"]))
    differing = []
    for key in keys:
        values = [meta["fields"].get(key, "<absent>") for meta in everyone]
        if any(v != values[0] for v in values[1:]):
            differing.append(f"{key}: " + ", ".join(f"rank {rank} = {value}" for rank, value in enumerate(values)))
    return f"{names[0]}: ranks disagree on metadata every rank must pass identically (nothing was sent): " + "; ".join(
        differing
    )


__all__ = [
    "DEFAULT_CHECKED_CALLS",
    "ENV_VAR",
    "MetadataCheck",
    "checked_call",
    "checks_setting",
    "describe_codecs",
]
