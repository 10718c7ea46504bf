"""MCHManagedCollisionModule against the dict-based reference (tests/modules/mc_reference.py): bit-exact rows per
batch through inserts and evictions, for each policy; eval mode, state-dict round trip, bad input."""

from __future__ import annotations

import pytest
import torch

from tests.modules.mc_reference import ReferenceZCH, above_average, distance_lfu, lfu, lru
from tritonrec.data import JaggedTensor
from tritonrec.kernels.checks import NotAnIntError
from tritonrec.modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHManagedCollisionModule,
    average_threshold_filter,
    dynamic_threshold_filter,
    probabilistic_threshold_filter,
)

_FREE = 2**63 - 1

POLICIES = {
    "lfu": (LFU_EvictionPolicy, lfu, None),
    "lru": (LRU_EvictionPolicy, lru(), None),
    "lru_decay2": (lambda: LRU_EvictionPolicy(decay_exponent=2.0), lru(2.0), None),
    "distance_lfu": (DistanceLFU_EvictionPolicy, distance_lfu(), None),
    "lfu_average_filter": (lambda: LFU_EvictionPolicy(average_threshold_filter), lfu, above_average),
}


def _mch(policy: str, zch_size: int, interval: int, offset: int = 0) -> MCHManagedCollisionModule:
    return MCHManagedCollisionModule(
        zch_size=zch_size,
        device="cpu",
        eviction_policy=POLICIES[policy][0](),
        eviction_interval=interval,
        output_global_offset=offset,
    )


def _reference(policy: str, zch_size: int, interval: int, offset: int = 0) -> ReferenceZCH:
    _, score, keep = POLICIES[policy]
    return ReferenceZCH(zch_size, interval, score, offset, keep)


def _stream(seed: int, batches: int, max_ids: int = 12, id_range: int = 40) -> list[torch.Tensor]:
    """Skewed ids (square of a uniform), batch sizes varying so the history buffer overflows now and then."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, max_ids, (batches,), generator=g).tolist()
    return [(torch.rand(n, generator=g) ** 2 * id_range).long() for n in [max_ids // 2, *sizes[1:]]]


def _run(module: MCHManagedCollisionModule, ids: torch.Tensor) -> torch.Tensor:
    half = ids.numel() // 2
    features = {"t": JaggedTensor(values=ids, lengths=torch.tensor([half, ids.numel() - half]))}
    return module(features)["t"].values()


def _table(module: MCHManagedCollisionModule) -> dict[int, int]:
    raw, rows = module._mch_sorted_raw_ids.tolist(), module._mch_remapped_ids_mapping.tolist()
    return {i: r for i, r in zip(raw, rows, strict=True) if i != _FREE}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize(("zch_size", "interval", "offset"), [(4, 1, 0), (9, 3, 5), (24, 2, 0), (1, 1, 3)])
def test_matches_dict_reference(policy: str, zch_size: int, interval: int, offset: int) -> None:
    module, reference = _mch(policy, zch_size, interval, offset), _reference(policy, zch_size, interval, offset)
    for step, ids in enumerate(_stream(zch_size * 7 + interval, 14)):
        training = step < 11
        module.train(training)
        got = _run(module, ids)
        assert got.tolist() == reference(ids.tolist(), training), f"step {step}"
        assert _table(module) == reference.table(), f"step {step}"
    assert torch.equal(module.open_slots(), torch.tensor([zch_size - 1 - len(reference.rows)]))


def test_documented_example() -> None:
    """LFU, 4 rows (3 ids + miss row), merge every 2 batches: window counts 2:3, 5:3, 3:2, 1:1 -> rows 0, 1, 2."""
    module = _mch("lfu", zch_size=4, interval=2)
    assert _run(module, torch.tensor([1, 2, 2, 3])).tolist() == [3, 3, 3, 3]  # nothing held yet: miss row
    assert _run(module, torch.tensor([2, 3, 5, 5, 5])).tolist() == [0, 2, 1, 1, 1]  # merged before remapping
    assert module._mch_counts.tolist()[:3] == [3, 2, 3]  # slots in raw-id order 2, 3, 5
    assert module.evict().tolist() == [0, 1, 2] and module.evict() is None
    module.eval()
    assert _run(module, torch.tensor([1, 2, 9])).tolist() == [3, 0, 3]


def test_eval_only_remaps() -> None:
    module = _mch("distance_lfu", zch_size=8, interval=2)
    for ids in _stream(3, 6):
        _run(module, ids)
    module.evict()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.eval()
    for ids in _stream(4, 6, id_range=80):
        _run(module, ids)
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert module.evict() is None and module._current_history_buffer_offset == 0


def test_state_dict_keys_and_round_trip() -> None:
    module = _mch("distance_lfu", zch_size=10, interval=2)
    assert list(module.state_dict()) == [
        "_output_segments_tensor",
        "_current_iter_tensor",
        "_mch_sorted_raw_ids",
        "_mch_remapped_ids_mapping",
        "_mch_counts",
        "_mch_last_access_iter",
    ]
    stream = [(torch.rand(8, generator=torch.Generator().manual_seed(s)) ** 2 * 30).long() for s in range(12)]
    for ids in stream[:4]:  # stop on a merge boundary: nothing pending in the (unsaved) history
        _run(module, ids)
    restored = _mch("distance_lfu", zch_size=10, interval=2)
    restored.load_state_dict(module.state_dict(), strict=True)
    assert int(restored._current_iter_tensor) == 4
    for mode in ("eval", "train"):
        module.train(mode == "train")
        restored.train(mode == "train")
        for ids in stream[4:]:
            assert torch.equal(_run(module, ids), _run(restored, ids))
    assert all(torch.equal(v, restored.state_dict()[k]) for k, v in module.state_dict().items())


def test_int32_ids_and_hash_func() -> None:
    wide = _mch("lru", zch_size=6, interval=1)
    narrow = _mch("lru", zch_size=6, interval=1)
    for ids in _stream(5, 5):
        out = _run(narrow, ids.int())
        assert out.dtype == torch.int32 and torch.equal(out.long(), _run(wide, ids))
    hashed = MCHManagedCollisionModule(
        zch_size=6,
        device="cpu",
        eviction_policy=LFU_EvictionPolicy(),
        eviction_interval=1,
        input_hash_size=10,
        input_hash_func=lambda ids, size: ids % size,
    )
    plain = _mch("lfu", zch_size=6, interval=1)
    for ids in _stream(6, 5):
        assert torch.equal(_run(hashed, ids + 10), _run(plain, ids % 10))


def test_rebuild_with_output_id_range() -> None:
    shard = _mch("lfu", zch_size=8, interval=1).rebuild_with_output_id_range((4, 8), [0, 4, 8])
    assert shard.output_size() == 4 and shard.buckets() == 2
    # rows 4..6 free, 7 is the miss row; free rows ranked last are given first: 7 -> 5, 2 -> 6
    assert _run(shard, torch.tensor([7, 7, 2])).tolist() == [5, 5, 6]
    shard.eval()
    assert _run(shard, torch.tensor([9, 2])).tolist() == [7, 6]


def test_threshold_filters() -> None:
    counts = torch.tensor([1, 2, 3, 10])
    mask, threshold = average_threshold_filter(counts)
    assert mask.tolist() == [False, False, False, True] and float(threshold) == 4.0
    mask, threshold = dynamic_threshold_filter(counts, threshold_skew_multiplier=0.5)
    assert mask.tolist() == [False, False, True, True] and float(threshold) == 2.0  # 0.5 * mean
    torch.manual_seed(0)
    mask, draws = probabilistic_threshold_filter(torch.tensor([0, 10_000]), per_id_probability=0.5)
    assert mask.tolist() == [False, True] and draws.shape == (2,)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"zch_size": 0}, ValueError, "zch_size"),
        ({"zch_size": -3}, ValueError, "zch_size"),
        ({"zch_size": 2.5}, NotAnIntError, "zch_size"),
        ({"eviction_interval": 0}, ValueError, "eviction_interval"),
        ({"eviction_interval": True}, NotAnIntError, "eviction_interval"),
        ({"input_hash_size": 0}, ValueError, "input_hash_size"),
        ({"output_global_offset": -1}, ValueError, "output_global_offset"),
        ({"eviction_policy": "lfu"}, TypeError, "eviction_policy"),
        ({"input_hash_func": 3}, TypeError, "input_hash_func"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], name: str) -> None:
    args: dict[str, object] = {
        "zch_size": 4,
        "device": "cpu",
        "eviction_policy": LFU_EvictionPolicy(),
        "eviction_interval": 1,
    }
    with pytest.raises(error, match=name):
        MCHManagedCollisionModule(**{**args, **kwargs})


def test_bad_features() -> None:
    module = _mch("lfu", zch_size=4, interval=1)
    lengths = torch.tensor([2])
    with pytest.raises(TypeError, match=r"features\['t'\]\.values\(\).*int32 or int64"):
        module({"t": JaggedTensor(values=torch.tensor([1.0, 2.0]), lengths=lengths)})
    with pytest.raises(ValueError, match=r"features\['t'\]\.values\(\)\[1\] = -4"):
        module({"t": JaggedTensor(values=torch.tensor([1, -4]), lengths=lengths)})
    with pytest.raises(TypeError, match="features must be a dict"):
        module(JaggedTensor(values=torch.tensor([1, 2]), lengths=lengths))
    with pytest.raises(TypeError, match=r"features\['t'\] must be a JaggedTensor"):
        module({"t": torch.tensor([1, 2])})
    small = MCHManagedCollisionModule(4, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=10)
    with pytest.raises(ValueError, match="input_hash_size=10"):
        small({"t": JaggedTensor(values=torch.tensor([3, 10]), lengths=lengths)})
    assert int(module._current_iter_tensor) == 0  # refused batches leave no trace


@pytest.mark.parametrize("policy", ["lfu", "lru", "distance_lfu"])
def test_assigned_or_moved_state_is_the_state_used(policy: str) -> None:
    """``load_state_dict(assign=True)`` (and ``.to()`` to another device) replace the buffers: the policy's metadata,
    the history and the evicted rows must follow them, not keep updating the old tensors."""
    stream = _stream(21, 12)
    module, reference = _mch(policy, 5, 2), _reference(policy, 5, 2)
    module.load_state_dict({k: v.clone() for k, v in module.state_dict().items()}, assign=True)
    for ids in stream:
        assert _run(module, ids).tolist() == reference(ids.tolist())
    metadata = [name for name in module.state_dict() if name in ("_mch_counts", "_mch_last_access_iter")]
    assert metadata and all(bool(module.state_dict()[name].any()) for name in metadata)
    moved = _mch(policy, 5, 2).to("meta")
    tensors = [*moved._mch_metadata.values(), moved._history_accumulator, moved._evicted_emb_indices]
    assert moved.device.type == "meta" and all(t.device.type == "meta" for t in tensors)


def test_load_into_a_trained_module_resumes_like_a_fresh_one() -> None:
    """Loading a checkpoint into a module that already trained continues exactly as loading it into a new module
    (torchrec 1.8 kept the live module's iteration counter and unmerged history: LRU ages and the eviction schedule
    then depended on what the module had run before the load)."""
    stream = _stream(22, 14)
    source = _mch("lru", 5, 3)
    for ids in stream[:4]:
        _run(source, ids)
    live, fresh = _mch("lru", 5, 3), _mch("lru", 5, 3)
    for ids in stream[6:8]:
        _run(live, ids)
    live.load_state_dict(source.state_dict())
    fresh.load_state_dict(source.state_dict())
    for ids in stream[4:]:
        assert torch.equal(_run(live, ids), _run(fresh, ids))
    assert all(torch.equal(a, b) for a, b in zip(live.state_dict().values(), fresh.state_dict().values(), strict=True))


# ------------------------------------------------------------------------------------------- evicted rows (MC-EBC/EC)
_EVICTION_BATCHES = [[1, 1, 1, 2, 2, 3], [1, 1, 2, 2, 3, 3], [7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9]]  # fill, keep, evict


def _fill_half(rows: torch.Tensor) -> torch.Tensor:
    """A deterministic ``init_fn`` (so a redrawn row is known exactly)."""
    return rows.fill_(0.5)


def _mc_lookup(kind: str, reset: bool = False, in_place: bool = False) -> torch.nn.Module:
    """An MC-EBC / MC-EC over one 4-row table (LFU, merge every batch) with weights ``arange`` (every row distinct)."""
    from tritonrec.modules import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        ManagedCollisionCollection,
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )

    config_type = EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    configs = [config_type(num_embeddings=4, embedding_dim=2, name="t0", feature_names=["f0"], init_fn=_fill_half)]
    mcc = ManagedCollisionCollection(
        {"t0": MCHManagedCollisionModule(4, "cpu", LFU_EvictionPolicy(), 1, input_hash_size=1000)}, configs
    )
    inner = (EmbeddingBagCollection if kind == "ebc" else EmbeddingCollection)(configs, backend="torch")
    wrapper = ManagedCollisionEmbeddingBagCollection if kind == "ebc" else ManagedCollisionEmbeddingCollection
    module = wrapper(inner, mcc, True, in_place, reset_evicted_rows=reset)
    with torch.no_grad():
        _weight(module).copy_(torch.arange(8.0).view(4, 2))
    return module


def _weight(module: torch.nn.Module) -> torch.Tensor:
    inner = module._embedding_module
    return (inner.embedding_bags if hasattr(inner, "embedding_bags") else inner.embeddings)["t0"].weight


def _spied_evictions(module: torch.nn.Module) -> list[torch.Tensor | None]:
    """Records what each forward's ``evict()`` returned for t0."""
    mcc, seen = module._managed_collision_collection, []
    original = mcc.evict

    def spy() -> dict[str, torch.Tensor | None]:
        out = original()
        seen.append(None if out["t0"] is None else out["t0"].clone())
        return out

    mcc.evict = spy
    return seen


def _kjt(ids: list[int]) -> object:
    from tritonrec.data import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f0"], values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_evicted_rows_keep_their_weights_by_default_as_torchrec(kind: str) -> None:
    """torchrec 1.8's unsharded MC modules leave a row handed to a new id as it is (their ``evict`` hook is a stub):
    same remapped rows and ``evict()`` rows as torchrec's, every weight unchanged bit for bit."""
    tr = pytest.importorskip("torchrec")
    from torchrec.modules import mc_embedding_modules as tr_mce
    from torchrec.modules import mc_modules as tr_mc

    ours = _mc_lookup(kind)
    config_type = tr.EmbeddingBagConfig if kind == "ebc" else tr.EmbeddingConfig
    configs = [config_type(num_embeddings=4, embedding_dim=2, name="t0", feature_names=["f0"])]
    mcm = tr_mc.MCHManagedCollisionModule(
        zch_size=4, device=torch.device("cpu"), eviction_policy=tr_mc.LFU_EvictionPolicy(), eviction_interval=1,
        input_hash_size=1000,
    )  # fmt: skip
    mcc = tr_mc.ManagedCollisionCollection({"t0": mcm}, configs)
    if kind == "ebc":
        theirs = tr_mce.ManagedCollisionEmbeddingBagCollection(tr.EmbeddingBagCollection(configs), mcc, True)
    else:
        theirs = tr_mce.ManagedCollisionEmbeddingCollection(tr.EmbeddingCollection(configs), mcc, True)
    their_weight = _weight(theirs)
    with torch.no_grad():
        their_weight.copy_(torch.arange(8.0).view(4, 2))
    seen_ours, seen_theirs = _spied_evictions(ours), _spied_evictions(theirs)
    for ids in _EVICTION_BATCHES:
        _, got = ours(_kjt(ids))
        _, want = theirs(tr.KeyedJaggedTensor(keys=["f0"], values=torch.tensor(ids), lengths=torch.tensor([len(ids)])))
        assert got.values().tolist() == want.values().tolist()
    assert [s.tolist() for s in seen_ours] == [s.tolist() for s in seen_theirs] == [[0, 1, 2], [], [2]]
    assert torch.equal(_weight(ours).detach(), torch.arange(8.0).view(4, 2))
    assert torch.equal(their_weight.detach(), torch.arange(8.0).view(4, 2))


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("in_place", [False, True])
def test_reset_evicted_rows_redraws_the_rows_handed_to_new_ids_before_the_lookup(kind: str, in_place: bool) -> None:
    """``reset_evicted_rows=True`` (torchrec's sharded semantics): the rows ``evict()`` reports are ``init_fn``'s,
    every other row is unchanged bit for bit, and the batch's lookup already reads the redrawn rows."""
    module = _mc_lookup(kind, reset=True, in_place=in_place)
    seen = _spied_evictions(module)
    weight = _weight(module)
    for ids in _EVICTION_BATCHES:
        before = weight.detach().clone()
        version = weight._version
        embeddings, remapped = module(_kjt(ids))
        rows = seen[-1]
        assert rows is not None
        kept = torch.ones(4, dtype=torch.bool)
        kept[rows] = False
        assert torch.equal(weight.detach()[rows], torch.full((rows.numel(), 2), 0.5))
        assert torch.equal(weight.detach()[kept], before[kept])
        assert (weight._version == version) == (in_place or rows.numel() == 0)
        looked_up = embeddings.values() if kind == "ebc" else embeddings["f0"].values()
        rows_read = weight.detach()[remapped.values()]
        assert torch.equal(looked_up.detach(), rows_read.sum(0, keepdim=True) if kind == "ebc" else rows_read)
    assert [s.tolist() for s in seen] == [[0, 1, 2], [], [2]]


def test_reset_evicted_rows_must_be_a_bool() -> None:
    from tritonrec.modules import ManagedCollisionEmbeddingBagCollection

    module = _mc_lookup("ebc")
    with pytest.raises(TypeError, match="reset_evicted_rows"):
        ManagedCollisionEmbeddingBagCollection(
            module._embedding_module, module._managed_collision_collection, reset_evicted_rows="yes"
        )


def test_mc_ebc_refuses_a_variable_batch_before_remapping() -> None:
    """The EBC cannot take a VBE KJT; the MC-EBC says so before its collection inserts the batch's ids."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig, HashZchManagedCollisionModule
    from tritonrec.modules.mc_collection import ManagedCollisionCollection
    from tritonrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

    configs = [EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=2, feature_names=["a", "b"])]
    module = HashZchManagedCollisionModule(zch_size=8, device="cpu", total_num_buckets=1, max_probe=2)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(configs), ManagedCollisionCollection({"t": module}, configs)
    )
    inverse = (["a", "b"], torch.zeros(2, 3, dtype=torch.int64))
    lengths = torch.ones(4, dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4]), lengths=lengths,
                            stride_per_key_per_rank=[[1], [3]], inverse_indices=inverse)  # fmt: skip
    with pytest.raises(ValueError, match=r"ManagedCollisionEmbeddingBagCollection needs one batch size for all keys"):
        mc_ebc(kjt)
    assert (module._hash_zch_identities == -1).all()
