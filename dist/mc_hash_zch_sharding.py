"""Sharding ``HashZchManagedCollisionModule`` tables (torchrec's MPZCH sharding) inside the sharded MC-EC / MC-EBC.

torchrec 1.8 (``torchrec/distributed/mc_modules.py``, ``sharding/rw_sharding.py``) shards a hash-ZCH table row-wise
like an MCH one, with two differences this module provides:

* routing by bucket: the input dist is ``RwSparseFeaturesDist(feature_hash_sizes=H,
  feature_total_num_buckets=B, keep_original_indices=True)``, i.e. FBGEMM's two-level block bucketize: with
  ``blk = ceil(H / B)`` an id ``x`` goes to rank ``x // (blk * B / W)`` when ``x < blk * B``, else (always, when
  ``H = 0``) to rank ``(x % B) // (B / W)``: the rank owning ``x``'s bucket when each rank owns ``B / W``
  consecutive buckets. Ids travel unchanged (:func:`destinations`, :func:`bucketize_by_rank`);
* which tables it takes (:func:`check_hash_zch_table`): ``B >= W`` (torchrec asserts it), each rank's rows on bucket
  boundaries (torchrec's ``rebuild_with_output_id_range`` raises otherwise) and, not built here, ``B % W != 0``
  (torchrec's uneven-bucket row positions), a rank owning other than buckets ``[r B / W, (r + 1) B / W)`` and
  ``disable_fallback`` (dropped ids would change lengths after the input dist).

The state dict is the MCH one (:mod:`tritonrec.dist.mc_sharding`): ``_hash_zch_identities`` (a parameter) and
``_hash_zch_metadata`` are ``ShardedTensor``\\ s of ``[num_embeddings, 1]``, ``_hash_zch_bucket`` stays local
(torchrec's ``sharded_parameter_names``). ``evict()`` reports global rows (plus the shard's offset), which the
collection makes local for the row reset, as torchrec's.
"""

from __future__ import annotations

import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules.mc_hash_zch import HashZchManagedCollisionModule

__all__ = ["HashZchRoute", "bucketize_by_rank", "check_hash_zch_table", "destinations"]


class HashZchRoute:
    """How one feature's ids reach ranks: ``rank = ((x % modulo) if modulo else x) // divisor``; ``shift``: the
    per-rank block subtracted from ids sent to ranks (0: ids travel unchanged, as torchrec's hash ZCH)."""

    def __init__(self, divisor: int, modulo: int = 0, shift: int = 0) -> None:
        self.divisor, self.modulo, self.shift = divisor, modulo, shift

    def rank_of(self, ids: torch.Tensor) -> torch.Tensor:
        return ((ids % self.modulo) if self.modulo else ids) // self.divisor


def check_hash_zch_table(
    name: str, module: HashZchManagedCollisionModule, rows: list[tuple[int, int, int]], world: int
) -> HashZchRoute:
    """Refuse (by table ``name``) what torchrec refuses or what is not built; ``rows``: per shard ``(offset, rows,
    rank)``. Returns the table's route."""
    buckets = module.buckets()
    if buckets < world:
        raise ValueError(
            f"table {name!r}: total_num_buckets={buckets} is less than the world size {world} (torchrec asserts "
            "buckets >= world size: every rank owns whole buckets)"
        )
    if buckets % world:
        raise NotImplementedError(
            f"table {name!r}: total_num_buckets={buckets} does not divide evenly over {world} ranks; sharding hash "
            "ZCH tables with uneven buckets per rank is not built"
        )
    if module.disable_fallback:
        raise NotImplementedError(
            f"table {name!r}: disable_fallback=True is not built for sharded hash ZCH tables (dropped ids would "
            "change the bag lengths after the input dist)"
        )
    per_rank = buckets // world
    segments = module._output_segments
    for offset, count, rank in rows:
        want = (segments[rank * per_rank], segments[(rank + 1) * per_rank])
        if (offset, offset + count) != want:
            raise ValueError(
                f"table {name!r}: rank {rank} holds rows [{offset}, {offset + count}), but with {buckets} buckets "
                f"over {world} ranks it must hold rows [{want[0]}, {want[1]}) (buckets [{rank * per_rank}, "
                f"{(rank + 1) * per_rank}) of output_segments {segments}): give each rank its buckets' rows in the "
                "plan, or use uniform output_segments (then an even row_wise() plan fits)"
            )
    size = module.input_size()
    if size == 0:
        return HashZchRoute(per_rank, modulo=buckets)
    return HashZchRoute(-(-size // buckets) * per_rank)


def destinations(features: KeyedJaggedTensor, routes: list[HashZchRoute]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per id of ``features`` (one route per key): ``([N] rank, [N] id as sent)``."""
    ranks, sent = [], []
    for ids, route in zip(features.values().split(features.length_per_key()), routes, strict=True):
        # in int64: a divisor or block past int32's range would wrap to another (or zero) divisor on int32 ids
        wide = ids.to(torch.int64)
        rank = route.rank_of(wide)
        ranks.append(rank)
        sent.append((wide - rank * route.shift).to(ids.dtype) if route.shift else ids)
    if not ranks:
        return features.values().new_empty(0, dtype=torch.int64), features.values()
    return torch.cat(ranks).to(torch.int64), torch.cat(sent)


def bucketize_by_rank(
    features: KeyedJaggedTensor, ranks: torch.Tensor, values: torch.Tensor, world: int
) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """``features`` (F keys, stride S) with each id's destination ``ranks [N]`` -> the bucketized KJT of
    ``world * F`` keys (rank-major, each bag's ids in input order, ``values`` as sent) and the unbucketize
    permutation (``[N]``: the bucketized position of each input id), as ``bucketize`` returns them."""
    lengths = features.lengths()
    bags, n = lengths.numel(), values.numel()
    arange = torch.arange(max(bags, n), device=lengths.device)  # no host sync below (sizes known on the host)
    bag_of = torch.repeat_interleave(arange[:bags], lengths.to(torch.int64), output_size=n)
    key = ranks.to(lengths.device) * bags + bag_of
    order = torch.sort(key, stable=True).indices
    new_lengths = torch.zeros(world * bags, dtype=lengths.dtype, device=lengths.device)
    new_lengths.index_add_(0, key, torch.ones_like(key, dtype=lengths.dtype))
    unbucketize = torch.empty_like(order).scatter_(0, order, arange[:n])
    weights = features.weights_or_none()
    new_weights = None if weights is None else weights[order]
    # consistent by construction (as rw.bucketize's output), so no re-validation
    keys = features.keys() * world
    out = KeyedJaggedTensor._trusted(keys, values[order], new_weights, new_lengths, features.stride())
    return out, unbucketize.to(values.dtype)
