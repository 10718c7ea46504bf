"""HashZchManagedCollisionModule's checks (modules/mc_hash_zch_checks.py): the eviction TTL against the int32 expiry
hours of ``_hash_zch_metadata``, checkpoints of another bucket count or table size (strict and non-strict loads),
weighted features losing ids under ``disable_fallback``, ids routed to the wrong shard, constructor arguments that
torchrec 1.8 accepts and then mishandles. Each error must name the argument (or key) and the offending value."""

from __future__ import annotations

import pytest
import torch

from tritonrec.data import JaggedTensor
from tritonrec.modules import HashZchEvictionConfig, HashZchEvictionPolicyName, HashZchManagedCollisionModule

_TTL = HashZchEvictionPolicyName.SINGLE_TTL_EVICTION
_INT32_MAX = 2**31 - 1
_HOUR = 500_000  # about the hour since the epoch in 2027


class _PinnedClock(HashZchManagedCollisionModule):
    """The TTL clock pinned (from construction on) so the TTL bound is exact."""

    hour = _HOUR

    def _current_hour(self) -> int:
        return self.hour


def _module(zch: int = 32, buckets: int = 2, probe: int = 4, **kw: object) -> HashZchManagedCollisionModule:
    return HashZchManagedCollisionModule(zch_size=zch, device="cpu", total_num_buckets=buckets, max_probe=probe, **kw)


def _jt(ids: list[int] | torch.Tensor, weights: torch.Tensor | None = None) -> dict[str, JaggedTensor]:
    values = torch.as_tensor(ids, dtype=torch.int64)
    return {"t": JaggedTensor(values=values, lengths=torch.ones_like(values), weights=weights)}


def _ttl_module(ttl: object, cls: type = HashZchManagedCollisionModule) -> HashZchManagedCollisionModule:
    config = HashZchEvictionConfig(["t"], single_ttl=ttl)  # type: ignore[arg-type]
    return cls(zch_size=8, device="cpu", total_num_buckets=1, max_probe=2, eviction_policy_name=_TTL,
               eviction_config=config)  # fmt: skip


# --- single_ttl: expiry = current hour + single_ttl is stored as int32 ---


@pytest.mark.parametrize(
    "ttl, error, match",
    [
        (-1, ValueError, r"eviction_config\.single_ttl must be an int in \[0, \d+\] .*got .*single_ttl=-1"),
        (_INT32_MAX, ValueError, r"torch\.int32 expiry hours.*single_ttl=2147483647"),
        (2**40, ValueError, r"single_ttl=1099511627776"),
        (2.5, TypeError, r"single_ttl=2\.5 \(a float\)"),
        (True, TypeError, r"single_ttl=True \(a bool\)"),
    ],
)  # fmt: skip
def test_single_ttl_out_of_range_is_refused_at_construction(ttl: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _ttl_module(ttl)


def test_single_ttl_bound_is_int32_max_minus_the_current_hour() -> None:
    bound = _INT32_MAX - _HOUR
    with pytest.raises(ValueError, match=rf"in \[0, {bound}\] .*current hour {_HOUR}\).*single_ttl={bound + 1}"):
        _ttl_module(bound + 1, _PinnedClock)
    module = _ttl_module(bound, _PinnedClock)  # the largest TTL: expiry is exactly int32's max
    module(_jt([3]))
    assert module._hash_zch_metadata.max().item() == _INT32_MAX
    module.hour = _HOUR + 1  # the clock moved on: the same TTL now overflows, refused by name before any write
    before = module._hash_zch_identities.clone()
    with pytest.raises(
        ValueError, match=rf"single_ttl={bound} \+ current hour {_HOUR + 1} .*overflows the torch\.int32"
    ):
        module(_jt([4]))
    assert torch.equal(module._hash_zch_identities, before)
    assert _ttl_module(0, _PinnedClock)(_jt([5]))["t"].values().numel() == 1  # 0: expires once the hour is over


# --- checkpoints of another layout ---


@pytest.mark.parametrize("strict", [True, False])
def test_checkpoint_of_another_bucket_count_is_refused(strict: bool) -> None:
    saved = _module(32, 2)
    saved(_jt(list(range(20))))
    target = _module(32, 4)
    with pytest.raises(ValueError, match=r"_hash_zch_bucket holds total_num_buckets=2 but this module has total_num_"
                                         r"buckets=4"):  # fmt: skip
        target.load_state_dict(saved.state_dict(), strict=strict)
    assert target.open_slots().item() == 32  # nothing was copied
    nested = torch.nn.ModuleDict({"t0": _module(32, 4)})
    with pytest.raises(ValueError, match=r"checkpoint t0\._hash_zch_bucket holds total_num_buckets=2"):
        nested.load_state_dict({f"t0.{k}": v for k, v in saved.state_dict().items()}, strict=strict)
    # a module that does not persist its bucket count still refuses a checkpoint that carries another one
    quiet = _module(32, 4, persist_hash_zch_bucket=False)
    with pytest.raises(ValueError, match="total_num_buckets=2 but this module has total_num_buckets=4"):
        quiet.load_state_dict(saved.state_dict(), strict=strict)


@pytest.mark.parametrize("strict", [True, False])
def test_checkpoint_of_another_zch_size_is_refused(strict: bool) -> None:
    config = HashZchEvictionConfig(["t"], single_ttl=3)
    saved = _module(32, 2, eviction_policy_name=_TTL, eviction_config=config).state_dict()
    target = _module(16, 2, eviction_policy_name=_TTL, eviction_config=config)
    with pytest.raises(ValueError, match=r"_hash_zch_identities has 32 rows \(the saved zch_size\) .*zch_size=16"):
        target.load_state_dict(saved, strict=strict)
    del saved["_hash_zch_identities"]
    with pytest.raises(ValueError, match=r"_hash_zch_metadata has 32 rows .*zch_size=16"):
        target.load_state_dict(saved, strict=False)
    bad_bucket = _module(32, 2).state_dict() | {"_hash_zch_bucket": torch.tensor([2, 2])}
    with pytest.raises(ValueError, match=r"_hash_zch_bucket must hold one count, got shape \(2,\)"):
        _module(32, 2).load_state_dict(bad_bucket, strict=strict)


def test_checkpoint_of_the_same_layout_loads() -> None:
    saved = _module(32, 2)
    saved(_jt(list(range(20))))
    target = _module(32, 2)
    target.load_state_dict(saved.state_dict())
    assert torch.equal(target._hash_zch_identities, saved._hash_zch_identities)
    warm = {k: v for k, v in saved.state_dict().items() if k != "_hash_zch_bucket"}  # saved before the buffer existed
    target.load_state_dict(warm, strict=False)


# --- weights under disable_fallback ---


def test_weighted_feature_drops_the_weights_of_dropped_ids() -> None:
    """Unplaced ids leave with their weights, so ids and weights stay aligned (torchrec 1.8 keeps every weight: one
    per input id, no longer one per output id); with ``no_bag`` every id stays, and so does every weight."""
    weights = torch.arange(20, dtype=torch.float32)
    ids = torch.arange(10, 30)
    dropping = _module(2, 1, 1, disable_fallback=True)
    out = dropping(_jt(ids, weights))["t"]
    kept = torch.isin(ids, dropping._hash_zch_identities.view(-1))
    assert 0 < int(kept.sum()) < 20 and out.values().numel() == int(kept.sum())
    assert torch.equal(out.weights(), weights[kept]) and torch.equal(out.lengths(), kept.to(out.lengths().dtype))
    no_bag = _module(2, 1, 1, disable_fallback=True, no_bag=True)
    out = no_bag(_jt(ids, weights))["t"]  # ids kept (row 0): the weights stay aligned
    assert out.values().numel() == 20 and torch.equal(out.weights(), weights)
    roomy = _module(64, 1, 64, disable_fallback=True)  # nothing is dropped: weights pass through
    assert torch.equal(roomy(_jt(list(range(20)), weights))["t"].weights(), weights)


# --- ids of another shard's buckets ---


@pytest.mark.parametrize(
    "ihs, ids, match",
    [(400, [250, 5, 10], r"values\(\)\[1\] = 5 is in bucket 0, outside this shard's buckets \[2, 4\)"),
     (0, [3, 7, 4], r"values\(\)\[2\] = 4 is in bucket 0, outside this shard's buckets \[2, 4\)")],
)  # fmt: skip
def test_shard_refuses_ids_of_other_buckets(ihs: int, ids: list[int], match: str) -> None:
    """Another bucket's row offset lies outside the shard's table: it was wrapped into the shard's rows or raised an
    unnamed IndexError."""
    shard = _module(32, 4, 4, input_hash_size=ihs).rebuild_with_output_id_range((16, 32))
    with pytest.raises(ValueError, match=r"features\['t'\]\." + match):
        shard(_jt(ids))
    assert shard.open_slots().item() == 16  # nothing inserted
    mine = shard(_jt(ids[:1]))["t"].values()
    assert 16 <= int(mine) < 32


# --- constructor arguments ---


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"read_only_suffix": 3}, TypeError, "read_only_suffix must be a str, got 3"),
        ({"read_only_suffix": ""}, ValueError, "read_only_suffix=''"),
        ({"read_only_suffix": "_RO"}, ValueError, "lower-cased.*read_only_suffix='_RO'"),
        ({"eviction_policy_name": "SINGLE_TTL_EVICTION"}, TypeError, "eviction_policy_name .*'SINGLE_TTL_EVICTION'"),
        ({"output_segments": 8}, TypeError, "output_segments must be a list of ints, got int"),
        ({"output_segments": [0, 4.0, 8]}, TypeError, r"output_segments\[1\]=4\.0"),
        ({"output_segments": [0, -4, 8]}, ValueError, r"output_segments\[1\]=-4"),
    ],
)  # fmt: skip
def test_bad_arguments_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        HashZchManagedCollisionModule(**({"zch_size": 8, "device": "cpu", "total_num_buckets": 2} | kwargs))


def test_collection_hands_the_weights_to_its_modules() -> None:
    """Through a ManagedCollisionCollection the module sees the weights, so a drop keeps ids and weights aligned (the
    collection used to re-attach the input's weights: a KJT constructor error on the weights' length)."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.modules import EmbeddingBagConfig, ManagedCollisionCollection

    def configs(rows: int) -> list[EmbeddingBagConfig]:
        return [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=4, feature_names=["f0", "f1"])]

    ids = torch.arange(10, 30)
    weights = torch.arange(20, dtype=torch.float32)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=ids, lengths=torch.ones(20, dtype=torch.int64), weights=weights)
    module = _module(2, 1, 1, disable_fallback=True)
    out = ManagedCollisionCollection({"t": module}, configs(2))(kjt)
    kept = torch.isin(ids, module._hash_zch_identities.view(-1))
    assert 0 < int(kept.sum()) < 20 and out.keys() == ["f0", "f1"]
    assert torch.equal(out.weights(), weights[kept]) and out.values().numel() == int(kept.sum())
    roomy = ManagedCollisionCollection({"t": _module(64, 1, 64, disable_fallback=True)}, configs(64))
    assert torch.equal(roomy(kjt).weights(), weights)
