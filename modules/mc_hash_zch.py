"""``HashZchManagedCollisionModule`` (torchrec's ``hash_mc_modules``): multi-probe zero-collision hashing (MPZCH).

One identity per row, ``_hash_zch_identities [zch_size, 1]`` (-1 = free). An id ``x`` goes to bucket ``b``
(``x // ceil(input_hash_size / buckets)``, or ``x % buckets`` when ``input_hash_size`` is 0) with rows
``[offset_b, offset_b + size_b)``; probe ``k`` is ``(murmur3(x) + k) mod size_b`` (fbgemm's ``murmur_hash3_2x64(x,
0, 0)``, an unsigned 64-bit hash, taken modulo unsigned as ``zero_collision_hash`` does).

* Training inserts: the first probe holding ``x`` is a hit, else the first free probe is claimed. With TTL eviction
  (``_hash_zch_metadata [zch_size, 1]``: int32 expiry hours) an id absent from its probe chain may also take a row
  that expired before now and before its own expiry (reported by :meth:`evict`); hits and claims set the expiry.
* Eval, ``is_inference`` and features named ``*_readonly`` only look up, over all ``max_probe`` probes.
* An id with no row after ``max_probe`` probes gets its first probe, or with ``disable_fallback`` -1: dropped, bag
  lengths shortened and the weights of dropped ids dropped too (row 0 and lengths kept with ``no_bag``).

fbgemm inserts on the GPU, one thread per id racing with compare-and-swap. Here races are settled one probe round
at a time: in round ``k`` every id still looking examines its ``k``-th probe, hits go first, then each contested
row goes to the id seen first in the batch: one of the outcomes the concurrent kernel can produce. torchrec 1.8
cannot insert on CPU (fbgemm-gpu-cpu's ``zero_collision_hash`` requires ``readonly=True``); its CPU lookups match.

Not supported (``NotImplementedError``): ``opt_in_prob`` / reserved slots, LRU and per-feature TTL eviction, runtime
metadata (``track_id_freq``, ``write_runtime_meta_dim``); ``tb_logging_frequency`` is accepted and ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any, NamedTuple

import torch

from tritonrec.data import JaggedTensor
from tritonrec.kernels.checks import check_int, value_checks_enabled
from tritonrec.modules import mc_hash_zch_checks as checks
from tritonrec.modules.mc_base import ManagedCollisionModule, check_id_features

__all__ = ["HashZchEvictionConfig", "HashZchEvictionPolicyName", "HashZchManagedCollisionModule", "murmur_hash3_2x64"]

# murmur3's uint64 constants as the int64s with the same bits (torch has no uint64 arithmetic)
_C1, _C2 = 0x87C37B91114253D5 - 2**64, 0x4CF5AD432745937F
_F1, _F2 = 0xFF51AFD7ED558CCD - 2**64, 0xC4CEB9FE1A85EC53 - 2**64


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic: mask the sign copies off)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x << n) | _shr(x, 64 - n)


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = (h ^ _shr(h, 33)) * _F1
    h = (h ^ _shr(h, 33)) * _F2
    return h ^ _shr(h, 33)


def murmur_hash3_2x64(x: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 ids -> ``[N]`` int64 holding the bits of fbgemm's ``murmur_hash3_2x64(x, 0, 0)`` (uint64).

    int64 products wrap modulo 2**64 like uint64's, so the bits are exact; ``y = seed = 0`` makes the second
    block vanish (``k2 = 0``), folding ``h2`` to ``5 * h1 + 0x38495ab5`` before finalisation."""
    k1 = _rotl(x.to(torch.int64) * _C1, 31) * _C2
    h1 = _rotl(k1, 27) * 5 + 0x52DCE729
    h2 = h1 * 5 + 0x38495AB5
    h1 = (h1 ^ 16) + (h2 ^ 16)
    h2 = (h2 ^ 16) + h1
    h1, h2 = _fmix(h1), _fmix(h2)
    h1 = h1 + h2
    return h1 ^ (h2 + h1)


def _unsigned_mod(bits: torch.Tensor, modulo: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 bits read as uint64, modulo ``[N]`` positive int64: ``u = bits + 2**64`` when negative, and
    ``2**64 mod m`` is built from ``(2**63 - 1) mod m`` so nothing leaves int64."""
    r63 = ((2**63 - 1) % modulo + 1) % modulo
    r64 = (2 * r63) % modulo
    return torch.where(bits >= 0, bits % modulo, (bits % modulo + r64) % modulo)


@unique
class HashZchEvictionPolicyName(Enum):
    """torchrec's eviction policy names; only ``SINGLE_TTL_EVICTION`` is implemented here."""

    SINGLE_TTL_EVICTION = "SINGLE_TTL_EVICTION"
    PER_FEATURE_TTL_EVICTION = "PER_FEATURE_TTL_EVICTION"
    LRU_EVICTION = "LRU_EVICTION"


@dataclass
class HashZchEvictionConfig:
    """torchrec's eviction config. ``single_ttl``: hours an id keeps its row after its last hit."""

    features: list[str]
    single_ttl: int | None = None
    per_feature_ttl: list[int] | None = None


def _first_winner(rows: torch.Tensor) -> torch.Tensor:
    """``[M]`` claimed rows in batch order -> ``[M]`` bool, True for the first claimant of each row."""
    sorted_rows, order = torch.sort(rows, stable=True)  # stable: keeps batch order inside each row
    first = torch.ones_like(sorted_rows, dtype=torch.bool)
    first[1:] = sorted_rows[1:] != sorted_rows[:-1]
    return torch.empty_like(first).scatter_(0, order, first)


class ZchProbes(NamedTuple):
    """Per id ``[N]``: the identity stored, its first probe, its bucket's size and row offset."""

    ids: torch.Tensor
    first: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor

    def rows(self, which: torch.Tensor, k: int) -> torch.Tensor:
        """``[M]`` row of probe ``k`` of ids ``which``; probing wraps inside the bucket."""
        return self.offsets[which] + (self.first[which] + k) % self.sizes[which]


def _in_chain(probes: ZchProbes, identities: torch.Tensor, max_probe: int) -> torch.Tensor:
    """``[N]`` bool: the id is in its probes before the first free row (such an id must not evict another)."""
    present = torch.zeros_like(probes.ids, dtype=torch.bool)
    open_chain = torch.arange(probes.ids.numel(), device=probes.ids.device)
    for k in range(max_probe):
        if open_chain.numel() == 0:
            break
        held = identities[probes.rows(open_chain, k)]
        present[open_chain[held == probes.ids[open_chain]]] = True
        open_chain = open_chain[(held != probes.ids[open_chain]) & (held != -1)]
    return present


def zch_probe(
    probes: ZchProbes, identities: torch.Tensor, max_probe: int, insert: bool,
    metadata: torch.Tensor | None = None, expiry: torch.Tensor | None = None, now: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Probe ``[U]`` ids in ``identities [Z]`` -> ``([U] rows, -1 when not found / placed; [E] evicted rows)``.
    ``insert=False``: read-only search of all ``max_probe`` probes (a free row does not end it, as in fbgemm's
    lookup). ``insert=True``: the ids must be distinct and in race order (see the module docstring); free rows
    are claimed in place. With ``metadata [Z]`` int32 and ``expiry [U]`` int32 (TTL eviction), a row also expires
    when ``now > metadata`` and ``metadata < expiry`` of the id claiming it."""
    ids, found, evicted = probes.ids, torch.full_like(probes.ids, -1), []
    may_evict = ~_in_chain(probes, identities, max_probe) if insert and expiry is not None else None
    pending = torch.arange(ids.numel(), device=ids.device)
    for k in range(max_probe):  # loop over probe rounds, each vectorised over the ids still looking
        if pending.numel() == 0:
            break
        rows = probes.rows(pending, k)
        held = identities[rows]
        hit = held == ids[pending]
        claim = (held == -1) & insert
        if may_evict is not None:
            assert metadata is not None and expiry is not None
            metadata.scatter_reduce_(0, rows[hit], expiry[pending[hit]], "amax")  # hits renew before expiry checks
            meta = metadata[rows]
            claim |= ~hit & may_evict[pending] & (now > meta) & (meta < expiry[pending])
        won = torch.zeros_like(claim)
        won[claim] = _first_winner(rows[claim])
        identities[rows[won]] = ids[pending[won]]
        if may_evict is not None:
            evicted.append(rows[won & (held != -1)])
            metadata[rows[won]] = expiry[pending[won]]
        done = hit | won
        found[pending[done]] = rows[done]
        pending = pending[~done]
    return found, (torch.cat(evicted) if evicted else ids.new_empty(0))


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
        eviction_policy_name / eviction_config: ``SINGLE_TTL_EVICTION`` with ``single_ttl`` hours (in ``[0, int32 max
            - current hour]``: expiry hours are int32).
        inference_dispatch_div_train_world_size: hash ``x // buckets`` (or ``x % width``), as row-wise dists do.
        start_bucket / end_bucket: the buckets of this shard (set by ``rebuild_with_output_id_range``).
        disable_fallback: unplaced ids map to -1 and are dropped (see ``no_bag``) instead of to their first probe.
        no_bag: with ``disable_fallback``, unplaced ids map to row 0 and lengths are kept.
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
        single_ttl = checks.check_eviction(eviction_policy_name, eviction_config, self._current_hour())
        checks.check_unsupported(self_args)
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
        self._single_ttl = single_ttl
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
        sizes = torch.diff(torch.tensor(segments, dtype=torch.int64))
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

    def _remap_ids(self, values: torch.Tensor, readonly: bool, name: str) -> torch.Tensor:
        """``[N]`` raw ids of feature ``name`` -> ``[N]`` local rows (-1 = unplaced, only with ``disable_fallback``);
        inserts unless ``readonly``, queuing evicted rows for :meth:`evict`."""
        raw = values.to(torch.int64)
        ids, sizes, offsets = self._buckets_of(raw, name)  # the identity stored is the id as hashed (bucket transform)
        first = _unsigned_mod(murmur_hash3_2x64(ids), sizes)
        table = self._hash_zch_identities.data.view(-1)
        if readonly:
            rows, _ = zch_probe(ZchProbes(ids, first, sizes, offsets), table, self._max_probe, insert=False)
        else:
            # distinct raw ids are distinct (bucket, identity) pairs: the bucket transform is one-to-one
            uniq, inverse = torch.unique(raw, return_inverse=True)
            position = torch.arange(raw.numel(), device=raw.device)
            first_seen = torch.full_like(uniq, raw.numel()).scatter_reduce_(0, inverse, position, "amin")
            order = torch.argsort(first_seen)  # distinct ids in order of first occurrence: who wins a race
            at = first_seen[order]
            metadata, expiry, now = self._hash_zch_metadata, None, -1
            if metadata is not None and self._single_ttl is not None:
                now = self._current_hour()
                expiry = torch.full_like(at, checks.check_expiry(self._single_ttl, now), dtype=checks.METADATA_DTYPE)
                metadata = metadata.view(-1)
            probes = ZchProbes(ids[at], first[at], sizes[at], offsets[at])
            placed, evicted = zch_probe(probes, table, self._max_probe, True, metadata, expiry, now)
            if evicted.numel():
                self._evicted_indices.append(evicted)
            rows = placed[torch.argsort(order)[inverse]]  # back from race order to each id of the batch
        return rows if self._disable_fallback else torch.where(rows < 0, offsets + first, rows)

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
                rows = self._remap_ids(feature.values().to(self._device), readonly, name)
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
        """``[1]`` free rows (torchrec 1.8 returns a constant 0 here)."""
        return (self._hash_zch_identities.data == -1).sum().reshape(1)

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
