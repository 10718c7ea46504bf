"""Checks of ``HashZchManagedCollisionModule`` (``modules/mc_hash_zch.py``): constructor arguments, ids of other
shards and checkpoints of another layout. Every error names the argument (or state-dict key)
and the offending value; torchrec 1.8 accepts all of these and fails later, unnamed, or not at all."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import torch

from tritonrec.kernels.checks import check_int, host_ints

__all__ = [
    "METADATA_DTYPE",
    "check_checkpoint",
    "check_eviction",
    "check_expiry",
    "check_layout",
    "check_opt_in",
    "check_read_only_suffix",
    "check_shard_buckets",
    "check_unsupported",
    "feature_index",
]

# _hash_zch_metadata holds expiry hours (hour of the last hit + single_ttl) in fbgemm's create_zch_buffer dtype;
# both the TTL bound and the remap-time overflow check derive from it
METADATA_DTYPE = torch.int32
_METADATA_MAX = torch.iinfo(METADATA_DTYPE).max

_UNSUPPORTED_DEFAULTS = {"track_id_freq": False, "write_runtime_meta_dim": 0}


def check_layout(
    zch_size: object, total_num_buckets: object, output_segments: object, start_bucket: object, end_bucket: object
) -> tuple[int, int, list[int], int, int]:
    """-> ``(zch_size, buckets, segments [buckets + 1], start, end)``: the rows of buckets ``[start, end)`` of the
    unsharded table's ``output_segments`` (uniform when None) must number ``zch_size``."""
    zch = check_int(zch_size, "zch_size", 1)
    buckets = check_int(total_num_buckets, "total_num_buckets", 1)
    if output_segments is None:
        if zch % buckets:
            raise ValueError(f"zch_size={zch} is not a multiple of total_num_buckets={buckets}")
        output_segments = [zch // buckets * b for b in range(buckets + 1)]
    if not isinstance(output_segments, (list, tuple)):
        raise TypeError(f"output_segments must be a list of ints, got {type(output_segments).__name__}")
    segments = [check_int(s, f"output_segments[{i}]", 0) for i, s in enumerate(output_segments)]
    if len(segments) != buckets + 1 or any(b <= a for a, b in pairwise(segments)):
        raise ValueError(f"output_segments must be {buckets + 1} increasing boundaries, got {output_segments!r}")
    start = check_int(start_bucket, "start_bucket", 0, buckets - 1)
    end = check_int(buckets if end_bucket is None else end_bucket, "end_bucket", start + 1, buckets)
    if (rows := segments[end] - segments[start]) != zch:
        raise ValueError(f"zch_size={zch} != {rows} rows of buckets [{start}, {end}) in output_segments")
    return zch, buckets, segments, start, end


def check_eviction(policy: object, config: object, now: int) -> tuple[int, ...] | None:
    """-> the TTL hours per feature of ``eviction_config.features`` (one for ``SINGLE_TTL_EVICTION`` and
    ``LRU_EVICTION``, which torchrec scores with ``single_ttl``), None without eviction. ``policy`` must be a
    ``HashZchEvictionPolicyName`` (another enum's member or a string would compare unequal and silently turn
    eviction off); ``now``: the TTL clock's hour. A field the policy does not read is ignored, as in torchrec."""
    from tritonrec.modules.mc_hash_zch import HashZchEvictionPolicyName  # the enum lives beside the module

    if policy is None:
        return None
    if not isinstance(policy, HashZchEvictionPolicyName):
        raise TypeError(f"eviction_policy_name must be a HashZchEvictionPolicyName or None, got {policy!r}")
    high = _METADATA_MAX - now
    what = f"an int in [0, {high}] ({METADATA_DTYPE} expiry hours: {_METADATA_MAX} minus the current hour {now})"
    if policy is not HashZchEvictionPolicyName.PER_FEATURE_TTL_EVICTION:
        ttl = getattr(config, "single_ttl", None)
        if ttl is None:
            raise ValueError(f"{policy.value} needs eviction_config.single_ttl, got eviction_config={config!r}")
        return (check_int(ttl, "eviction_config.single_ttl", 0, high, what=what),)
    features, ttls = getattr(config, "features", None), getattr(config, "per_feature_ttl", None)
    if not isinstance(features, (list, tuple)) or not isinstance(ttls, (list, tuple)) or len(ttls) != len(features):
        raise ValueError(
            "PER_FEATURE_TTL_EVICTION needs eviction_config.per_feature_ttl with one TTL per feature of "
            f"eviction_config.features, got eviction_config={config!r}"
        )
    if not ttls:
        raise ValueError(f"PER_FEATURE_TTL_EVICTION needs at least one feature, got eviction_config={config!r}")
    return tuple(check_int(t, f"eviction_config.per_feature_ttl[{i}]", 0, high, what=what) for i, t in enumerate(ttls))


def check_opt_in(opt_in_prob: object, percent_reserved_slots: object, zch_size: int, sizes: list[int]) -> int:
    """-> reserved slots per bucket (torchrec's ``get_reserved_slots_per_bucket``: ``floor(zch_size * percent /
    100 / buckets of this shard)``), -1 without opt-in. ``sizes``: this shard's bucket sizes; each must keep a row
    outside its reserved tail."""
    prob = check_int(opt_in_prob, "opt_in_prob", -1, 100, what="-1 (off) or an int in [1, 100]")
    if prob == 0:
        raise ValueError("opt_in_prob must be -1 (off) or an int in [1, 100], got opt_in_prob=0")
    if isinstance(percent_reserved_slots, bool) or not isinstance(percent_reserved_slots, (int, float)):
        raise TypeError(f"percent_reserved_slots must be a number in [0, 100), got {percent_reserved_slots!r}")
    if not 0 <= percent_reserved_slots < 100:
        raise ValueError(f"percent_reserved_slots must be in [0, 100), got {percent_reserved_slots=}")
    if prob == -1:
        if percent_reserved_slots:
            raise ValueError(
                f"percent_reserved_slots={percent_reserved_slots} needs opt_in_prob in [1, 100] (torchrec ignores the "
                "reserved slots when opt_in_prob=-1)"
            )
        return -1
    reserved = math.floor(zch_size * percent_reserved_slots / 100 / len(sizes))
    if not 0 < reserved < min(sizes):
        raise ValueError(
            f"opt_in_prob={prob} with percent_reserved_slots={percent_reserved_slots}: {reserved} reserved slots per "
            f"bucket (floor({zch_size} rows * {percent_reserved_slots} / 100 / {len(sizes)} buckets)) must be in "
            f"[1, {min(sizes) - 1}] (the smallest bucket has {min(sizes)} rows)"
        )
    return reserved


def feature_index(lengths: torch.Tensor, count: int, name: str) -> torch.Tensor:
    """``[N]`` index into ``eviction_config.features`` of each id of feature ``name`` (per-feature TTL): its bags
    are the ``count`` features' bags one feature after another, equally many each, as tritonrec's collections
    concatenate them (torchrec's collection passes the ids per feature as ``weights [count]`` instead, which a
    JaggedTensor here refuses: weights are per id)."""
    if lengths.numel() % count:
        raise ValueError(
            f"features[{name!r}].lengths() has {lengths.numel()} bags, not a multiple of the {count} features of "
            "eviction_config.features (PER_FEATURE_TTL_EVICTION reads each feature's ids as one block of bags)"
        )
    per_feature = lengths.to(torch.int64).view(count, -1).sum(1)
    return torch.repeat_interleave(torch.arange(count, device=lengths.device), per_feature)


def check_expiry(ttl: int, now: int, name: str = "eviction_config.single_ttl") -> int:
    """-> ``now + ttl``, the expiry hour written to ``_hash_zch_metadata``; it must fit its dtype (the clock may have
    moved on since construction, or been set by a test)."""
    if now + ttl > _METADATA_MAX:
        raise ValueError(
            f"{name}={ttl} + current hour {now} = {now + ttl} overflows the {METADATA_DTYPE} "
            f"expiry hours of _hash_zch_metadata (max {_METADATA_MAX})"
        )
    return now + ttl


def check_read_only_suffix(suffix: object) -> str:
    """Feature names are lower-cased before the suffix test (as torchrec): a suffix with upper-case letters never
    matches, and an empty one matches every feature (use ``is_inference`` for that)."""
    if not isinstance(suffix, str):
        raise TypeError(f"read_only_suffix must be a str, got {suffix!r}")
    if not suffix or suffix != suffix.lower():
        raise ValueError(
            f"read_only_suffix must be a non-empty lower-case str (feature names are lower-cased before the test), "
            f"got read_only_suffix={suffix!r}"
        )
    return suffix


def check_unsupported(args: dict[str, Any]) -> None:
    """torchrec arguments implemented with their defaults only."""
    for arg, default in _UNSUPPORTED_DEFAULTS.items():
        if args[arg] != default:
            raise NotImplementedError(f"HashZchManagedCollisionModule: {arg}={args[arg]!r} (only {default!r})")


def check_shard_buckets(buckets: torch.Tensor, values: torch.Tensor, name: str, start: int, end: int) -> None:
    """``[N]`` buckets of ``[N]`` ids ``values`` must lie in this shard's ``[start, end)``: another shard's bucket
    has a row offset outside this shard's table, which negative indexing would silently wrap into it. One
    ``aminmax`` and one host read; the culprit is searched only on failure."""
    if buckets.numel() == 0:
        return
    low, high = host_ints(*torch.aminmax(buckets))
    if low >= start and high < end:
        return
    where = int(((buckets < start) | (buckets >= end)).nonzero()[0].item())
    raise ValueError(
        f"{name}[{where}] = {int(values[where])} is in bucket {int(buckets[where])}, outside this shard's buckets "
        f"[{start}, {end}): route ids to the shard that owns their bucket"
    )


def check_checkpoint(state_dict: dict[str, Any], prefix: str, zch_size: int, buckets: int) -> None:
    """Before ``load_state_dict`` (strict or not): the checkpoint's ``_hash_zch_identities`` / ``_hash_zch_metadata``
    rows must equal ``zch_size`` and its ``_hash_zch_bucket [1, 1]`` must equal ``buckets``. The bucket count has
    the same shape for any value, so torch would copy another one silently; ids would then be looked up in other
    buckets (other rows) than they were inserted in."""
    for key in ("_hash_zch_identities", "_hash_zch_metadata"):
        saved = state_dict.get(prefix + key)
        if isinstance(saved, torch.Tensor) and saved.dim() >= 1 and saved.shape[0] != zch_size:
            raise ValueError(
                f"checkpoint {prefix + key} has {saved.shape[0]} rows (the saved zch_size) but this module has "
                f"zch_size={zch_size}"
            )
    saved = state_dict.get(prefix + "_hash_zch_bucket")
    if isinstance(saved, torch.Tensor):
        if saved.numel() != 1:
            raise ValueError(f"checkpoint {prefix}_hash_zch_bucket must hold one count, got shape {tuple(saved.shape)}")
        if (count := int(saved.reshape(-1)[0])) != buckets:
            raise ValueError(
                f"checkpoint {prefix}_hash_zch_bucket holds total_num_buckets={count} but this module has "
                f"total_num_buckets={buckets}: ids would be looked up in other buckets than they were inserted in"
            )
