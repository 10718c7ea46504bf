"""``MultiHostDataLoadIterator``: every rank iterates its own loader, and all ranks take the same number of steps.

xlstm-jax's iterator of the same name in PyTorch terms (a process group where it has a device mesh). Each rank wraps
its rank-local loader (any iterable: a DataLoader over its shard, a list of :class:`~tritonrec.data.batch.Batch` es,
dicts of tensors and KJTs). Each step, before returning a batch, the ranks agree that every one of them has one: one
all-reduce of a single int (``MIN`` of "I have a batch"). When any rank's loader has run out, every rank stops with
``StopIteration`` at the same step, so none is left waiting in a collective the others never enter. A rank that had a
batch in hand keeps it for its next epoch (unless the loader is reset).

* ``iterator_length``: at most that many steps per epoch (``len()`` of the iterator). With
  ``reset_after_epoch=False`` and a length, a loader that runs out mid-epoch is restarted for its next pass, so an
  endless training stream is cut into epochs of exactly ``iterator_length`` steps.
* ``reset_after_epoch=True`` restarts the local loader at every ``iter()`` (validation: each epoch from the start);
  ``False`` continues where the previous epoch stopped. ``reset()`` starts a new epoch now.
* ``pad_shapes=True``: dense tensors whose shapes differ across ranks are padded (at the end of each dimension) to
  the element-wise maximum over ranks with ``pad_value``; the shapes travel in the step's one collective (an
  ``all_gather_object`` of ``(has_batch, shapes)``, instead of the all-reduce). KJTs pass through unchanged; bool
  tensors (masks, a Batch's ``valid_mask``) are padded with False.
* ``get_state()`` / ``set_state(state)``: the step, ``iterator_length``, the world size, the loader's state
  (``state_dict()`` of a ``StatefulDataLoader`` or any Stateful loader, ``get_state()`` of a Batcher-like one; for
  a plain iterable, the number of batches it has yielded this pass, replayed on restore), a batch kept in hand and
  ``epoch_ended``. The next ``iter()`` after ``set_state`` continues the saved epoch, or starts the next one when the
  state was taken after the epoch ended (``step == iterator_length``, or a rank's loader ran out first), just as the
  saved iterator would have; a state without ``rank`` or ``epoch_ended`` (saved before they were kept) still loads.
  Restoring under another ``iterator_length``, world size or rank, or a step or replay count that is not an int in
  range, is a ``ValueError`` naming the key.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from tritonrec.data.batch import Batch
from tritonrec.kernels.checks import check_int, check_optional_int

_STATE_KEYS = {"step", "iterator_length", "world_size", "rank", "loader", "pending", "epoch_ended"}
# states saved before the rank, and before the flag, were kept
_OLD_STATE_KEYS = (_STATE_KEYS - {"rank"}, _STATE_KEYS - {"rank", "epoch_ended"})
Shapes = list[tuple[str, tuple[int, ...]]]


def _state_count(value: object, name: str, maximum: int | None = None) -> int:
    """A count read from a saved state: an int (not a bool) in ``[0, maximum]``."""
    bound = f"in [0, iterator_length={maximum}]" if maximum is not None else ">= 0"
    return check_int(value, name, 0, maximum, what=f"an int {bound}")


def dense_shapes(batch: Any, path: str = "batch") -> Shapes:
    """``(path, shape)`` of every dense tensor in ``batch`` (a Batch, or nested dicts / lists / tuples); KJTs and
    non-tensor leaves are skipped."""
    if isinstance(batch, torch.Tensor):
        return [(path, tuple(batch.shape))]
    if isinstance(batch, Batch):
        fields = ("dense_features", "labels", "valid_mask")
        return [s for f in fields for s in dense_shapes(getattr(batch, f), f"{path}.{f}")]
    if isinstance(batch, Mapping):
        return [s for key, value in batch.items() for s in dense_shapes(value, f"{path}[{key!r}]")]
    if isinstance(batch, (list, tuple)):
        return [s for i, value in enumerate(batch) for s in dense_shapes(value, f"{path}[{i}]")]
    return []


def _batch_paths(batch: Any, path: str = "batch") -> list[str]:
    """The paths of every :class:`Batch` in ``batch`` (same walk and paths as :func:`dense_shapes`)."""
    if isinstance(batch, Batch):
        return [path]
    if isinstance(batch, Mapping):
        return [p for key, value in batch.items() for p in _batch_paths(value, f"{path}[{key!r}]")]
    if isinstance(batch, (list, tuple)):
        return [p for i, value in enumerate(batch) for p in _batch_paths(value, f"{path}[{i}]")]
    return []


def _rebuilt(container: Any, items: list[Any]) -> Any:
    """``container`` (a list, tuple or namedtuple) of the same type holding ``items``."""
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # a namedtuple takes its fields positionally
        return type(container)(*items)
    return type(container)(items)


def _pad(tensor: torch.Tensor, shape: Sequence[int], value: float | bool) -> torch.Tensor:
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    out = tensor.new_full(tuple(shape), value)
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def pad_batch(batch: Any, targets: Mapping[str, Sequence[int]], pad_value: float, path: str = "batch") -> Any:
    """``batch`` with every dense tensor padded to ``targets[path]`` (see :func:`dense_shapes` for the paths)."""
    if isinstance(batch, torch.Tensor):  # a mask (bool) is padded with False, as a Batch's valid_mask
        return _pad(batch, targets[path], False if batch.dtype == torch.bool else pad_value)
    if isinstance(batch, Batch):
        padded = Batch.__new__(Batch)  # checked below with a message that names the cause
        padded.dense_features = _pad(batch.dense_features, targets[f"{path}.dense_features"], pad_value)
        padded.labels = _pad(batch.labels, targets[f"{path}.labels"], pad_value)
        padded.valid_mask = _pad(batch.valid_mask, targets[f"{path}.valid_mask"], False)
        padded.sparse_features = batch.sparse_features
        if padded.labels.shape[0] != batch.labels.shape[0]:
            raise ValueError(
                f"pad_shapes: {path} has batch size {batch.labels.shape[0]} here and {padded.labels.shape[0]} on "
                "another rank; a Batch's KJT cannot be padded (KJTs pass through), so give every rank the same "
                "batch_size (the Batcher pads short batches itself)"
            )
        return padded
    if isinstance(batch, Mapping):
        padded_items = {k: pad_batch(v, targets, pad_value, f"{path}[{k!r}]") for k, v in batch.items()}
        if isinstance(batch, MutableMapping):  # a copy keeps what the constructor would need (defaultdict's factory)
            out = copy.copy(batch)
            out.update(padded_items)
            return out
        return type(batch)(padded_items)
    if isinstance(batch, (list, tuple)):
        return _rebuilt(batch, [pad_batch(v, targets, pad_value, f"{path}[{i}]") for i, v in enumerate(batch)])
    return batch


class MultiHostDataLoadIterator:
    """Iterates a rank-local loader in step with the other ranks of ``process_group`` (see module docstring).

    Args:
        dataloader: this rank's loader, any iterable (re-iterable when it must restart).
        process_group: the ranks that step together; ``None`` is the default group, or a single process when
            torch.distributed is not initialised.
        iterator_length: steps per epoch (``None``: until a rank's loader runs out).
        dataset_size: the number of samples in the dataset, reported by :meth:`get_dataset_size`.
        reset_after_epoch: restart the local loader at every epoch (validation) instead of continuing it.
        pad_shapes: pad dense tensors to the element-wise maximum shape over ranks.
        pad_value: the value padding is filled with.
    """

    def __init__(
        self,
        dataloader: Iterable,
        process_group: dist.ProcessGroup | None = None,
        iterator_length: int | None = None,
        dataset_size: int | None = None,
        reset_after_epoch: bool = False,
        pad_shapes: bool = False,
        pad_value: float = 0,
    ) -> None:
        if not isinstance(dataloader, Iterable):
            raise TypeError(f"dataloader must be iterable, got {type(dataloader).__name__}")
        self.dataloader = dataloader
        self.iterator_length = check_optional_int(iterator_length, "iterator_length", 1)
        self.dataset_size = check_optional_int(dataset_size, "dataset_size", 0)
        for name, flag in (("reset_after_epoch", reset_after_epoch), ("pad_shapes", pad_shapes)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {name}={flag!r}")
        if not isinstance(pad_value, (int, float)) or isinstance(pad_value, bool):
            raise TypeError(f"pad_value must be a number, got pad_value={pad_value!r}")
        self.reset_after_epoch, self.pad_shapes, self.pad_value = reset_after_epoch, pad_shapes, pad_value
        if process_group is not None and not dist.is_initialized():
            raise ValueError("process_group was given but torch.distributed is not initialised")
        self.process_group = process_group
        distributed = dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.step = 0
        self._local: Iterator | None = None
        self._pending: Any = None
        self._yielded = 0  # batches the current local iterator has yielded (the state of a stateless loader)
        self._replay = 0  # batches to skip when the next local iterator starts (restoring a stateless loader)
        self._restored = False
        # set_state loaded a stateful loader's state (not at its end), whose next iter() continues the saved pass
        self._loader_restored = False
        self._leave_restored_pass = False  # the next local iterator must not continue that pass (see _start_local)
        self._ended = False  # this epoch raised StopIteration (its steps ran out, or a rank's loader did)

    # ------------------------------------------------------------------------------------------------- iteration
    def __len__(self) -> int:
        if self.iterator_length is None:
            raise TypeError("this MultiHostDataLoadIterator has no iterator_length, so no length")
        return self.iterator_length

    def get_dataset_size(self) -> int | None:
        return self.dataset_size

    def reset(self) -> None:
        """Start a new epoch: step 0, and a fresh pass of the local loader when ``reset_after_epoch``."""
        self.step, self._ended = 0, False
        if self.reset_after_epoch:
            self._local, self._pending, self._replay = None, None, 0
            self._leave_restored_pass = self._loader_restored  # a new pass, not the one set_state loaded

    def __iter__(self) -> MultiHostDataLoadIterator:
        # The epoch restored by set_state continues, unless the state was taken after it ended (step ==
        # iterator_length, as xlstm-jax checks, or it ended early because a rank's loader ran out): then, as without
        # the restore, iter() starts the next epoch.
        unfinished = not self._ended and (self.iterator_length is None or self.step < self.iterator_length)
        if not (self._restored and unfinished):
            self.reset()
        self._restored = False
        return self

    def __next__(self) -> Any:
        if self.iterator_length is not None and self.step >= self.iterator_length:
            self._ended = True
            raise StopIteration
        batch = self._pull()
        has_batch = batch is not None
        if self.pad_shapes:
            every_rank_has_one, targets = self._exchange_shapes(batch)
        else:
            every_rank_has_one, targets = self._all_have(has_batch), None
        if not every_rank_has_one:
            self._pending = batch  # None on the ranks that ran out
            self._ended = True
            raise StopIteration
        self.step += 1
        return pad_batch(batch, targets, self.pad_value) if targets else batch

    def _start_local(self) -> None:
        if self._leave_restored_pass:
            # With reset_after_epoch, a new epoch starts a new pass of the loader here: a new iter() that leaves the
            # pass it was in. The restored loader's first iter() continues that pass instead (Stateful protocol), so
            # make that iteration and leave it, as the saved iterator did. (A loader saved at the end of its pass
            # starts a new one at its first iter() anyway: _loader_restored is not set for it.)
            iter(self.dataloader)
        self._leave_restored_pass = self._loader_restored = False
        self._local, self._yielded = iter(self.dataloader), 0
        for _ in range(self._replay):
            if next(self._local, None) is None:
                raise ValueError(f"set_state: the loader holds fewer than the {self._replay} batches to replay")
            self._yielded += 1
        self._replay = 0

    def _pull(self) -> Any:
        """This rank's next batch (None when its loader has run out)."""
        if self._pending is not None:
            batch, self._pending = self._pending, None
            return batch
        if self._local is None:
            self._start_local()
        batch = next(self._local, None)  # type: ignore[arg-type]
        if batch is None and self.iterator_length is not None and not self.reset_after_epoch:
            self._start_local()  # an endless stream: on to the next pass (once: an empty pass ends the epoch)
            batch = next(self._local, None)  # type: ignore[arg-type]
        if batch is None:
            self._local = None  # the next epoch starts the loader's next pass
        else:
            self._yielded += 1
        return batch

    # ----------------------------------------------------------------------------------------------- collectives
    def _device(self) -> torch.device:
        if dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_have(self, has_batch: bool) -> bool:
        if self.world_size == 1:
            return has_batch
        flag = torch.tensor([int(has_batch)], dtype=torch.int32, device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
        return bool(flag.item())

    def _exchange_shapes(self, batch: Any) -> tuple[bool, dict[str, tuple[int, ...]] | None]:
        shapes = dense_shapes(batch) if batch is not None else None
        if self.world_size == 1:
            gathered: list[Any] = [(batch is not None, shapes)]
        else:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, (batch is not None, shapes), group=self.process_group)
        if not all(has for has, _ in gathered):
            return False, None
        mine = dict(shapes)  # type: ignore[arg-type]
        targets = {path: list(shape) for path, shape in mine.items()}
        for rank, (_, theirs) in enumerate(gathered):
            theirs = dict(theirs)
            if theirs.keys() != mine.keys():
                raise ValueError(
                    f"pad_shapes: rank {rank}'s batch holds dense tensors {sorted(theirs)}, rank {self.rank}'s "
                    f"{sorted(mine)}; every rank must yield the same structure"
                )
            for path, shape in theirs.items():
                if len(shape) != len(mine[path]):
                    raise ValueError(
                        f"pad_shapes: {path} has {len(shape)} dimensions on rank {rank} but {len(mine[path])} on "
                        f"rank {self.rank}; only sizes may differ across ranks"
                    )
                targets[path] = [max(a, b) for a, b in zip(targets[path], shape, strict=True)]
        # A Batch's size cannot be padded (its KJT passes through). Checked here, on the gathered shapes, so that
        # every rank raises the same error at the same step: a check on the smaller rank alone would leave the
        # others waiting in their next collective.
        for path in _batch_paths(batch):
            sizes = [dict(theirs)[f"{path}.labels"][0] for _, theirs in gathered]
            if len(set(sizes)) > 1:
                raise ValueError(
                    f"pad_shapes: {path} has batch sizes {sizes} on ranks 0..{self.world_size - 1}; a Batch's KJT "
                    "cannot be padded (KJTs pass through), so give every rank the same batch_size (the Batcher pads "
                    "short batches itself)"
                )
        return True, {path: tuple(shape) for path, shape in targets.items()}

    # ------------------------------------------------------------------------------------------------------ state
    def get_state(self) -> dict[str, Any]:
        """``{"step", "iterator_length", "world_size", "rank", "loader", "pending", "epoch_ended"}`` (module
        docstring)."""
        return {
            "step": self.step,
            "iterator_length": self.iterator_length,
            "world_size": self.world_size,
            "rank": self.rank,
            "loader": self._loader_state(),
            "pending": _own_storage(self._pending),
            "epoch_ended": self._ended,
        }

    def _loader_state(self) -> Any:
        if callable(getattr(self.dataloader, "state_dict", None)):
            return self.dataloader.state_dict()  # type: ignore[attr-defined]
        if callable(getattr(self.dataloader, "get_state", None)):
            return self.dataloader.get_state()  # type: ignore[attr-defined]
        return {"replay": self._yielded if self._local is not None else 0}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`get_state` result: the next ``iter()`` resumes the interrupted epoch."""
        if not isinstance(state, Mapping) or set(state) not in (_STATE_KEYS, *_OLD_STATE_KEYS):
            raise ValueError(f"state must be a get_state() result with the keys {sorted(_STATE_KEYS)}, got {state!r}")
        if state["iterator_length"] != self.iterator_length:
            raise ValueError(
                f"state was taken with iterator_length={state['iterator_length']}, but this iterator has "
                f"iterator_length={self.iterator_length}"
            )
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"state was taken on world_size={state['world_size']} ranks, but this iterator runs on "
                f"world_size={self.world_size}"
            )
        if state.get("rank", self.rank) != self.rank:  # each rank's loader state is its own shard's
            raise ValueError(
                f"state was taken on rank {state['rank']}, but this iterator is rank {self.rank} of its group: "
                "restore each rank's own state"
            )
        # Up to iterator_length inclusive: a state taken after an epoch's StopIteration has step == iterator_length.
        step = _state_count(state["step"], "state['step']", self.iterator_length)
        ended = state.get("epoch_ended", False)
        if not isinstance(ended, bool):
            raise ValueError(f"state['epoch_ended'] must be a bool, got state['epoch_ended']={ended!r}")
        loader_state, replay = state["loader"], 0
        if callable(getattr(self.dataloader, "load_state_dict", None)):
            self.dataloader.load_state_dict(loader_state)  # type: ignore[attr-defined]
        elif callable(getattr(self.dataloader, "set_state", None)):
            self.dataloader.set_state(loader_state)  # type: ignore[attr-defined]
        elif isinstance(loader_state, Mapping) and set(loader_state) == {"replay"}:
            replay = _state_count(loader_state["replay"], "state['loader']['replay']")
        else:
            raise ValueError(f"state['loader'] does not fit a {type(self.dataloader).__name__}: {loader_state!r}")
        self.step, self._pending, self._replay = step, state["pending"], replay
        self._local, self._restored, self._ended = None, True, ended
        stateful = callable(getattr(self.dataloader, "load_state_dict", None))
        unfinished = (
            isinstance(loader_state, Mapping)
            and bool(loader_state)
            and not loader_state.get("_iterator_finished", False)
        )
        self._loader_restored = stateful and unfinished
        # At step 0 with reset_after_epoch the saved iterator had not started this epoch's pass yet: it would have
        # left the loaded one at its first batch (an epoch that is over does so at the next iter(), via reset()).
        self._leave_restored_pass = self.reset_after_epoch and step == 0 and not ended and self._loader_restored


def _own_storage(batch: Any) -> Any:
    """``batch`` with every tensor copied into storage of its own (None stays None). Batches from loader workers are
    views of one shared byte buffer, in several dtypes, which ``torch.save`` refuses to write; a saved state must
    not keep that buffer alive either."""
    if batch is None:
        return None

    def own(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.clone()
        if isinstance(leaf, Batch):  # a copy keeps a subclass and its other attributes
            out = copy.copy(leaf)
            for name in ("dense_features", "sparse_features", "labels", "valid_mask"):
                setattr(out, name, tree_map(own, getattr(leaf, name)))
            return out
        return leaf

    return tree_map(own, batch)
