"""The machinery of tower sharding (torchrec's ``embedding_tower_sharding``; the sharders and sharded modules are in
:mod:`tritonrec.dist.embedding_tower_sharding`): each WHOLE tower of an :class:`EmbeddingTower` or an
:class:`EmbeddingTowerCollection` - its tables and its interaction module - runs on one host, so the interaction's
parameters live there only instead of being replicated on every rank.

Per batch, on rank ``r`` of host ``h`` (local rank ``l``; ``B`` samples per rank, ``H`` hosts):

* ``input_dist``: the features every tower reads, ordered host by host, go by ``KJTAllToAll`` over the cross-node
  group of local rank ``l`` (one rank per host), so local rank ``l`` of a tower's host receives the ``H * B``
  samples of local rank ``l`` of every host.
* ``compute``: on a tower's host, its embedding module, sharded over the host's own process group (table-row-wise
  tables row-wise, table-column-wise ones column-wise: :mod:`tritonrec.dist.embedding_tower_plan`), then its
  interaction -> ``[H * B, N_tower]``; the host's towers side by side. A host without a tower gives ``[H * B, 0]``.
* ``output_dist``: ``PooledEmbeddingsAllToAll`` over the same cross-node group sends every rank its ``B`` rows of
  every tower -> ``[B, sum(N)]``, the towers in the unsharded module's order.

Gradients: the output all-to-all divides its gradient by the number of hosts (gradient division, as every comm op)
and, when a host has several ranks, the interaction's gradients are averaged over them (``DistributedDataParallel``
over the host's group, torchrec's "hierarchical DDP"), which gives the global batch's mean gradient. The interaction
is not under the model's own DDP (its parameters are a sharded module's).

Module layout and state dict (torchrec's keys): a sharded tower has ``embedding`` and ``interaction`` (``None`` on the
other hosts); a sharded collection has ``towers.{i}.embedding`` / ``towers.{i}.interaction`` for its host's towers
only. Tables are ``ShardedTensor``\\ s over the host's group, interactions plain tensors.

Two deliberate differences from torchrec: its collection concatenates the towers' outputs host by host, so a plan
that does not put tower ``i`` on a host before tower ``i + 1`` silently reorders the output columns; ours puts them
back in tower order. A bad plan is a ``ValueError`` naming the tower and the table, not an ``assert``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable
from tritonrec.dist.comm import intra_and_cross_node_pg
from tritonrec.dist.dist_data import PooledEmbeddingsAllToAll
from tritonrec.dist.embedding_tower_inputs import TowerInputDist, TowerInputs
from tritonrec.dist.embedding_tower_plan import (
    embedding_sharder,
    intra_node_plan,
    tower_feature_names,
    tower_host,
    tower_table_names,
)
from tritonrec.dist.qcomm_protocol import CommOp, QuantizedCommCodecs
from tritonrec.dist.sharded_fused_optimizer import HyperparamsOnlyOptimizer
from tritonrec.dist.types import FusedOptimizerModule, Multistreamable, ParameterSharding, ShardedModule, ShardingEnv
from tritonrec.modules.embedding_tower import EmbeddingTower, tower_input_params
from tritonrec.optim.keyed import CombinedOptimizer, KeyedOptimizer


class EmbeddingTowerCollectionContext(Multistreamable):
    """Per batch: each source rank's batch size on the cross-node group (set when the input dist's splits arrive)."""

    def __init__(self) -> None:
        self.embedding_contexts: list[Multistreamable] = []  # torchrec's field; the towers keep their own
        self.batch_size_per_rank: list[int] = []
        self.tower_widths: list[int] = []  # this host's towers' output widths (set by compute)

    def record_stream(self, stream: torch.Stream) -> None:
        for context in self.embedding_contexts:
            context.record_stream(stream)


class TowerLazyAwaitable(LazyAwaitable[torch.Tensor]):
    """The output all-to-all's ``[B, sum(N)]``, columns put in tower order (``column_order``: ``None`` when the
    hosts' order already is)."""

    def __init__(self, awaitable: Awaitable[torch.Tensor], column_order: torch.Tensor | None) -> None:
        super().__init__()
        self._awaitable = awaitable
        self._column_order = column_order

    def _wait_impl(self) -> torch.Tensor:
        output = self._awaitable.wait()
        if self._column_order is None:
            return output
        return output.index_select(1, self._column_order.to(output.device))


class LocalTower(nn.Module):
    """One tower on its host: the sharded embedding module and the interaction (torchrec's submodule names)."""

    def __init__(self, embedding: nn.Module, interaction: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.interaction = interaction


def _check_env(env: object) -> ShardingEnv:
    if not isinstance(env, ShardingEnv):
        raise TypeError(f"env must be a ShardingEnv, got {type(env).__name__}")
    if env.process_group is None or not dist.is_initialized():
        raise ValueError("tower sharding needs a process group: env.process_group is None")
    if env.world_size != dist.get_world_size() or env.rank != dist.get_rank():
        raise ValueError(
            f"tower sharding runs on the default (world) group: env has world_size={env.world_size}, rank={env.rank}, "
            f"the world has {dist.get_world_size()} ranks and this is rank {dist.get_rank()}"
        )
    return env


class ShardedEmbeddingTowers(
    ShardedModule[TowerInputs, torch.Tensor, torch.Tensor, EmbeddingTowerCollectionContext], FusedOptimizerModule
):
    """What the sharded tower and the sharded collection share (see module docstring): placing the towers on their
    hosts, sharding the local ones, and the three steps. Subclasses say where the local towers are registered
    (:meth:`_register`) and under which key prefix (:meth:`_prefix`)."""

    def __init__(
        self,
        towers: list[EmbeddingTower],
        names: list[str],
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        ShardedModule.__init__(self, qcomm_codecs_registry)
        self._init_containers()
        env = _check_env(env)
        if not isinstance(table_name_to_parameter_sharding, dict):
            raise TypeError(
                "table_name_to_parameter_sharding must be a dict of table -> ParameterSharding, got "
                f"{type(table_name_to_parameter_sharding).__name__}"
            )
        if device is not None and not isinstance(device, torch.device):
            raise TypeError(f"device must be a torch.device or None, got {device!r}")
        self._device = device if device is not None else torch.device("cpu")
        intra, cross = intra_and_cross_node_pg(self._device)
        assert intra is not None and cross is not None  # a real device always gets both groups
        self._intra_pg, self._cross_pg = intra, cross
        local_size, num_hosts = intra.size(), cross.size()
        my_host = dist.get_rank() // local_size
        plan = table_name_to_parameter_sharding
        tables = [tower_table_names(t) for t in towers]
        known = {table for names_ in tables for table in names_}
        unknown = sorted(set(plan) - known)
        if unknown:
            raise ValueError(f"the plan names tables {unknown} that no tower holds (the towers hold {sorted(known)})")
        self._hosts = [
            tower_host(name, t, plan, local_size, env.world_size) for name, t in zip(names, tables, strict=True)
        ]
        # physical order: host by host, the towers of a host in tower order (what the output all-to-all delivers)
        self._physical_order = [i for h in range(num_hosts) for i, host in enumerate(self._hosts) if host == h]
        feature_names = [tower_feature_names(t) for t in towers]
        per_host = [[i for i in self._physical_order if self._hosts[i] == h] for h in range(num_hosts)]
        self._input = TowerInputDist(
            [[feature_names[i][0] for i in towers_] for towers_ in per_host],
            [[feature_names[i][1] for i in towers_] for towers_ in per_host],
            cross,
        )
        self._local: list[tuple[int, nn.Module, nn.Module, tuple[bool, bool]]] = []
        # a host of several ranks averages the interaction's gradients over them (unregistered: state-dict keys
        # stay torchrec's ``interaction.*`` rather than DDP's ``interaction.module.*``)
        self._interaction_ddp: dict[int, DistributedDataParallel] = {}
        intra_env = ShardingEnv(local_size, intra.rank(), intra)
        for i in (i for i in self._physical_order if self._hosts[i] == my_host):
            tower = towers[i]
            tower_plan = intra_node_plan({t: plan[t] for t in tables[i]}, local_size)
            sharder = embedding_sharder(tower, fused_params, qcomm_codecs_registry)
            embedding = sharder.shard(tower.embedding, tower_plan, intra_env, self._device)  # type: ignore[arg-type]
            interaction = tower.interaction.to(self._device)
            self._register(i, embedding, interaction)
            self._local.append((i, embedding, interaction, tower_input_params(tower.embedding)))
            if local_size > 1:
                self._interaction_ddp[i] = DistributedDataParallel(
                    interaction,
                    device_ids=None if self._device.type == "cpu" else [self._device],
                    process_group=intra,
                    broadcast_buffers=False,
                )
        self._num_towers = len(towers)
        # the output all-to-all, built at the first batch; unregistered, as the embedding collections' comm modules'
        # buffers are not state (torchrec leaves them out of the state dict too)
        self._comm: dict[str, PooledEmbeddingsAllToAll] = {}
        self._column_order: torch.Tensor | None = None
        self._local_widths: list[int] | None = None

    # ------------------------------------------------------------------------------------------- for subclasses
    def _init_containers(self) -> None:
        """Create the (empty) submodules the local towers are registered in."""
        raise NotImplementedError

    def _register(self, index: int, embedding: nn.Module, interaction: nn.Module) -> None:
        raise NotImplementedError

    def _prefix(self, index: int) -> str:
        """State-dict key prefix of tower ``index``'s entries."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------------------- steps
    def create_context(self) -> EmbeddingTowerCollectionContext:
        return EmbeddingTowerCollectionContext()

    def _input_dist(
        self,
        ctx: EmbeddingTowerCollectionContext,
        features: KeyedJaggedTensor | None,
        weighted_features: KeyedJaggedTensor | None,
    ) -> Awaitable[Awaitable[TowerInputs]]:
        return self._input.dist(ctx, features, weighted_features)

    def compute(self, ctx: EmbeddingTowerCollectionContext, dist_input: TowerInputs) -> torch.Tensor:
        """The received samples (``[H * B]`` of them) -> ``[H * B, sum(N_local)]``: each local tower's interaction of
        its embeddings, side by side in tower order; ``[H * B, 0]`` on a host without towers."""
        rows = sum(ctx.batch_size_per_rank)
        if not self._local:
            return torch.empty([rows, 0], device=self._device, requires_grad=True)
        features, weighted_features = dist_input
        outputs = []
        for i, embedding, interaction, (takes_features, takes_weighted) in self._local:
            if takes_features and takes_weighted:
                embedded = embedding(features, weighted_features)
            else:
                embedded = embedding(features if takes_features else weighted_features)
            if isinstance(embedded, Awaitable):
                embedded = embedded.wait()
            out = self._interaction_ddp.get(i, interaction)(embedded)
            if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != rows:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"{self._prefix(i)}interaction must return a [{rows}, N] tensor, got {shape}")
            outputs.append(out)
        ctx.tower_widths = [int(out.shape[1]) for out in outputs]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def output_dist(self, ctx: EmbeddingTowerCollectionContext, output: torch.Tensor) -> LazyAwaitable[torch.Tensor]:
        """``[H * B, sum(N_local)]`` -> lazy ``[B, sum(N)]`` (this rank's samples, every tower, in tower order)."""
        if "output" not in self._comm:
            self._create_output_dist(ctx.tower_widths)
        if ctx.tower_widths != self._local_widths:
            raise ValueError(
                f"this host's towers returned widths {ctx.tower_widths}; the first batch's were {self._local_widths} "
                "(a tower's output width must not change between batches)"
            )
        awaitable = self._comm["output"](output, batch_size_per_rank=ctx.batch_size_per_rank)
        return TowerLazyAwaitable(awaitable, self._column_order)

    def _create_output_dist(self, widths: list[int]) -> None:
        """At the first batch: every host learns every tower's width (one small all-gather), which sizes the output
        all-to-all and gives the columns' tower order."""
        self._local_widths = list(widths)
        mine = [(i, w) for (i, *_), w in zip(self._local, widths, strict=True)]
        gathered: list[Any] = [None] * self._cross_pg.size()
        dist.all_gather_object(gathered, mine, group=self._cross_pg)
        width_of = {i: w for host in gathered for i, w in host}
        physical = [i for host in gathered for i, _ in host]
        starts, position = {}, 0
        for i in physical:
            starts[i] = position
            position += width_of[i]
        order = [starts[i] + c for i in range(self._num_towers) for c in range(width_of[i])]
        if order != list(range(len(order))):
            self._column_order = torch.tensor(order, dtype=torch.int64, device=self._device)
        codecs = self.qcomm_codecs_registry.get(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name)
        self._comm["output"] = PooledEmbeddingsAllToAll(
            self._cross_pg, [sum(w for _, w in host) for host in gathered], self._device, codecs=codecs
        )

    # ---------------------------------------------------------------------------------------------------- state
    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The local towers' embedding optimizers, keyed ``<tower prefix>embedding.<parameter>`` (empty on a host
        without towers)."""
        optims: list[tuple[str, KeyedOptimizer]] = []
        for i, embedding, _, _ in self._local:
            optimizer = embedding.fused_optimizer  # type: ignore[union-attr]
            if not isinstance(optimizer, KeyedOptimizer):
                optimizer = HyperparamsOnlyOptimizer(optimizer)
            optims.append((f"{self._prefix(i)}embedding", optimizer))
        return CombinedOptimizer(optims)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Loads this host's towers' entries; entries of the towers on other hosts (an unsharded model's full state
        dict holds them all) are skipped, not reported as unexpected."""
        local = {i for i, *_ in self._local}
        others = [self._prefix(i) for i in range(self._num_towers) if i not in local]
        own = {k: v for k, v in state_dict.items() if not any(k.startswith(p) for p in others if p)}
        if not local and self._prefix(0) == "":  # a single tower on another host: nothing of it is here
            own = {}
        return super().load_state_dict(own, strict=strict, assign=assign)


__all__ = ["EmbeddingTowerCollectionContext", "LocalTower", "ShardedEmbeddingTowers", "TowerLazyAwaitable"]
