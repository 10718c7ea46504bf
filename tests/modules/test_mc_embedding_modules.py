"""ManagedCollisionCollection and the MC-EBC / MC-EC: remapped KJTs against the dict-based reference (one remapper
per table, fed all of the table's features), outputs equal to a plain EBC / EC looked up with the remapped ids,
state-dict round trip, eval mode, bad input."""

from __future__ import annotations

import pytest
import torch

from tests.modules.mc_reference import ReferenceZCH, lfu, lru
from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)

# t0 reads f1 and f3 (one remapper for both), t1 reads f2
_TABLES = {"t0": (6, ["f1", "f3"]), "t1": (9, ["f2"])}
_KEYS = ["f1", "f2", "f3"]


def _configs(kind: str) -> list[EmbeddingBagConfig] | list[EmbeddingConfig]:
    config = EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    return [config(name=n, num_embeddings=z, embedding_dim=3, feature_names=f) for n, (z, f) in _TABLES.items()]


def _mcc(configs: list, policy: type = LFU_EvictionPolicy, interval: int = 2) -> ManagedCollisionCollection:
    modules = {
        c.name: MCHManagedCollisionModule(c.num_embeddings, "cpu", policy(), interval, name=c.name) for c in configs
    }
    return ManagedCollisionCollection(modules, configs)


def _mc_module(kind: str, policy: type = LFU_EvictionPolicy, weighted: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    configs = _configs(kind)
    if kind == "ebc":
        ebc = EmbeddingBagCollection(configs, is_weighted=weighted, device="cpu", backend="torch")
        return ManagedCollisionEmbeddingBagCollection(ebc, _mcc(configs, policy), return_remapped_features=True)
    ec = EmbeddingCollection(configs, device="cpu", backend="torch")
    return ManagedCollisionEmbeddingCollection(ec, _mcc(configs, policy), return_remapped_features=True)


def _batches(seed: int, count: int, batch: int = 3, fixed: bool = False) -> list[KeyedJaggedTensor]:
    """Random bags of skewed ids; ``fixed``: every bag holds 2 ids (so history buffers never overflow)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = (
            torch.full((len(_KEYS) * batch,), 2) if fixed else torch.randint(0, 4, (len(_KEYS) * batch,), generator=g)
        )
        n = int(lengths.sum())
        ids = (torch.rand(n, generator=g) ** 2 * 30).long()
        out.append(KeyedJaggedTensor(keys=_KEYS, values=ids, lengths=lengths, weights=torch.rand(n, generator=g)))
    return out


def _table_ids(kjt: KeyedJaggedTensor, table: str) -> list[int]:
    return [v for f in _TABLES[table][1] for v in kjt[f].values().tolist()]


@pytest.mark.parametrize(("policy", "score"), [(LFU_EvictionPolicy, lfu), (LRU_EvictionPolicy, lru())])
def test_collection_matches_reference(policy: type, score: object) -> None:
    mcc = _mcc(_configs("ebc"), policy, interval=2)
    references = {t: ReferenceZCH(z, 2, score) for t, (z, _) in _TABLES.items()}  # type: ignore[arg-type]
    for step, kjt in enumerate(_batches(1, 10)):
        training = step < 8
        mcc.train(training)
        out = mcc(kjt)
        assert out.keys() == ["f1", "f3", "f2"]  # config order, as torchrec
        assert torch.equal(out.weights(), torch.cat([kjt[f].weights() for f in out.keys()]))
        for table in _TABLES:
            assert _table_ids(out, table) == references[table](_table_ids(kjt, table), training), f"step {step}"
    assert set(mcc.open_slots()) == {"t0", "t1"}


@pytest.mark.parametrize(("kind", "weighted"), [("ebc", False), ("ebc", True), ("ec", False)])
def test_outputs_equal_plain_lookup_of_remapped_ids(kind: str, weighted: bool) -> None:
    module = _mc_module(kind, LRU_EvictionPolicy, weighted)
    plain = (
        EmbeddingBagCollection(_configs(kind), is_weighted=weighted, backend="torch")
        if kind == "ebc"
        else EmbeddingCollection(_configs(kind), backend="torch")
    )
    plain.load_state_dict(
        {k.removeprefix("_embedding_module."): v for k, v in module.state_dict().items() if "emb" in k}
    )
    for step, kjt in enumerate(_batches(2, 8)):
        module.train(step < 6)
        embeddings, remapped = module(kjt)
        expected = plain(remapped)
        if kind == "ebc":
            assert embeddings.keys() == expected.keys() and torch.equal(embeddings.values(), expected.values())
        else:
            assert list(embeddings) == list(expected)
            assert all(torch.equal(embeddings[k].values(), expected[k].values()) for k in expected)
    module._return_remapped_features = False
    assert module(_batches(3, 1)[0])[1] is None


def test_state_dict_round_trip_and_gradients() -> None:
    module = _mc_module("ebc")
    keys = list(module.state_dict())
    assert "_managed_collision_collection._managed_collision_modules.t0._mch_sorted_raw_ids" in keys
    assert "_managed_collision_collection._managed_collision_modules.t1._mch_counts" in keys
    assert "_embedding_module.embedding_bags.t0.weight" in keys
    # a restored module sizes its (unsaved) history from its own first batch: same-size batches keep the two equal
    batches = _batches(4, 10, fixed=True)
    for kjt in batches[:4]:  # a merge boundary (interval 2)
        module(kjt)
    restored = _mc_module("ebc", seed=1)
    restored.load_state_dict(module.state_dict(), strict=True)
    for mode in ("eval", "train"):
        module.train(mode == "train")
        restored.train(mode == "train")
        for kjt in batches[4:]:
            (a, ra), (b, rb) = module(kjt), restored(kjt)
            assert torch.equal(ra.values(), rb.values()) and torch.equal(a.values(), b.values())
    embeddings, _ = module(batches[0])
    embeddings.values().sum().backward()
    assert module._embedding_bag_collection.embedding_bags["t0"].weight.grad is not None


def test_eval_does_not_change_state() -> None:
    module = _mc_module("ec")
    for kjt in _batches(5, 4):
        module(kjt)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.eval()
    for kjt in _batches(6, 4):
        module(kjt)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_key_order_and_extra_keys() -> None:
    mcc = _mcc(_configs("ebc"))
    mcc.eval()
    kjt = _batches(7, 1)[0]
    shuffled = KeyedJaggedTensor(
        keys=["extra", "f3", "f2", "f1"],
        values=torch.cat([torch.tensor([5]), kjt["f3"].values(), kjt["f2"].values(), kjt["f1"].values()]),
        lengths=torch.cat([torch.tensor([1, 0, 0]), kjt["f3"].lengths(), kjt["f2"].lengths(), kjt["f1"].lengths()]),
    )
    a, b = mcc(kjt), mcc(shuffled)
    assert a.keys() == b.keys() == ["f1", "f3", "f2"] and torch.equal(a.values(), b.values())
    # variable batch per key: the per-key strides follow their keys into config order
    vbe = KeyedJaggedTensor(
        keys=_KEYS,
        values=torch.arange(7),
        lengths=torch.tensor([1, 1, 2, 0, 1, 2]),
        stride_per_key_per_rank=[[2], [3], [1]],
    )
    out = mcc(vbe)
    assert out.stride_per_key_per_rank() == [[2], [1], [3]] and out.lengths().tolist() == [1, 1, 2, 2, 0, 1]
    assert out.values().tolist() == [5, 5, 5, 5, 8, 8, 8]  # nothing held yet: every id -> its table's miss row


def test_bad_input() -> None:
    configs = _configs("ebc")
    mcc = _mcc(configs)
    with pytest.raises(ValueError, match=r"missing the managed-collision feature\(s\) \['f3'\]"):
        mcc(KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])))
    with pytest.raises(TypeError, match=r"features\.values\(\).*int32 or int64"):
        mcc(KeyedJaggedTensor(keys=_KEYS, values=torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([1, 1, 1])))
    with pytest.raises(TypeError, match="features must be a KeyedJaggedTensor"):
        mcc({"f1": torch.tensor([1])})
    lfu_module = MCHManagedCollisionModule(5, "cpu", LFU_EvictionPolicy(), 1)
    with pytest.raises(ValueError, match=r"table 't0'.*output_size\(\) 5 != num_embeddings 6"):
        ManagedCollisionCollection({"t0": lfu_module, "t1": _mcc(configs)._managed_collision_modules["t1"]}, configs)
    with pytest.raises(ValueError, match="table 't1' is not present"):
        ManagedCollisionCollection({"t0": _mcc(configs)._managed_collision_modules["t0"]}, configs)
    with pytest.raises(TypeError, match=r"managed_collision_modules\['t0'\]"):
        ManagedCollisionCollection({"t0": torch.nn.Linear(1, 1)}, configs)
    shared = [EmbeddingBagConfig(name="a", num_embeddings=4, embedding_dim=2, feature_names=["f"])] * 2
    with pytest.raises(ValueError, match="one managed-collision table"):
        ManagedCollisionCollection({"a": MCHManagedCollisionModule(4, "cpu", LFU_EvictionPolicy(), 1)}, shared)
    other = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", num_embeddings=6, embedding_dim=3)])
    with pytest.raises(ValueError, match="same embedding configs"):
        ManagedCollisionEmbeddingBagCollection(other, mcc)
    with pytest.raises(TypeError, match="embedding_collection must be an EmbeddingCollection"):
        ManagedCollisionEmbeddingCollection(EmbeddingBagCollection(configs), mcc)  # type: ignore[arg-type]


def test_fx_trace_records_one_node_and_computes_the_same() -> None:
    """A model holding an MC-EBC traces with plain fx (the remapping branches on ids): one call_module node, and the
    traced model inserts, evicts and looks up exactly as the eager one."""

    class Model(torch.nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.sparse = _mc_module("ebc", seed=seed)
            self.dense = torch.nn.Linear(9, 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            embeddings, _ = self.sparse(kjt)
            return self.dense(embeddings.values())

    eager, traced = Model(0), Model(0)
    traced.load_state_dict(eager.state_dict())
    graph = torch.fx.symbolic_trace(traced)
    assert [n.target for n in graph.graph.nodes if n.op == "call_module"] == ["sparse", "dense"]
    for kjt in _batches(8, 6):
        assert torch.equal(graph(kjt), eager(kjt))
    assert all(torch.equal(a, b) for a, b in zip(graph.state_dict().values(), eager.state_dict().values(), strict=True))
