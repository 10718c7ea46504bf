"""Shared features (one KJT key read by several tables, torchrec's ``feature@table`` embedding names) in the
unsharded modules: EBC / EC / fused / feature-processed / quantized EBC and DLRM against per-table torch references
(``nn.EmbeddingBag`` / ``F.embedding`` on the same weights, each table pooling the same key's ids), gradients and a
fused step included. The expected names are torchrec 1.8's, written out."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from embedding.tbe_testing import BACKENDS

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import (
    DLRM,
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    PoolingType,
    PositionWeightedModule,
    QuantEmbeddingBagCollection,
)
from tritonrec.modules.embedding_configs import get_embedding_names_by_table

# f1 is read by t0 and t2 (one fp32 group, so one launch gathers it twice) and by t1 (the fp16 group); f0 and f2 are
# read once. torchrec 1.8's EmbeddingBagCollection names them so:
EXPECTED_NAMES = ["f0", "f1@t0", "f1@t1", "f2", "f1@t2"]


def _bag_tables(fp16: bool = True) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=3, name="t0", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(
            num_embeddings=5,
            embedding_dim=4,
            name="t1",
            feature_names=["f1"],
            pooling=PoolingType.MEAN,
            data_type=DataType.FP16 if fp16 else DataType.FP32,
        ),
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=2, name="t2", feature_names=["f2", "f1"]),
    ]


def _kjt(weighted: bool = False, batch: int = 3, seed: int = 0) -> KeyedJaggedTensor:
    keys = ["f2", "extra", "f1", "f0"]  # not in table order, with a key no table reads
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=gen)  # < the smallest table reading each key
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _reference_bags(module: EmbeddingBagCollection) -> dict[str, tuple[str, torch.nn.EmbeddingBag, bool]]:
    """Embedding name -> (its feature, an fp32 nn.EmbeddingBag holding a trainable copy of its table, mean)."""
    out = {}
    for config in module.embedding_bag_configs():
        table = module.embedding_bags[config.name].weight.detach().float().clone()
        bag = torch.nn.EmbeddingBag.from_pretrained(table, freeze=False, mode="sum")
        for feature in config.feature_names:
            shared = sum(feature in c.feature_names for c in module.embedding_bag_configs()) > 1
            name = f"{feature}@{config.name}" if shared else feature
            out[name] = (feature, bag, config.pooling == PoolingType.MEAN)
    return out


def _pool(bag: torch.nn.EmbeddingBag, kjt: KeyedJaggedTensor, feature: str, mean: bool, weighted: bool):
    jt = kjt[feature]
    pooled = bag(jt.values(), jt.offsets()[:-1], per_sample_weights=jt.weights() if weighted else None)
    return pooled / jt.lengths().clamp(min=1)[:, None] if mean else pooled


def test_embedding_names_by_table_follow_torchrec():
    tables = [
        EmbeddingConfig(num_embeddings=4, embedding_dim=2, name="t1", feature_names=["f", "g"]),
        EmbeddingConfig(num_embeddings=4, embedding_dim=2, name="t2", feature_names=["f"]),
        EmbeddingConfig(num_embeddings=4, embedding_dim=2, name="t3", feature_names=["h"]),
    ]
    assert get_embedding_names_by_table(tables) == [["f@t1", "g"], ["f@t2"], ["h"]]
    assert EmbeddingCollection(tables, backend="torch").embedding_names_by_table() == [["f@t1", "g"], ["f@t2"], ["h"]]


@pytest.mark.parametrize("collection", [EmbeddingBagCollection, EmbeddingCollection])
def test_a_missing_shared_feature_is_named_once(collection):
    config = EmbeddingBagConfig if collection is EmbeddingBagCollection else EmbeddingConfig
    tables = [config(num_embeddings=5, embedding_dim=2, name=t, feature_names=fs)
              for t, fs in (("t0", ["f0", "f1"]), ("t1", ["f1"]))]  # fmt: skip
    module = collection(tables, backend="torch")  # one group reads f1 twice
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"features is missing keys \['f1'\] \(it has \['f0'\]\)"):
        module(kjt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_pools_a_shared_feature_with_every_table(backend, weighted, tolerance):
    ebc = EmbeddingBagCollection(_bag_tables(), is_weighted=weighted, backend=backend)
    kjt = _kjt(weighted)
    out = ebc(kjt)
    assert out.keys() == EXPECTED_NAMES
    assert out.length_per_key() == [3, 3, 4, 2, 2]
    reference = _reference_bags(ebc)
    grad_out = torch.randn(out.values().shape, generator=torch.Generator().manual_seed(1))
    (out.values() * grad_out).sum().backward()
    by_name = dict(zip(out.keys(), grad_out.split(out.length_per_key(), dim=1), strict=True))
    for name, (feature, bag, mean) in reference.items():
        expected = _pool(bag, kjt, feature, mean, weighted)
        dtype = torch.float16 if name == "f1@t1" else torch.float32
        torch.testing.assert_close(out[name], expected, **tolerance(dtype))
        (expected * by_name[name]).sum().backward()
    for config in ebc.embedding_bag_configs():
        param = ebc.embedding_bags[config.name].weight
        bag = reference[f"f1@{config.name}"][1]
        torch.testing.assert_close(param.grad.float(), bag.weight.grad, **tolerance(param.dtype))


def test_fused_ebc_step_equals_sgd_on_per_table_bags(tolerance):
    lr = 0.5
    fused = FusedEmbeddingBagCollection(
        _bag_tables(fp16=False), "EXACT_SGD", {"lr": lr}, backend="torch", stochastic_rounding=False
    )
    reference = _reference_bags(fused)
    kjt = _kjt()
    out = fused(kjt)
    assert out.keys() == EXPECTED_NAMES
    out.values().sum().backward()
    for feature, bag, mean in reference.values():
        _pool(bag, kjt, feature, mean, False).sum().backward()
    for config in fused.embedding_bag_configs():
        bag = reference[f"f1@{config.name}"][1]
        expected = bag.weight.detach() - lr * bag.weight.grad  # each table's rows move by every feature it pools
        torch.testing.assert_close(
            fused.embedding_bags[config.name].weight.detach(), expected, **tolerance(torch.float32)
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True])
def test_ec_returns_a_shared_feature_once_per_table(backend, fused):
    tables = [
        EmbeddingConfig(num_embeddings=6, embedding_dim=3, name="t0", feature_names=["f1", "f0"]),
        EmbeddingConfig(num_embeddings=5, embedding_dim=2, name="t1", feature_names=["f1"], data_type=DataType.BF16),
        EmbeddingConfig(num_embeddings=7, embedding_dim=4, name="t2", feature_names=["f2", "f1"]),
    ]
    if fused:
        ec = FusedEmbeddingCollection(tables, "EXACT_SGD", {"lr": 1.0}, backend=backend, stochastic_rounding=False)
    else:
        ec = EmbeddingCollection(tables, need_indices=True, backend=backend)
    before = {c.name: ec.embeddings[c.name].weight.detach().float().clone() for c in tables}
    kjt = _kjt()
    out = ec(kjt)
    assert list(out) == ["f1@t0", "f0", "f1@t1", "f2", "f1@t2"]
    owner = {
        "f1@t0": ("f1", "t0"),
        "f0": ("f0", "t0"),
        "f1@t1": ("f1", "t1"),
        "f2": ("f2", "t2"),
        "f1@t2": ("f1", "t2"),
    }
    for name, (feature, table) in owner.items():
        assert torch.equal(out[name].values(), F.embedding(kjt[feature].values(), before[table]))
        assert torch.equal(out[name].lengths(), kjt[feature].lengths())
        if not fused:
            assert torch.equal(out[name].weights(), kjt[feature].values())
    sum(jt.values().sum() for jt in out.values()).backward()
    for config in tables:
        ids = torch.cat([kjt[f].values() for f in config.feature_names])
        counts = torch.bincount(ids, minlength=config.num_embeddings).float()[:, None].expand_as(before[config.name])
        if fused:  # SGD with lr 1: each row moved by minus its count of ids
            got = before[config.name] - ec.embeddings[config.name].weight.detach().float()
            torch.testing.assert_close(got, counts, rtol=0, atol=0.02)
        else:
            assert torch.equal(ec.embeddings[config.name].weight.grad.float(), counts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ec_backward_with_eight_slots_in_one_group(backend, tolerance):
    """Two tables sharing four features: eight slots in one dtype group, every row repeated (slot 7's fingerprint
    overflowed a Python int -> tensor conversion in the backward's ordering of duplicate rows)."""
    features = ["a", "b", "c", "d"]
    tables = [EmbeddingConfig(num_embeddings=2, embedding_dim=3, name=t, feature_names=features) for t in ("t0", "t1")]
    ec = EmbeddingCollection(tables, backend=backend)
    kjt = KeyedJaggedTensor(keys=features, values=torch.tensor([0, 1, 0] * 4), lengths=torch.tensor([2, 1] * 4))
    out = ec(kjt)
    assert list(out) == [f"{f}@{t}" for t in ("t0", "t1") for f in features]
    leaves = {t: ec.embeddings[t].weight.detach().clone().requires_grad_() for t in ("t0", "t1")}
    gen = torch.Generator().manual_seed(3)
    loss, expected = 0.0, 0.0
    for name, jt in out.items():
        feature, table = name.split("@")
        upstream = torch.randn(jt.values().shape, generator=gen)
        loss = loss + (jt.values() * upstream).sum()
        expected = expected + (F.embedding(kjt[feature].values(), leaves[table]) * upstream).sum()
    loss.backward()
    expected.backward()
    for table, leaf in leaves.items():
        torch.testing.assert_close(ec.embeddings[table].weight.grad, leaf.grad, **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_feature_processor_weights_a_shared_feature_once_for_all_its_tables(backend, tolerance):
    ebc = EmbeddingBagCollection(_bag_tables(fp16=False), is_weighted=True, backend=backend)
    processors = {f: PositionWeightedModule(3) for f in ("f0", "f1", "f2")}  # keyed by feature, as in torchrec
    with torch.no_grad():
        for k, module in enumerate(processors.values()):
            module.position_weight.copy_(torch.tensor([1.0, 2.0, 0.5]) + k)
    fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    kjt = _kjt()
    out = fp_ebc(kjt)
    assert out.keys() == EXPECTED_NAMES
    grad_out = torch.randn(out.values().shape, generator=torch.Generator().manual_seed(2))
    (out.values() * grad_out).sum().backward()
    by_name = dict(zip(out.keys(), grad_out.split(out.length_per_key(), dim=1), strict=True))
    reference_weights = {f: m.position_weight.detach().clone().requires_grad_() for f, m in processors.items()}
    loss = 0.0
    for name, (feature, bag, mean) in _reference_bags(ebc).items():
        jt = kjt[feature]
        positions = torch.arange(jt.values().numel()) - torch.repeat_interleave(jt.offsets()[:-1], jt.lengths())
        psw = reference_weights[feature][positions]
        expected = bag(jt.values(), jt.offsets()[:-1], per_sample_weights=psw)
        expected = expected / jt.lengths().clamp(min=1)[:, None] if mean else expected
        torch.testing.assert_close(out[name], expected, **tolerance(torch.float32))
        loss = loss + (expected * by_name[name]).sum()
    loss.backward()
    for feature, module in processors.items():  # f1's weights collect the gradient of all three tables
        torch.testing.assert_close(
            module.position_weight.grad, reference_weights[feature].grad, **tolerance(torch.float32)
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_quant_ebc_keeps_the_shared_names_and_matches_dequantized_bags(backend):
    ebc = EmbeddingBagCollection(_bag_tables(fp16=False), backend=backend)
    quant = QuantEmbeddingBagCollection.from_float(ebc, DataType.INT8)
    with torch.no_grad():
        for name, table in quant.dequantized_weights().items():
            ebc.embedding_bags[name].weight.copy_(table)
    kjt = _kjt()
    out = quant(kjt)
    assert out.keys() == EXPECTED_NAMES
    for name, (feature, bag, mean) in _reference_bags(ebc).items():
        torch.testing.assert_close(out[name], _pool(bag, kjt, feature, mean, False), rtol=1e-6, atol=1e-6)


def test_dlrm_counts_embeddings_not_features(tolerance):
    dim = 4
    tables = [
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=dim, name="t0", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=dim, name="t1", feature_names=["f1"]),
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=dim, name="t2", feature_names=["f2", "f1"]),
    ]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables, backend="torch")
    model = DLRM(ebc, 3, [5, dim], [6, 1])
    assert model.sparse_arch.sparse_feature_names == ["f0", "f1@t0", "f1@t1", "f2", "f1@t2"]
    assert model.sparse_arch.F == 5  # five embeddings of three features
    assert model.over_arch.model[0]._mlp[0]._linear.in_features == dim + math.comb(5, 2) + 5
    kjt, dense = _kjt(), torch.randn(3, 3)
    sparse = model.sparse_arch(kjt)
    assert sparse.shape == (3, 5, dim)
    reference = _reference_bags(ebc)
    for i, name in enumerate(model.sparse_arch.sparse_feature_names):
        feature, bag, mean = reference[name]
        torch.testing.assert_close(sparse[:, i], _pool(bag, kjt, feature, mean, False), **tolerance(torch.float32))
    model(dense, kjt).sum().backward()
    assert all(ebc.embedding_bags[t.name].weight.grad.abs().sum() > 0 for t in tables)
