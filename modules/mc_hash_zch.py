"""``HashZchManagedCollisionModule`` (torchrec's ``hash_mc_modules``): multi-probe zero-collision hashing (MPZCH).

One identity per row, ``_hash_zch_identities [zch_size, 1]`` (-1 = free). An id ``x`` goes to bucket ``b``
(``x // ceil(input_hash_size / buckets)``, or ``x % buckets`` when ``input_hash_size`` is 0) with rows
``[offset_b, offset_b + size_b)``; probe ``k`` is ``(murmur3(x) + k) mod size_b`` (fbgemm's ``murmur_hash3_2x64(x,
0, 0)``, an unsigned 64-bit hash, taken modulo unsigned as ``zero_collision_hash`` does).

* Training inserts: the first probe holding ``x`` is a hit, else the first free probe is claimed. Eviction keeps
  ``_hash_zch_metadata [zch_size, 1]``: int32 expiry hours (hour of the last hit + the TTL of the id's feature);
  hits and claims raise a row's expiry to the id's (fbgemm's ``atomicMax``). A row is expired when ``now >
  expiry`` and its expiry is below the incoming id's; evicted rows are reported by :meth:`evict`.
  ``SINGLE_TTL_EVICTION`` / ``PER_FEATURE_TTL_EVICTION`` (fbgemm's ``eviction_policy`` 0, threshold ``now``): an id
  absent from its probe chain takes the first expired probe. ``LRU_EVICTION`` (``eviction_policy`` 1, ``single_ttl``):
  only when all ``max_probe`` probes are taken, the expired probe expiring first.
* ``opt_in_prob`` in [1, 100) with ``percent_reserved_slots``: each bucket's last ``reserved`` rows hold no
  identities; probing wraps in the bucket's other rows. In training a new id (not in its probe chain) opts in with
  probability ``opt_in_prob`` %; one that does not is sent to reserved row ``murmur3(x) mod reserved`` (its expiry
  raised there). ``opt_in_prob`` 100: everyone opts in; the reserved rows only take the fallback.
* Eval, ``is_inference`` and features named ``*_readonly`` only look up, over all ``max_probe`` probes.
* An id with no row after ``max_probe`` probes gets its first probe (its reserved row with ``opt_in_prob``), or with
  ``disable_fallback`` -1: dropped, bag lengths shortened and the weights of dropped ids dropped too (row 0 and
  lengths kept with ``no_bag``).

fbgemm inserts on the GPU, one thread per id racing with compare-and-swap. Here races are settled one probe round
at a time: in round ``k`` every id still looking examines its ``k``-th probe, hits go first, then each contested
row goes to the id seen first in the batch: one of the outcomes the concurrent kernel can produce. LRU evictions
follow the rounds, each contested row again to the first id (fbgemm locks it; the others take their next
candidate). Repeats of an id in a batch act as one id with their largest expiry, opting in if any repeat does.
torchrec 1.8 cannot insert on CPU (fbgemm-gpu-cpu's ``zero_collision_hash`` requires ``readonly=True``); its CPU
lookups match.

Not supported (``NotImplementedError``): runtime metadata (``track_id_freq``, ``write_runtime_meta_dim``);
``tb_logging_frequency`` is accepted and ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any

import torch

from tritonrec.data import JaggedTensor
from tritonrec.kernels.checks import check_int, value_checks_enabled
from tritonrec.modules import mc_hash_zch_checks as checks
from tritonrec.modules.mc_base import ManagedCollisionModule, check_id_features
from tritonrec.modules.mc_hash_zch_probe import ZchProbes, murmur_hash3_2x64, unsigned_mod, zch_in_chain, zch_probe

__all__ = ["HashZchEvictionConfig", "HashZchEvictionPolicyName", "HashZchManagedCollisionModule", "murmur_hash3_2x64"]


@unique
class HashZchEvictionPolicyName(Enum):
    """torchrec 1.8's eviction policy names (fbgemm's kernel policies are threshold eviction, used by both TTL
    policies, and LRU eviction; see the module docstring)."""

    SINGLE_TTL_EVICTION = "SINGLE_TTL_EVICTION"
    PER_FEATURE_TTL_EVICTION = "PER_FEATURE_TTL_EVICTION"
    LRU_EVICTION = "LRU_EVICTION"


@dataclass
class HashZchEvictionConfig:
    """torchrec's eviction config. ``single_ttl``: hours an id keeps its row after its last hit
    (``SINGLE_TTL_EVICTION``, ``LRU_EVICTION``); ``per_feature_ttl``: those hours per feature of ``features``, the
    table's features in the order its ids arrive (``PER_FEATURE_TTL_EVICTION``)."""

    features: list[str]
    single_ttl: int | None = None
    per_feature_ttl: list[int] | None = None


class HashZchManagedCollisionModule(ManagedCollisionModule):
    """Multi-probe zero-collision hash over ``zch_size`` rows (see the module docstring); torchrec's arguments.

    Args:
        zch_size: rows of this module (the table's ``num_embeddings`` on this shard).
        device: where the identities live.
        total_num_buckets: buckets of the unsharded table (equal unless ``output_segments`` is given).
        max_probe: probes per id before falling back.
        input_hash_size: ids lie in ``[0, input_hash_size)`` and are bucketed by range; 0 buckets by ``id % buckets``.
        output_segments: row boundaries of the buckets, ``[0, ..., zch_size]`` of the unsharded table.
        is_inference: lookup only, no metadata kept (and none loaded).
        eviction_policy_name / eviction_config: ``SINGLE_TTL_EVICTION`` or ``LRU_EVICTION`` with ``single_ttl``
            hours, ``PER_FEATURE_TTL_EVICTION`` with ``per_feature_ttl`` (TTLs in ``[0, int32 max - current hour]``:
            expiry hours are int32). Per-feature TTLs: a feature's bags are those of ``eviction_config.features``
            one feature after another, equally many each (``mc_hash_zch_checks.feature_index``).
        inference_dispatch_div_train_world_size: hash ``x // buckets`` (or ``x % width``), as row-wise dists do.
        start_bucket / end_bucket: the buckets of this shard (set by ``rebuild_with_output_id_range``).
        disable_fallback: unplaced ids map to -1 and are dropped (see ``no_bag``) instead of to their first probe.
        no_bag: with ``disable_fallback``, unplaced ids map to row 0 and lengths are kept.
        opt_in_prob / percent_reserved_slots: -1 / 0, or the opt-in percentage in [1, 100] and the share of rows
            reserved for ids that do not opt in (see the module docstring).
        persist_hash_zch_bucket: keep ``_hash_zch_bucket [1, 1]`` in the state dict.
    Other torchrec arguments are accepted with their defaults only (see the module docstring).
    State dict: ``_hash_zch_identities`` (a frozen Parameter, as torchrec), ``_hash_zch_metadata``, ``..._bucket``;
    a checkpoint of another ``zch_size`` or ``total_num_buckets`` is refused (see ``mc_hash_zch_checks``).
    """

    IDENTITY_BUFFER: str = "_hash_zch_identities"
    METADATA_BUFFER: str = "_hash_zch_metadata"
    BUCKET_BUFFER: str = "_hash_zch_bucket"

    def __init__(
        self, zch_size: int, device: torch.device | str | None, total_num_buckets: int, max_probe: int = 128,
        input_hash_size: int = 0, output_segments: list[int] | None = None, is_inference: bool = False,
        name: str | None = None, tb_logging_frequency: int = 0,
        eviction_policy_name: HashZchEvictionPolicyName | None = None,
        eviction_config: HashZchEvictionConfig | None = None, inference_dispatch_div_train_world_size: bool = False,
        start_bucket: int = 0, end_bucket: int | None = None, opt_in_prob: int = -1,
        percent_reserved_slots: float = 0, disable_fallback: bool = False, track_id_freq: bool = False,
        read_only_suffix: str = "_readonly", enable_per_feature_lookups: bool = False, no_bag: bool = False,
        write_runtime_meta_dim: int = 0, persist_hash_zch_bucket: bool = True, **unknown: Any,
    ) -> None:  # fmt: skip
        if unknown:
            raise TypeError(f"HashZchManagedCollisionModule got unknown keyword argument(s) {unknown}")
        self_args = {k: v for k, v in locals().items() if k not in ("self", "unknown", "__class__")}
        zch_size, buckets, segments, start, end = checks.check_layout(
            zch_size, total_num_buckets, output_segments, start_bucket, end_bucket
        )
        ttls = checks.check_eviction(eviction_policy_name, eviction_config, self._current_hour())
        checks.check_unsupported(self_args)
        sizes = torch.diff(torch.tensor(segments, dtype=torch.int64))
        reserved = checks.check_opt_in(opt_in_prob, percent_reserved_slots, zch_size, sizes[start:end].tolist())
        read_only_suffix = checks.check_read_only_suffix(read_only_suffix)
        super().__init__(device, segments, skip_state_validation=True, read_only_suffix=read_only_suffix,
                         enable_per_feature_lookups=enable_per_feature_lookups)  # fmt: skip
        self._init_args = self_args  # what rebuild_with_output_id_range passes on
        self._zch_size, self._buckets, self._output_segments = zch_size, buckets, segments
        self._start_bucket, self._end_bucket = start, end
        self._max_probe = check_int(max_probe, "max_probe", 1)
        self._input_hash_size = check_int(input_hash_size, "input_hash_size", 0)
        self._is_inference, self._name, self._tb_logging_frequency = bool(is_inference), name, tb_logging_frequency
        self._eviction_policy_name, self._eviction_config = eviction_policy_name, eviction_config
        self._ttls = None if ttls is None else torch.tensor(ttls, dtype=torch.int64)
        self._lru = eviction_policy_name is HashZchEvictionPolicyName.LRU_EVICTION
        self._per_feature = eviction_policy_name is HashZchEvictionPolicyName.PER_FEATURE_TTL_EVICTION
        self._opt_in_prob, self._reserved = int(opt_in_prob), reserved
        self._div_by_buckets = bool(inference_dispatch_div_train_world_size)
        self._disable_fallback, self._no_bag = bool(disable_fallback), bool(no_bag)
        self._persist_hash_zch_bucket = bool(persist_hash_zch_bucket)
        self._output_global_offset = segments[start]
        self._evicted_indices: list[torch.Tensor] = []
        self._hash_zch_identities = torch.nn.Parameter(
            torch.full((zch_size, 1), -1, dtype=torch.int64, device=self._device), requires_grad=False
        )
        evicting = eviction_policy_name is not None and not self._is_inference
        metadata = torch.full((zch_size, 1), -1, dtype=checks.METADATA_DTYPE, device=self._device) if evicting else None
        self.register_buffer(self.METADATA_BUFFER, metadata)
        self.register_buffer(self.BUCKET_BUFFER, torch.tensor([[buckets]]), persistent=self._persist_hash_zch_bucket)
        # bucket row offsets relative to this shard's first row (_buckets_of refuses ids of other shards)
        self.register_buffer("_bucket_sizes", sizes.to(self._device), persistent=False)
        self.register_buffer("_bucket_offsets", torch.tensor(segments[:-1], device=self._device) - segments[start],
                             persistent=False)  # fmt: skip
        self._register_load_state_dict_pre_hook(self._check_checkpoint, with_module=True)

    @staticmethod
    def _check_checkpoint(module: HashZchManagedCollisionModule, state_dict: dict, prefix: str, *args: Any) -> None:
        """A checkpoint of another layout is refused by name; training checkpoints carry metadata, which an
        inference module drops (as torchrec)."""
        checks.check_checkpoint(state_dict, prefix, module._zch_size, module._buckets)
        if module._hash_zch_metadata is None:
            state_dict.pop(prefix + HashZchManagedCollisionModule.METADATA_BUFFER, None)

    def _current_hour(self) -> int:
        """Hours since the epoch: the TTL clock (a method so tests can pin it)."""
        return int(time.time() / 3600)

    def _buckets_of(self, values: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[N]`` int64 ids of feature ``name`` -> (ids to hash, ``[N]`` bucket sizes, ``[N]`` bucket row offsets on
        this shard); a shard refuses ids of other shards' buckets."""
        raw = values
        if self._input_hash_size == 0:
            bucket = values % self._buckets
            if self._div_by_buckets:
                values = values // self._buckets
        else:
            width = -(-self._input_hash_size // self._buckets)
            bucket = values // width
            if self._div_by_buckets:
                values = values % width
        if self.is_sharded and value_checks_enabled():
            where = f"features[{name!r}].values()"
            checks.check_shard_buckets(bucket, raw, where, self._start_bucket, self._end_bucket)
        return values, self._bucket_sizes[bucket], self._bucket_offsets[bucket]

    def _opt_in_rands(self, count: int) -> torch.Tensor:
        """``[count]`` int32 draws in ``[0, 100)`` (torchrec's ``rand * 100``); an id opts in when its draw is below
        ``opt_in_prob`` (a method so tests can pin it)."""
        return (torch.rand(count, device=self._device) * 100).to(torch.int32)

    def _expiry(self, feature: JaggedTensor, name: str, now: int) -> torch.Tensor | None:
        """-> ``[N]`` int32 expiry hour of each id of ``feature`` at hour ``now``, or None without eviction."""
        if self._ttls is None or self._hash_zch_metadata is None:
            return None
        values = feature.values()
        if not self._per_feature:
            expiry = checks.check_expiry(int(self._ttls[0]), now)
            return torch.full_like(values, expiry, dtype=checks.METADATA_DTYPE, device=self._device)
        index = checks.feature_index(feature.lengths().to(self._device), len(self._ttls), name)
        longest = int(self._ttls.argmax())
        checks.check_expiry(int(self._ttls[longest]), now, f"eviction_config.per_feature_ttl[{longest}]")
        return (self._ttls.to(self._device)[index] + now).to(checks.METADATA_DTYPE)

    def _remap_ids(
        self, values: torch.Tensor, readonly: bool, name: str, expiry: torch.Tensor | None, now: int,
        rands: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """``[N]`` raw ids of feature ``name`` -> ``[N]`` local rows (-1 = unplaced, only with ``disable_fallback``);
        inserts unless ``readonly``, queuing evicted rows for :meth:`evict`. ``expiry [N]``: each id's expiry hour
        at hour ``now``; ``rands [N]``: opt-in draws (training with ``opt_in_prob`` below 100)."""
        raw = values.to(torch.int64)
        ids, sizes, offsets = self._buckets_of(raw, name)  # the identity stored is the id as hashed (bucket transform)
        hashed = murmur_hash3_2x64(ids)
        if self._reserved > 0:  # probing stays out of each bucket's reserved tail, which takes the fallback
            block = sizes - self._reserved
            fallback = offsets + block + unsigned_mod(hashed, torch.full_like(sizes, self._reserved))
        else:
            block, fallback = sizes, offsets + unsigned_mod(hashed, sizes)
        first = unsigned_mod(hashed, block)
        table = self._hash_zch_identities.data.view(-1)
        if readonly:
            probes = ZchProbes(ids, first, block, offsets)
            rows, _ = zch_probe(probes, table, self._max_probe, insert=False)
            if rands is not None:  # a read-only feature in training draws too (as torchrec), but writes nothing
                opted_out = (rands >= self._opt_in_prob) & ~zch_in_chain(probes, table, self._max_probe)
                rows = torch.where(opted_out, fallback, rows)
        else:
            # distinct raw ids are distinct (bucket, identity) pairs: the bucket transform is one-to-one
            uniq, inverse = torch.unique(raw, return_inverse=True)
            position = torch.arange(raw.numel(), device=raw.device)
            first_seen = torch.full_like(uniq, raw.numel()).scatter_reduce_(0, inverse, position, "amin")
            order = torch.argsort(first_seen)  # distinct ids in order of first occurrence: who wins a race
            at, race = first_seen[order], torch.argsort(order)[inverse]  # race: each id's place in race order
            metadata = self._hash_zch_metadata
            if metadata is not None and expiry is not None:
                metadata = metadata.view(-1)  # repeats of an id renew it with their largest expiry (atomicMax)
                expiry = torch.full_like(at, -1, dtype=expiry.dtype).scatter_reduce_(0, race, expiry, "amax")
            else:
                metadata = expiry = None
            probes = ZchProbes(ids[at], first[at], block[at], offsets[at])
            placed = torch.full_like(at, -1)
            looking = torch.ones_like(at, dtype=torch.bool)
            if rands is not None:  # opting in once is enough: that repeat claims, the others then find the id
                drawn = torch.full_like(at, 100, dtype=rands.dtype).scatter_reduce_(0, race, rands, "amin")
                looking = (drawn < self._opt_in_prob) | zch_in_chain(probes, table, self._max_probe)
                reserved_rows = fallback[at][~looking]
                placed[~looking] = reserved_rows
                if metadata is not None and expiry is not None:
                    metadata.scatter_reduce_(0, reserved_rows, expiry[~looking], "amax")
            which = looking.nonzero().squeeze(1)
            sub = ZchProbes(*(t[which] for t in probes))
            found, evicted = zch_probe(sub, table, self._max_probe, True, metadata,
                                       None if expiry is None else expiry[which], now, self._lru)  # fmt: skip
            placed[which] = found
            if evicted.numel():
                self._evicted_indices.append(evicted)
            rows = placed[race]  # back from race order to each id of the batch
        return rows if self._disable_fallback else torch.where(rows < 0, fallback, rows)

    def remap(
        self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True,
        write_weights: torch.Tensor | None = None,
    ) -> dict[str, JaggedTensor]:  # fmt: skip
        """``{name: JaggedTensor}`` of raw ids ``[N]`` -> same keys, values = int64 rows (plus the shard's global
        offset); lengths and weights pass through, except for ids dropped by ``disable_fallback``."""
        if write_weights is not None:
            raise NotImplementedError("write_weights needs runtime metadata, which is not supported")
        if self._disable_fallback and not self._no_bag and not mutate_miss_lengths:  # would leave bags too long
            raise ValueError("mutate_miss_lengths=False needs no_bag=True when disable_fallback=True")
        # input_hash_size 0: any id >= 0 (a negative one would hash like any other, but -1 marks a free row)
        features = check_id_features(features, self._input_hash_size or None, type(self).__name__, nonnegative=True)
        out: dict[str, JaggedTensor] = {}
        with torch.no_grad():
            for name, feature in features.items():
                readonly = not self.training or self._is_inference or name.lower().endswith(self._read_only_suffix)
                now = self._current_hour()
                expiry = None if readonly else self._expiry(feature, name, now)
                draws = self.training and not self._is_inference and 0 < self._opt_in_prob < 100
                rands = self._opt_in_rands(feature.values().numel()) if draws else None
                values = feature.values().to(self._device)
                rows = self._remap_ids(values, readonly, name, expiry, now, rands)
                lengths, weights = feature.lengths(), feature.weights_or_none()
                if self._disable_fallback:
                    hit = rows >= 0
                    if self._no_bag:
                        rows = torch.where(hit, rows, 0)
                    else:
                        rows = rows[hit]
                        # a dropped id takes its weight with it (torchrec 1.8 keeps every weight, out of line)
                        weights = None if weights is None else weights[hit.to(weights.device)]
                        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device),
                                                      lengths.to(torch.int64))  # fmt: skip
                        lengths = torch.zeros_like(lengths).index_add_(0, bag, hit.to(lengths))  # kept ids per bag
                rows = rows + self._output_global_offset
                out[name] = JaggedTensor(values=rows.to(feature.values().device), lengths=lengths, weights=weights)
        return out

    def forward(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True) -> dict[str, JaggedTensor]:
        return self.remap(features, mutate_miss_lengths=mutate_miss_lengths)

    def preprocess(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        return features

    profile = preprocess  # ids are hashed and recorded inside remap: both steps are identities here

    def evict(self) -> torch.Tensor | None:
        """``[E]`` distinct global rows given to new ids since the last call, or None."""
        if not self._evicted_indices:
            return None
        rows = torch.unique(torch.cat(self._evicted_indices))
        self._evicted_indices = []
        return rows + self._output_global_offset

    def output_size(self) -> int:
        return self._zch_size

    def input_size(self) -> int:
        return self._input_hash_size

    def buckets(self) -> int:
        return self._buckets

    @property
    def max_probe(self) -> int:
        return self._max_probe

    @property
    def disable_fallback(self) -> bool:
        return self._disable_fallback

    @property
    def is_sharded(self) -> bool:
        return self._end_bucket - self._start_bucket < self._buckets

    def open_slots(self) -> torch.Tensor:
        """``[1]`` free rows an id can claim (torchrec 1.8 returns a constant 0 here): each bucket's reserved tail
        (opt-in) never holds an identity, so it is not counted."""
        free = self._hash_zch_identities.data.view(-1) == -1
        if self._reserved > 0:
            ends = self._bucket_offsets + self._bucket_sizes  # [buckets] local row ends
            row = torch.arange(free.numel(), device=free.device)
            bucket = torch.searchsorted(ends, row, right=True).clamp_(max=ends.numel() - 1)
            free &= row < ends[bucket] - self._reserved
        return free.sum().reshape(1)

    def validate_state(self) -> None:
        if (shape := tuple(self._hash_zch_identities.shape)) != (self._zch_size, 1):
            raise ValueError(f"_hash_zch_identities must be ({self._zch_size}, 1), got {shape}")

    def rebuild_with_output_id_range(
        self, output_id_range: tuple[int, int], output_segments: list[int] | None = None,
        device: torch.device | None = None,
    ) -> HashZchManagedCollisionModule:  # fmt: skip
        """A fresh, empty module owning rows ``[start, end)``, which must fall on bucket boundaries of this
        module's ``output_segments`` (the argument ``output_segments`` is ignored, as in torchrec)."""
        low, high = output_id_range
        if low not in self._output_segments or high not in self._output_segments or high <= low:
            raise ValueError(f"output_id_range={output_id_range!r} must span buckets of {self._output_segments}")
        args = dict(self._init_args, zch_size=high - low, device=device or self.device)
        args["output_segments"] = self._output_segments  # the unsharded table's buckets
        args.update(start_bucket=self._output_segments.index(low), end_bucket=self._output_segments.index(high))
        return HashZchManagedCollisionModule(**args)
