"""Data parallelism for the unsharded part of a ``DistributedModelParallel`` (torchrec's ``DataParallelWrapper`` /
``DefaultDataParallelWrapper``): ``DistributedDataParallel`` over every parameter no sharded module owns, with
optional fp16 / bf16 all-reduce of the gradient buckets.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from tritonrec.dist.tensor_collectives import all_gather_tensor
from tritonrec.dist.types import ShardedModule, ShardingEnv

if TYPE_CHECKING:
    from tritonrec.dist.model_parallel import DistributedModelParallel

__all__ = [
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "compressed_allreduce_hook",
    "deterministic_allreduce_hook",
    "sharded_buffer_names",
    "sharded_parameter_names",
]

_COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# No buffer broadcast before every forward. torch 2.13 spells it forward_sync_buffers=False (buffers still synced
# once at init); older torch has only broadcast_buffers=False, which skips the init sync too: harmless for our
# modules, whose dense buffers (interaction indices) are the same constants on every rank.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def compressed_allreduce_hook(dtype: torch.dtype) -> Any:
    """A DDP comm hook averaging each gradient bucket in ``dtype`` (torch's fp16 / bf16 compress hooks, for every
    backend: torch's bf16 hook refuses gloo, whose bf16 all-reduce works)."""

    def hook(pg: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(pg))
        future = dist.all_reduce(compressed, group=pg, async_op=True).get_future()  # type: ignore[union-attr]

        def decompress(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(decompress)

    return _annotated(hook)


def deterministic_allreduce_hook(dtype: torch.dtype | None = None) -> Any:
    """A DDP comm hook averaging each gradient bucket in a fixed order: every rank's bucket (divided by the world
    size, in ``dtype`` on the wire when given) is all-gathered, and each rank sums the parts in rank order
    (``((g_0 + g_1) + g_2) + ...``, in the bucket's dtype), so every element's sum is the same whatever its place in
    the bucket, and the same on every rank.

    Why: an all-reduce over more than 2 ranks sums each element in an order that follows its offset in the reduced
    buffer (a ring splits the buffer into chunks). DDP reduces its first iterations in an initial bucket layout and
    later ones in the layout the gradients arrived in, so a freshly built DDP (a resumed job) sums its first steps in
    another order than the uninterrupted run did at the same steps: a few ULPs apart. With 2 ranks a sum has one order
    (a + b == b + a), so a plain all-reduce is already exact there. Cost: one collective per bucket, as DDP's, that
    receives ``world`` buckets instead of reducing one (fine for the dense part of a recommendation model; on a
    3-rank gloo run of the DLRM anchor's dense layers, a few ms per step).
    """

    def hook(pg: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if buffer.is_sparse:  # a sparse gradient (nn.Embedding(sparse=True)): gathered as dense it would not be
            return default_hooks.allreduce_hook(pg, bucket)
        world = dist.get_world_size(pg)
        # times 1 / world, as DDP's own reducer scales (x / 3 != x * (1 / 3) for a third of floats)
        sent = buffer.mul_(1.0 / world) if dtype is None else buffer.to(dtype).mul_(1.0 / world)
        gathered = sent.new_empty(world * sent.numel())
        work = all_gather_tensor(gathered, sent, group=pg, async_op=True)
        future = work.get_future()  # type: ignore[union-attr]

        def summed(done: torch.futures.Future[Any]) -> torch.Tensor:
            done.value()  # a failed gather raises here, instead of handing DDP the unfilled buffer
            parts = gathered.view(world, -1)
            buffer.copy_(parts[0])
            for rank in range(1, world):
                buffer.add_(parts[rank])  # in rank order, element by element: the layout cannot change it
            return buffer

        return future.then(summed)

    return _annotated(hook)


def _annotated(hook: Any) -> Any:
    # DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation)
    hook.__annotations__ = {"pg": dist.ProcessGroup, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}  # fmt: skip
    return hook


class DataParallelWrapper(abc.ABC):
    """Wraps the unsharded part of a :class:`DistributedModelParallel` in data parallelism."""

    @abc.abstractmethod
    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        """Replace ``dmp``'s wrapped module by its data-parallel form (its sharded parameters left alone)."""


class DefaultDataParallelWrapper(DataParallelWrapper):
    """``DistributedDataParallel`` over every parameter that no sharded module owns.

    Args:
        bucket_cap_mb: DDP's gradient bucket size (MiB).
        static_graph: the graph (and the set of used parameters) is the same every step (DDP's optimisation).
        find_unused_parameters: let DDP look for parameters a step did not use.
        allreduce_comm_precision: ``None`` (fp32 all-reduce), ``"fp16"`` or ``"bf16"`` (each bucket averaged in that
            dtype by :func:`compressed_allreduce_hook`; on gloo too).
        deterministic_allreduce: average the buckets with :func:`deterministic_allreduce_hook` (all-gather, then a
            sum in rank order), so every step sums in the same order whatever DDP's bucket layout: a resumed job (a
            fresh DDP) then trains bit for bit as the uninterrupted one. ``None`` (default): on for a gloo group of
            more than 2 ranks, where the layout changes the sum and the gather's memory is host memory; off
            otherwise (NCCL users with large dense parts choose it explicitly). DDP takes one comm hook: pass
            ``False`` to register your own on the wrapped module (sparse gradients take DDP's plain all-reduce).
        params_to_ignore: further parameter names to keep out of DDP.
        ddp_kwargs: further ``DistributedDataParallel`` arguments.
    """

    def __init__(
        self,
        bucket_cap_mb: int = 25,
        static_graph: bool = True,
        find_unused_parameters: bool = False,
        allreduce_comm_precision: str | None = None,
        deterministic_allreduce: bool | None = None,
        params_to_ignore: list[str] | None = None,
        ddp_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got bucket_cap_mb={bucket_cap_mb!r}")
        for name, value in (("static_graph", static_graph), ("find_unused_parameters", find_unused_parameters)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {name}={value!r}")
        if allreduce_comm_precision is not None and allreduce_comm_precision not in _COMM_DTYPES:
            raise ValueError(
                f"allreduce_comm_precision must be None, 'fp16' or 'bf16', got {allreduce_comm_precision!r}"
            )
        if deterministic_allreduce is not None and not isinstance(deterministic_allreduce, bool):
            raise TypeError(
                "deterministic_allreduce must be None or a bool, "
                f"got deterministic_allreduce={deterministic_allreduce!r}"
            )
        self._deterministic_allreduce = deterministic_allreduce
        self._bucket_cap_mb = bucket_cap_mb
        self._static_graph = static_graph
        self._find_unused_parameters = find_unused_parameters
        self._allreduce_comm_precision = allreduce_comm_precision
        self._params_to_ignore = set(params_to_ignore or [])
        self._ddp_kwargs = dict(ddp_kwargs or {})

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        module = dmp._dmp_wrapped_module
        if isinstance(module, DistributedDataParallel):
            return
        if env.process_group is None:
            raise RuntimeError("data parallelism needs a process group: build the ShardingEnv from one")
        ignored = set(sharded_parameter_names(module)) | set(sharded_buffer_names(module)) | self._params_to_ignore
        if not set(dict(module.named_parameters())) - ignored:
            return  # nothing dense to synchronise
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(ignored))
        ddp = DistributedDataParallel(
            module.to(device),
            device_ids=None if device.type == "cpu" else [device],
            process_group=env.process_group,
            gradient_as_bucket_view=True,
            **_NO_FORWARD_BUFFER_SYNC,
            static_graph=self._static_graph,
            find_unused_parameters=self._find_unused_parameters,
            bucket_cap_mb=self._bucket_cap_mb,
            **self._ddp_kwargs,
        )
        dtype = None if self._allreduce_comm_precision is None else _COMM_DTYPES[self._allreduce_comm_precision]
        deterministic = self._deterministic_allreduce
        if deterministic is None:
            group = env.process_group
            deterministic = dist.get_world_size(group) > 2 and dist.get_backend(group) == dist.Backend.GLOO
        if deterministic:
            ddp.register_comm_hook(env.process_group, deterministic_allreduce_hook(dtype))
        elif dtype is not None:
            ddp.register_comm_hook(env.process_group, compressed_allreduce_hook(dtype))
        dmp._dmp_wrapped_module = ddp


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def sharded_parameter_names(module: nn.Module, prefix: str = "") -> Iterator[str]:
    """Parameters owned by sharded modules (each module's ``sharded_parameter_names``)."""
    if isinstance(module, ShardedModule):
        yield from module.sharded_parameter_names(prefix)
        return
    for name, child in module.named_children():
        yield from sharded_parameter_names(child, join_name(prefix, name))


def sharded_buffer_names(module: nn.Module, prefix: str = "") -> Iterator[str]:
    """Buffers of sharded modules (rank-local: data parallelism must not broadcast them)."""
    if isinstance(module, ShardedModule):
        for name, _ in module.named_buffers(prefix=prefix):
            yield name
        return
    for name, child in module.named_children():
        yield from sharded_buffer_names(child, join_name(prefix, name))
