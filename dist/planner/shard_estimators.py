"""Per-shard storage and step-time estimates.

Notation for one shard of a ``[rows, dim]`` table with ``r x c`` shard (``W`` ranks, ``L`` per host): per feature
``f`` reading the table, ``B_f`` samples per rank, ``P_f`` ids per bag, ``N_f`` bags per sample. Per rank's batch:
``ids = sum_f B_f P_f N_f``, ``bags = sum_f B_f N_f``. What the shard serves per step:

* TW / CW / TWCW: the global batch - ``W ids`` ids, ``W bags`` bags;
* RW / TWRW / GRID: the ids falling in its rows (uniform ids: ``W ids x r / rows``), a partial output for all
  ``W bags`` bags;
* DP: the rank's own batch - ``ids`` ids, ``bags`` bags.

**Storage** (bytes, in HBM on cuda and host memory on cpu): the weights (``sharder.storage_usage`` of the shard),
the fused optimizer state (rowwise Adagrad: one fp32 per row, ``4 r``; per-element Adagrad: one fp32 per element,
``4 r c``; Adam: two, ``8 r c``; SGD: none), for the ``dense`` kernel the autograd gradient (``r c x element size``),
and the step's buffers: input ids (8 bytes each, +4 with per-id weights) and lengths (8 bytes per bag), output
(4 bytes per output element: ``bags x c`` pooled, ``ids x c`` sequence) counted twice (forward output and its
gradient).

**Perf** (seconds): lookup compute ``table_s + served bags x bag_s + served ids x id_s + served ids x c x element
size / bytes_per_s`` forward and backward (the dense kernel also touches its whole gradient: ``+ r c x element size /
bwd bytes_per_s``): a row shard divides a table's ids but not its bags or its per-table cost, which is why row-wise
does not halve a small table's time. Comms with the topology's link bandwidth (``intra_host_bw`` when all ranks
share a host, else ``inter_host_bw``) times the collective's calibrated efficiency, on the bytes that cross ranks (a
fraction ``(W-1)/W`` of what the rank exchanges):

* input dist (every type but DP): all-to-all of the served ids and lengths, plus ``input_dist.id_s`` per served id
  (unpacking and regrouping by key); row-split types also bucketize the rank's own ids of the table by row block
  (``ids x bucketize_id_s``, on every rank holding a row shard);
* output dist of TW / CW / TWCW, and of sequence lookups: all-to-all of the output, its gradient back in backward;
* RW pooled: reduce-scatter of the partial output, all-gather of its gradient;
* TWRW / GRID pooled: reduce-scatter inside the host (``(L-1)/L`` of the output, host bandwidth), then all-to-all of
  the reduced ``1/L`` slice; mirrored in backward;
* DP: all-reduce of the gradient (``2 (W-1)/W x r c x element size``).

Fixed per-call costs (a lookup call, each collective's latency, the KJT all-to-all's calls, one bucketize call) are
paid once per group of tables batched together, not per table: the perf model adds them per plan
(:func:`group_fixed_perf`). On a CPU host over gloo these fixed costs are milliseconds, so a plan mixing sharding
types (one more group: more collectives) or splitting small tables row-wise pays for them.
"""

from __future__ import annotations

from typing import Any

import torch

from tritonrec.dist.planner.types import Perf, ShardingOption, Storage, Topology
from tritonrec.dist.types import EmbeddingComputeKernel, ShardingType
from tritonrec.kernels.embedding import OptimType

INDEX_BYTES = 8  # int64 ids
LENGTH_BYTES = 8  # int64 lengths
WEIGHT_BYTES = 4  # fp32 per-id weights
OUTPUT_BYTES = 4  # fp32 lookup outputs
STATE_BYTES = 4  # fp32 optimizer state

__all__ = [
    "EmbeddingPerfEstimator",
    "EmbeddingStorageEstimator",
    "group_fixed_perf",
    "served_ids_and_bags",
]

_ROW_SPLIT = {ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value}
_WHOLE_BATCH = {ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value}
_DP = ShardingType.DATA_PARALLEL.value


def served_ids_and_bags(option: ShardingOption, shard_rows: int, world_size: int) -> tuple[float, float]:
    """``(ids looked up, bags produced)`` per step by a shard of ``shard_rows`` rows (see module docstring)."""
    ids = sum(b * p * n for b, p, n in zip(option.batch_sizes, option.input_lengths, option.num_poolings, strict=True))
    bags = sum(b * n for b, n in zip(option.batch_sizes, option.num_poolings, strict=True))
    if option.sharding_type == _DP:
        return float(ids), float(bags)
    rows = option.tensor.shape[0]
    fraction = shard_rows / rows if option.sharding_type in _ROW_SPLIT and rows else 1.0
    return float(world_size * ids * fraction), float(world_size * bags)


def _output_elements(option: ShardingOption, ids: float, bags: float, shard_cols: int) -> float:
    """Output elements of the shard's lookup (pooled: one row per bag; sequence: one row per id)."""
    cols = shard_cols * (option.output_dim or option.tensor.shape[1]) / option.tensor.shape[1]
    return (bags if option.is_pooled else ids) * cols


def _input_bytes(option: ShardingOption, ids: float, bags: float) -> float:
    return ids * (INDEX_BYTES + (WEIGHT_BYTES if option.is_weighted else 0)) + bags * LENGTH_BYTES


def _storage(kind: str, nbytes: float) -> Storage:
    return Storage(hbm=round(nbytes)) if kind == "hbm" else Storage(ddr=round(nbytes))


class EmbeddingStorageEstimator:
    """Fills ``shard.storage`` of every option (see module docstring).

    Args:
        topology: the machines (decides HBM vs host memory).
        constraints: unused (torchrec's signature).
        default_optimizer: the fused rule assumed when neither the sharder nor the module names one.
    """

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, Any] | None = None,
        default_optimizer: OptimType = OptimType.EXACT_ROWWISE_ADAGRAD,
    ) -> None:
        self._topology = topology
        self._default_optimizer = default_optimizer

    def estimate(self, options: list[ShardingOption], sharder_map: dict[str, Any] | None = None) -> None:
        for option in options:
            for shard in option.shards:
                shard.storage = self.shard_storage(option, shard.size)

    def shard_storage(self, option: ShardingOption, size: list[int]) -> Storage:
        topo, (r, c) = self._topology, size
        kind = topo.storage_kind
        meta = torch.empty((r, c), dtype=option.tensor.dtype, device="meta")
        usage = option.sharder.storage_usage(meta, topo.compute_device, option.compute_kernel)
        storage = Storage(hbm=int(usage.get("hbm", 0)), ddr=int(usage.get("ddr", 0)))
        extra = 0.0
        if option.compute_kernel == EmbeddingComputeKernel.FUSED.value:
            optimizer = option.optimizer or self._default_optimizer
            if optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
                extra += r * STATE_BYTES
            elif optimizer == OptimType.EXACT_ADAGRAD:
                extra += r * c * STATE_BYTES
            elif optimizer == OptimType.ADAM:
                extra += 2 * r * c * STATE_BYTES
        elif option.compute_kernel == EmbeddingComputeKernel.DENSE.value:
            extra += r * c * option.tensor.element_size()
        ids, bags = served_ids_and_bags(option, r, topo.world_size)
        extra += _input_bytes(option, ids, bags) + 2 * _output_elements(option, ids, bags, c) * OUTPUT_BYTES
        return storage + _storage(kind, extra)


class EmbeddingPerfEstimator:
    """Fills ``shard.perf`` of every option with the calibrated model of the topology (see module docstring)."""

    def __init__(self, topology: Topology, constraints: dict[str, Any] | None = None) -> None:
        self._topology = topology

    def estimate(self, options: list[ShardingOption], sharder_map: dict[str, Any] | None = None) -> None:
        for option in options:
            for shard in option.shards:
                shard.perf = self.shard_perf(option, shard.size)

    def _comm(self, collective: str, nbytes: float, bandwidth: float) -> float:
        return nbytes / (bandwidth * self._topology.coefficients.efficiency(collective))

    def shard_perf(self, option: ShardingOption, size: list[int]) -> Perf:
        topo, (r, c) = self._topology, size
        lookup = topo.coefficients.lookup
        world, local = topo.world_size, topo.local_world_size
        elem = option.tensor.element_size()
        ids, bags = served_ids_and_bags(option, r, world)
        fwd_compute = lookup.fwd_table_s + bags * lookup.fwd_bag_s + ids * lookup.fwd_id_s
        fwd_compute += ids * c * elem / lookup.fwd_bytes_per_s
        bwd_compute = lookup.bwd_table_s + bags * lookup.bwd_bag_s + ids * lookup.bwd_id_s
        bwd_compute += ids * c * elem / lookup.bwd_bytes_per_s
        if option.compute_kernel == EmbeddingComputeKernel.DENSE.value:
            bwd_compute += r * c * elem / lookup.bwd_bytes_per_s
        link = topo.intra_host_bw if topo.num_hosts == 1 else topo.inter_host_bw
        remote = (world - 1) / world
        kind = option.sharding_type
        if kind == _DP:
            all_reduce = self._comm("all_reduce", 2 * remote * r * c * elem, link)
            return Perf(fwd_compute, 0.0, bwd_compute, all_reduce)
        inputs = topo.coefficients.input_dist
        input_dist = self._comm("all_to_all", remote * _input_bytes(option, ids, bags), link) + ids * inputs.id_s
        if kind in _ROW_SPLIT:  # the rank holding this shard bucketizes its own batch's ids of the table
            local_ids, _ = served_ids_and_bags(option, option.tensor.shape[0], 1)
            fwd_compute += local_ids * inputs.bucketize_id_s
        out_bytes = _output_elements(option, ids, bags, c) * OUTPUT_BYTES
        if kind in _WHOLE_BATCH or not option.is_pooled:
            fwd_out = bwd_out = self._comm("all_to_all", remote * out_bytes, link)
        elif kind == ShardingType.ROW_WISE.value:
            fwd_out = self._comm("reduce_scatter", remote * out_bytes, link)
            bwd_out = self._comm("all_gather", remote * out_bytes, link)
        else:  # TWRW / GRID pooled: reduce inside the host, then send the reduced slice to its owners
            host = (local - 1) / local * out_bytes
            across = self._comm("all_to_all", remote * out_bytes / local, link)
            fwd_out = self._comm("reduce_scatter", host, topo.intra_host_bw) + across
            bwd_out = self._comm("all_gather", host, topo.intra_host_bw) + across
        return Perf(fwd_compute, input_dist + fwd_out, bwd_compute, bwd_out)


def group_fixed_perf(sharding_type: str, is_pooled: bool, topology: Topology) -> tuple[Perf, Perf]:
    """``(comms, compute)`` fixed costs of one group of tables sharded alike in one module: the collectives'
    latencies and, for row-split types, one bucketize call (paid by every rank, all take part) and one lookup call
    forward and backward (paid by the ranks holding a shard of the group)."""
    coeffs = topology.coefficients
    inputs = coeffs.input_dist
    latency = {name: c.latency_s for name, c in coeffs.comms.items()}
    compute = Perf(fwd_compute=coeffs.lookup.fwd_call_s, bwd_compute=coeffs.lookup.bwd_call_s)
    if topology.world_size == 1:
        return Perf(), compute
    if sharding_type in coeffs.group_step_s:  # measured end to end: every rank waits for the whole of it
        fwd, bwd = coeffs.group_step_s[sharding_type]
        return Perf(fwd_comms=fwd, bwd_comms=bwd), Perf()
    if sharding_type == _DP:
        return Perf(bwd_comms=latency["all_reduce"]), compute
    if sharding_type in _WHOLE_BATCH or not is_pooled:
        out_fwd = out_bwd = latency["all_to_all"]
    elif sharding_type == ShardingType.ROW_WISE.value:
        out_fwd, out_bwd = latency["reduce_scatter"], latency["all_gather"]
    else:
        out_fwd = latency["reduce_scatter"] + latency["all_to_all"]
        out_bwd = latency["all_gather"] + latency["all_to_all"]
    bucketize = inputs.bucketize_call_s if sharding_type in _ROW_SPLIT else 0.0
    return Perf(fwd_compute=bucketize, fwd_comms=inputs.latency_s + out_fwd, bwd_comms=out_bwd), compute
