"""Data-distribution modules (torchrec's ``dist_data``): sparse features to the ranks that own their tables
(:class:`KJTAllToAll`), and embeddings back (re-exported from :mod:`tritonrec.dist.embedding_dist` and
:mod:`tritonrec.dist.all_to_one`), so torchrec's ``dist_data`` names are all importable from here.

``KJTAllToAll`` is two rounds, each an awaitable: the first exchanges split sizes and batch sizes (so every rank can
size its receive buffers), the second the lengths, values and weights. ``module(kjt)`` returns the first;
``.wait()`` gives the second; ``.wait().wait()`` the KJT. The first calls of each instance first check that every
rank passes the same splits, keys and tensor kinds (:mod:`tritonrec.dist.comm_consistency`).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.all_to_one import EmbeddingsAllToOne, EmbeddingsAllToOneReduce, SeqEmbeddingsAllToOne
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.comm_checks import check_sizes
from tritonrec.dist.comm_consistency import MetadataCheck
from tritonrec.dist.comm_timeout import wait_for_work
from tritonrec.dist.embedding_dist import (
    PooledEmbeddingsAllGather,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsAwaitable,
    PooledEmbeddingsReduceScatter,
    SequenceEmbeddingsAllToAll,
    SequenceEmbeddingsAwaitable,
    VariableBatchPooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsReduceScatter,
)
from tritonrec.dist.kjt_dist import dist_init, dist_labels, dist_splits, dist_tensors, get_recat
from tritonrec.dist.record import record
from tritonrec.kernels.checks import check_int


class SplitsAllToAllAwaitable(Awaitable[list[list[int]]]):
    """One all-to-all of small int vectors: ``input_tensors[i][r]`` goes to rank ``r``; ``wait()`` gives, per
    input ``i``, the value received from each rank."""

    def __init__(self, input_tensors: list[torch.Tensor], pg: dist.ProcessGroup) -> None:
        super().__init__()
        self._pg = pg
        self._num_workers = pg.size()
        with record("## all2all_data:kjt splits ##"):
            self._send = torch.stack(input_tensors, dim=1).flatten()  # [rank, input]: one row per destination
            self._received = torch.empty_like(self._send)
            self._work = dist.all_to_all_single(self._received, self._send, group=pg, async_op=True)

    def _wait_impl(self) -> list[list[int]]:
        wait_for_work(self._work, "KJTAllToAll splits", self._pg)
        return self._received.view(self._num_workers, -1).T.tolist()


class KJTAllToAllTensorsAwaitable(Awaitable[KeyedJaggedTensor]):
    """Second round of :class:`KJTAllToAll`: the lengths/values/(strides)/(weights) all-to-alls, launched at
    construction; ``wait()`` gives this rank's KJT (its keys, every source rank's bags, key-major)."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        input: KeyedJaggedTensor,
        splits: list[int],
        input_splits: list[list[int]],
        output_splits: list[list[int]],
        input_tensors: list[torch.Tensor],
        labels: list[str],
        keys: list[str],
        device: torch.device,
        stagger: int,
        stride_per_rank: list[int] | None,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._workers = pg.size()
        self._input = input
        self._splits = splits
        self._labels = labels
        self._keys = keys
        self._stagger = stagger
        self._stride_per_rank = stride_per_rank
        self._input_splits: dict[str, list[int]] = dict(zip(labels, input_splits, strict=True))
        self._output_splits: dict[str, list[int]] = dict(zip(labels, output_splits, strict=True))
        self._send = input_tensors  # held until the wait: the backend reads them asynchronously
        self._output_tensors: list[torch.Tensor] = []
        self._works: list[dist.Work] = []
        for label, send, send_splits, recv_splits in zip(
            labels, input_tensors, input_splits, output_splits, strict=True
        ):
            received = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype, device=device)
            with record(f"## all2all_data:kjt {label} ##"):
                work = dist.all_to_all_single(received, send, recv_splits, send_splits, group=pg, async_op=True)
            self._output_tensors.append(received)
            self._works.append(work)

    @property
    def input_splits(self) -> dict[str, list[int]]:
        """Per label, entries sent to each rank (``["values"]``: ids sent, used by sequence embedding dist)."""
        return self._input_splits

    @property
    def output_splits(self) -> dict[str, list[int]]:
        """Per label, entries received from each rank."""
        return self._output_splits

    @property
    def stride_per_rank(self) -> list[int] | None:
        """Each source rank's batch size (fixed-stride inputs; ``None`` for variable stride per key)."""
        return self._stride_per_rank

    def _wait_impl(self) -> KeyedJaggedTensor:
        for label, work in zip(self._labels, self._works, strict=True):
            wait_for_work(work, f"KJTAllToAll {label}", self._pg)
        return dist_init(
            keys=self._keys,
            tensors=self._output_tensors,
            variable_stride_per_key=self._input.variable_stride_per_key(),
            num_workers=self._workers,
            stride_per_rank=self._stride_per_rank,
            stagger=self._stagger,
        )


class KJTAllToAllSplitsAwaitable(Awaitable[KJTAllToAllTensorsAwaitable]):
    """First round of :class:`KJTAllToAll`: exchanges, per label, how many entries each rank sends to each rank,
    and (fixed-stride inputs) each rank's batch size. ``wait()`` launches the second round and returns it."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        input: KeyedJaggedTensor,
        splits: list[int],
        labels: list[str],
        tensor_splits: list[list[int]],
        input_tensors: list[torch.Tensor],
        keys: list[str],
        device: torch.device,
        stagger: int,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._input = input
        self._splits = splits
        self._labels = labels
        self._input_splits = tensor_splits
        self._input_tensors = input_tensors
        self._keys = keys
        self._device = device
        self._stagger = stagger
        sizes = [torch.tensor(s, dtype=torch.int64, device=device) for s in tensor_splits]
        if not input.variable_stride_per_key():
            sizes.append(torch.full((pg.size(),), input.stride(), dtype=torch.int64, device=device))
        self._splits_awaitable = SplitsAllToAllAwaitable(sizes, pg)

    def _wait_impl(self) -> KJTAllToAllTensorsAwaitable:
        received = self._splits_awaitable.wait()
        stride_per_rank = None if self._input.variable_stride_per_key() else received.pop()
        return KJTAllToAllTensorsAwaitable(
            pg=self._pg,
            input=self._input,
            splits=self._splits,
            input_splits=self._input_splits,
            output_splits=received,
            input_tensors=self._input_tensors,
            labels=self._labels,
            keys=self._keys,
            device=self._device,
            stagger=self._stagger,
            stride_per_rank=stride_per_rank,
        )


def _check_stagger(stagger: object, world_size: int) -> int:
    what = f"a positive int dividing the world size {world_size}"
    stagger = check_int(stagger, "stagger", 1, what=what)
    if world_size % stagger:
        raise ValueError(f"stagger must be {what}, got stagger={stagger!r}")
    return stagger


class KJTAllToAll(nn.Module):
    """Sends each rank the keys of the tables it owns, with every rank's bags for them.

    Args:
        pg: the group to distribute over.
        splits: ``splits[r]`` consecutive keys of the input go to rank ``r`` (keys are ordered by destination).
        stagger: source-rank order within each output key (1: rank order; ``W / local_size`` for TWRW, see
            :func:`~tritonrec.dist.kjt_dist.get_recat`).

    Example (2 ranks, keys A, B, C, ``splits=[2, 1]``)::

        #   rank 0 input       0        1        2           rank 1 input   0        1        2
        #   'A'             [A.V0]     []     [A.V1, A.V2]   'A'         [A.V3]   [A.V4]     []
        #   'B'               []     [B.V0]     [B.V1]       'B'           []     [B.V2]  [B.V3, B.V4]
        #   'C'             [C.V0]   [C.V1]       []         'C'         [C.V2]   [C.V3]     []
        rank0_output = KJTAllToAll(pg, [2, 1])(rank0_input).wait().wait()
        #   rank 0:  'A': [A.V0] [] [A.V1, A.V2] [A.V3] [A.V4] []     'B': [] [B.V0] [B.V1] [] [B.V2] [B.V3, B.V4]
        #   rank 1:  'C': [C.V0] [C.V1] [] [C.V2] [C.V3] []
    """

    def __init__(
        self, pg: dist.ProcessGroup, splits: list[int], stagger: int = 1, metadata_check: MetadataCheck | None = None
    ) -> None:
        super().__init__()
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"pg must be a torch.distributed.ProcessGroup, got {type(pg).__name__}")
        self._pg = pg
        self._splits = check_sizes(splits, "splits", pg.size())
        self._splits_cumsum = [0, *itertools.accumulate(self._splits)]
        self._stagger = _check_stagger(stagger, pg.size())
        # a caller may pass its own check, to open it around its input checks (see MetadataCheck)
        self.metadata_check = metadata_check if metadata_check is not None else MetadataCheck()

    def forward(self, input: KeyedJaggedTensor) -> KJTAllToAllSplitsAwaitable:
        """Launch the splits exchange; ``.wait()`` launches the tensors, ``.wait().wait()`` gives the KJT."""
        with torch.no_grad(), self.metadata_check.call(self._pg, "KJTAllToAll") as meta:
            if not isinstance(input, KeyedJaggedTensor):
                raise TypeError(f"input must be a KeyedJaggedTensor, got {type(input).__name__}")
            if len(input.keys()) != sum(self._splits):
                raise ValueError(
                    f"splits={self._splits} sums to {sum(self._splits)} keys but input has {len(input.keys())}: "
                    f"{input.keys()}"
                )
            labels, tensors = dist_labels(input), dist_tensors(input)
            # per-rank batch sizes may differ (they are exchanged); which tensors go and their dtypes may not
            meta.same(splits=self._splits, keys=input.keys(), stagger=self._stagger, labels=labels,
                      dtypes=[str(t.dtype) for t in tensors])  # fmt: skip
        with torch.no_grad():
            rank = self._pg.rank()
            return KJTAllToAllSplitsAwaitable(
                pg=self._pg,
                input=input,
                splits=self._splits,
                labels=labels,
                tensor_splits=dist_splits(input, self._splits),
                input_tensors=tensors,
                keys=input.keys()[self._splits_cumsum[rank] : self._splits_cumsum[rank + 1]],
                device=input.device(),
                stagger=self._stagger,
            )


def rank_device(device_type: str, rank: int) -> torch.device:
    """The device of local rank ``rank``: ``cuda:rank`` (or another accelerator type), or the CPU / meta device."""
    if device_type in ("cpu", "meta"):
        return torch.device(device_type)
    return torch.device(device_type, rank)


class KJTOneToAll(nn.Module):
    """Single-process multi-device (inference): splits the keys into ``splits[r]`` groups and copies group ``r`` to
    device ``r`` (``device``'s type; CPU when ``device`` is None). Returns the list of KJTs."""

    def __init__(self, splits: list[int], world_size: int, device: torch.device | None = None) -> None:
        super().__init__()
        world_size = check_int(world_size, "world_size", 1)
        self._splits = check_sizes(splits, "splits", world_size)
        self._world_size = world_size
        if device is not None and not isinstance(device, torch.device):
            raise TypeError(f"device must be a torch.device or None, got {device!r}")
        self._device_type = "cpu" if device is None else device.type

    def forward(self, kjt: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        if not isinstance(kjt, KeyedJaggedTensor):
            raise TypeError(f"kjt must be a KeyedJaggedTensor, got {type(kjt).__name__}")
        if len(kjt.keys()) != sum(self._splits):
            raise ValueError(f"splits={self._splits} sums to {sum(self._splits)} keys but kjt has {len(kjt.keys())}")
        parts = kjt.split(self._splits)
        if self._device_type == "meta":
            return parts
        return [part.to(rank_device(self._device_type, rank), non_blocking=True) for rank, part in enumerate(parts)]


__all__ = [
    "EmbeddingsAllToOne",
    "EmbeddingsAllToOneReduce",
    "KJTAllToAll",
    "KJTAllToAllSplitsAwaitable",
    "KJTAllToAllTensorsAwaitable",
    "KJTOneToAll",
    "PooledEmbeddingsAllGather",
    "PooledEmbeddingsAllToAll",
    "PooledEmbeddingsAwaitable",
    "PooledEmbeddingsReduceScatter",
    "SeqEmbeddingsAllToOne",
    "SequenceEmbeddingsAllToAll",
    "SequenceEmbeddingsAwaitable",
    "SplitsAllToAllAwaitable",
    "VariableBatchPooledEmbeddingsAllToAll",
    "VariableBatchPooledEmbeddingsReduceScatter",
    "get_recat",
    "rank_device",
]
