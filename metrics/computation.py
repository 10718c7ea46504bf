"""States, windows and cross-rank reduction of one metric's formula: the ``RecMetricComputation`` half of
``torchrec.metrics.rec_metric`` (see :mod:`tritonrec.metrics.rec_metric` for the semantics)."""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from tritonrec.metrics._sync import all_gather_cat, all_reduce_sums, group_world_size
from tritonrec.metrics.metrics_namespace import MetricNameBase, MetricPrefix

MAX_BUFFER_COUNT = 1000


class RecMetricException(Exception):
    pass


@dataclass(frozen=True)
class MetricComputationReport:
    name: MetricNameBase
    metric_prefix: MetricPrefix
    value: torch.Tensor
    description: str | None = None


class WindowBuffer:
    """The per-batch contributions currently inside a window state, oldest first, so they can be subtracted out."""

    def __init__(self, max_size: int, max_buffer_count: int) -> None:
        self._max_size = max_size
        self._buffers: deque[torch.Tensor] = deque(maxlen=max_buffer_count)
        self._used_sizes: deque[int] = deque(maxlen=max_buffer_count)
        self._window_used_size = 0

    def _remove_oldest(self, window_state: torch.Tensor) -> None:
        window_state -= self._buffers.popleft()
        self._window_used_size -= self._used_sizes.popleft()

    def aggregate_state(self, window_state: torch.Tensor, curr_state: torch.Tensor, size: int) -> None:
        """Add one batch (``size`` samples) to ``window_state`` in place, evicting the oldest batches that no longer
        fit (by count, then by samples; the batch just added always stays, the window being >= a batch)."""
        if len(self._buffers) == self._buffers.maxlen:
            self._remove_oldest(window_state)
        self._buffers.append(curr_state.clone())
        self._used_sizes.append(size)
        window_state += curr_state
        self._window_used_size += size
        while self._window_used_size > self._max_size:
            self._remove_oldest(window_state)

    def restart_from(self, window_state: torch.Tensor) -> None:
        """The window now holds ``window_state`` (a loaded sum): the per-batch contributions held so far are not in
        it, so they are forgotten, and the sum, which cannot be split back into batches, counts as one contribution
        of a full window, evicted whole by the next batch (torchrec keeps a loaded window sum forever)."""
        self._buffers.clear()
        self._used_sizes.clear()
        self._buffers.append(window_state.clone())
        self._used_sizes.append(self._max_size)
        self._window_used_size = self._max_size

    @property
    def buffers(self) -> deque[torch.Tensor]:
        return self._buffers


class RecMetricComputation(nn.Module, abc.ABC):
    """States and formula of one metric for ``n_tasks`` tasks. Subclasses add states in ``__init__`` with
    :meth:`_add_state`, accumulate them in ``update`` (inputs [n_tasks, B]) and turn them into reports in
    ``_compute``, reading states as attributes (during ``compute`` those are the values reduced over ranks)."""

    # metric-specific keyword arguments this computation accepts (RecMetric refuses others by name)
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        my_rank: int,
        batch_size: int,
        n_tasks: int,
        window_size: int,
        compute_on_all_ranks: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self._my_rank = my_rank
        self._batch_size = batch_size
        self._n_tasks = n_tasks
        self._window_size = window_size
        self._compute_on_all_ranks = compute_on_all_ranks
        self._process_group = process_group
        self._batch_window_buffers: dict[str, WindowBuffer] = {}
        self._reductions: dict[str, str] = {}  # state name -> "sum" | "cat"
        self._defaults: dict[str, torch.Tensor | list] = {}
        # follows .to(): where an empty list state is made on (AUC has no tensor state; on CUDA an empty CPU tensor
        # would enter NCCL's all-gather)
        self.register_buffer("_device_anchor", torch.zeros(0), persistent=False)
        # sync()/unsync(): while synced the states hold their reduced values and _cache the local ones
        self._is_synced = False
        self._cache: dict[str, torch.Tensor | list[torch.Tensor]] | None = None

    @staticmethod
    def get_window_state_name(state_name: str) -> str:
        return f"window_{state_name}"

    def get_window_state(self, state_name: str) -> torch.Tensor:
        return getattr(self, self.get_window_state_name(state_name))

    def _add_state(
        self, name: str, default: torch.Tensor | list, add_window_state: bool, dist_reduce_fx: str, persistent: bool
    ) -> None:
        """A tensor state (reduced by "sum", kept as a buffer so ``.to()`` and ``state_dict`` see it) or a list state
        (reduced by "cat": tensors [n_tasks, n] concatenated along samples; never persistent, as in torchrec)."""
        self._reductions[name] = dist_reduce_fx
        self._defaults[name] = default.detach().clone() if isinstance(default, torch.Tensor) else list(default)
        if isinstance(default, torch.Tensor):
            self.register_buffer(name, default.detach().clone(), persistent=persistent)
        else:
            setattr(self, name, list(default))
        if add_window_state:
            window_name = self.get_window_state_name(name)
            assert isinstance(default, torch.Tensor), "only tensor states have window twins"
            self._reductions[window_name] = dist_reduce_fx
            self._defaults[window_name] = default.detach().clone()
            self.register_buffer(window_name, default.detach().clone(), persistent=False)
            self._batch_window_buffers[window_name] = WindowBuffer(self._window_size, MAX_BUFFER_COUNT)

    def _aggregate_window_state(self, state_name: str, state: torch.Tensor, num_samples: int) -> None:
        window_name = self.get_window_state_name(state_name)
        self._batch_window_buffers[window_name].aggregate_state(getattr(self, window_name), state, num_samples)

    def _accumulate(self, states: dict[str, torch.Tensor], num_samples: int) -> None:
        """Add one batch's per-task sums to the lifetime states and their windows."""
        self._refuse_if_synced()
        for name, value in states.items():
            state = getattr(self, name)
            state += value
            self._aggregate_window_state(name, value, num_samples)

    @abc.abstractmethod
    def update(self, *, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        """``predictions``, ``labels``, ``weights``: [n_tasks, B]."""

    @abc.abstractmethod
    def _compute(self) -> list[MetricComputationReport]: ...

    def _local_list_state(self, name: str) -> torch.Tensor:
        parts = getattr(self, name)
        if parts:
            return torch.cat(parts, dim=-1)
        return torch.zeros(self._n_tasks, 0, device=self._device())

    def _device(self) -> torch.device:
        return self._device_anchor.device

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """``.to()`` / ``.cuda()`` / ``.double()`` also move what buffers do not hold: the window's per-batch
        contributions (subtracted from the window state later) and list states (AUC's kept samples)."""
        super()._apply(fn, recurse)
        for buffer in self._batch_window_buffers.values():
            buffer._buffers = deque((fn(t) for t in buffer._buffers), maxlen=buffer._buffers.maxlen)
        for name, fx in self._reductions.items():
            if fx == "cat":
                setattr(self, name, [fn(t) for t in getattr(self, name)])
        if self._cache is not None:  # the local states unsync() brings back move too
            self._cache = {n: [fn(t) for t in v] if isinstance(v, list) else fn(v) for n, v in self._cache.items()}
        return self

    def reduced_states(
        self, process_group: dist.ProcessGroup | None = None
    ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Every state (window twins included) reduced over ``process_group`` (this computation's group when None): a
        collective when torch.distributed is initialised, on every rank of the group. "sum" states [n_tasks] come back
        summed over the ranks; "cat" states as ``[tensor [n_tasks, sum of the ranks' samples]]`` (rank order), or
        ``[]`` when no rank holds a sample. New tensors: the local states are left untouched."""
        self._refuse_if_synced("reduced_states")
        group = process_group if process_group is not None else self._process_group
        sums = {n: getattr(self, n) for n, fx in self._reductions.items() if fx == "sum"}
        cats = {n: self._local_list_state(n) for n, fx in self._reductions.items() if fx == "cat"}
        if group_world_size(group) > 1:
            # every rank enters both collectives, even with no samples: skipping one would hang the others
            reduced_sums = all_reduce_sums(sums, group) if sums else {}
            gathered = all_gather_cat(cats, group) if cats else {}
        else:
            reduced_sums = {name: value.clone() for name, value in sums.items()}
            gathered = {name: value.clone() for name, value in cats.items()}
        out: dict[str, torch.Tensor | list[torch.Tensor]] = dict(reduced_sums)
        for name, value in gathered.items():
            out[name] = [value] if value.shape[-1] else []
        return {name: out[name] for name in self._reductions}

    def sync(self) -> None:
        """Replace the states by their values reduced over the process group (a collective, on every rank), keeping
        the local ones for :meth:`unsync`; ``local_compute()`` then reports global values. torchmetrics' semantics,
        as torchrec: nothing happens when torch.distributed is not initialised; syncing twice is an error."""
        if self._is_synced:
            raise RecMetricException(f"{type(self).__name__} has already been synced: call unsync() first")
        if not (dist.is_available() and dist.is_initialized()):
            return
        reduced = self.reduced_states()
        self._cache = {name: getattr(self, name) for name in self._reductions}
        for name, value in reduced.items():
            setattr(self, name, value)
        self._is_synced = True

    def _refuse_if_synced(self, action: str = "update") -> None:
        """An update while synced would go into the all-rank states that :meth:`unsync` throws away, and its window
        contribution would stay in the window's per-batch buffer, subtracted later from states that never held it
        (torchrec 1.8 then reports a wrong window value forever): refused. So are reducing the synced states again
        (each rank's data counted world_size times, as torchrec 1.8's get_pre_compute_states after sync() gives) and
        loading states that unsync() would throw away; ``action`` names the call refused."""
        if self._is_synced:
            raise RecMetricException(f"{type(self).__name__}.{action} while synced: call unsync() first")

    def unsync(self) -> None:
        """Restore the local states saved by :meth:`sync` (updates are refused while synced)."""
        if not self._is_synced or self._cache is None:
            raise RecMetricException(f"{type(self).__name__} is not synced: nothing to unsync")
        for name, value in self._cache.items():
            setattr(self, name, value)
        self._is_synced, self._cache = False, None

    def load_states(self, states: dict[str, torch.Tensor | list[torch.Tensor]]) -> None:
        """Set states from ``states`` ({state name: tensor, or list of tensors [n_tasks, n] for "cat" states}), e.g.
        one task's entry of ``RecMetricModule.get_pre_compute_states()``. The values are copied, so later updates do
        not write into ``states``; names not given keep their values. A loaded window sum stays in the window until
        the next update, which replaces it (see :meth:`WindowBuffer.restart_from`)."""
        self._refuse_if_synced("load_states")
        if not isinstance(states, dict):
            raise TypeError(f"states must be a dict of state name -> tensor or list, got {type(states).__name__}")
        for name, value in states.items():
            fx = self._reductions.get(name)
            if fx is None:
                known = list(self._reductions)
                raise ValueError(f"states: {type(self).__name__} has no state {name!r} (it has {known})")
            if fx == "sum":
                current = getattr(self, name)
                if not isinstance(value, torch.Tensor) or value.shape != current.shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(f"states[{name!r}] must be a tensor of shape {tuple(current.shape)}, got {got}")
                setattr(self, name, value.detach().to(current.device, current.dtype).clone())
                if name in self._batch_window_buffers:
                    self._batch_window_buffers[name].restart_from(getattr(self, name))
            else:
                if not isinstance(value, list) or not all(
                    isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == self._n_tasks for t in value
                ):
                    raise ValueError(f"states[{name!r}] must be a list of tensors [n_tasks={self._n_tasks}, n]")
                setattr(self, name, [t.detach().to(self._device()).clone() for t in value])

    @contextmanager
    def _synced(self) -> Iterator[None]:
        """Within this block the states read as their values reduced over the process group (already so after
        :meth:`sync`: reducing again would count every rank world_size times)."""
        if self._is_synced or group_world_size(self._process_group) <= 1:
            yield
            return
        reduced = self.reduced_states()
        saved = {name: getattr(self, name) for name in reduced}
        try:
            for name, value in reduced.items():
                setattr(self, name, value)
            yield
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def compute(self) -> list[MetricComputationReport]:
        """The reports over all ranks' states (collective on every rank; [] on ranks that do not report)."""
        with self._synced():
            if self._my_rank == 0 or self._compute_on_all_ranks:
                return self._compute()
            return []

    def local_compute(self) -> list[MetricComputationReport]:
        return self._compute()

    def reset(self) -> None:
        self._is_synced, self._cache = False, None  # as torchmetrics: the reset states are local ones
        for name, default in self._defaults.items():
            if isinstance(default, torch.Tensor):
                getattr(self, name).copy_(default)
            else:
                setattr(self, name, list(default))
        self._batch_window_buffers = {
            name: WindowBuffer(self._window_size, MAX_BUFFER_COUNT) for name in self._batch_window_buffers
        }
