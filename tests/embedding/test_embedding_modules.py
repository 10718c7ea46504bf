"""EmbeddingBagCollection / EmbeddingCollection: torchrec semantics against per-table torch modules built from the
same parameters, parameter aliasing and re-packing, training with plain torch optimizers, config validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from embedding.tbe_testing import BACKENDS

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
)


def _bag_tables() -> list[EmbeddingBagConfig]:
    # interleaved dtypes (two groups, output columns re-ordered), a shared table, dims 3 / 129 / 1
    return [
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=3, name="t0", feature_names=["f0", "f3"]),
        EmbeddingBagConfig(
            num_embeddings=5,
            embedding_dim=129,
            name="t1",
            feature_names=["f1"],
            pooling=PoolingType.MEAN,
            data_type=DataType.FP16,
        ),
        EmbeddingBagConfig(
            num_embeddings=4, embedding_dim=1, name="t2", feature_names=["f2"], pooling=PoolingType.MEAN
        ),
    ]


def _kjt(keys=("f2", "f0", "extra", "f1", "f3"), weighted=False, seed=0) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * 3,), generator=gen)
    values = torch.randint(0, 4, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=weights)


def _reference_pooled(module, kjt: KeyedJaggedTensor, weighted: bool) -> dict[str, torch.Tensor]:
    """Each feature through an nn.EmbeddingBag holding (an fp32 copy of) the module's table."""
    out = {}
    for config in module.embedding_bag_configs():
        table = module.embedding_bags[config.name].weight.detach().float()
        mean = config.pooling == PoolingType.MEAN
        bag = torch.nn.EmbeddingBag.from_pretrained(table, mode="mean" if mean and not weighted else "sum")
        for name in config.feature_names:
            jt = kjt[name]
            psw = jt.weights() if weighted else None
            pooled = bag(jt.values(), jt.offsets()[:-1], per_sample_weights=psw)
            if mean and weighted:
                pooled = pooled / jt.lengths().clamp(min=1)[:, None]
            out[name] = pooled
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_ebc_matches_per_table_embedding_bags(backend, weighted, tolerance):
    ebc = EmbeddingBagCollection(_bag_tables(), is_weighted=weighted, backend=backend)
    kjt = _kjt(weighted=weighted)
    kt = ebc(kjt)
    assert kt.keys() == ["f0", "f3", "f1", "f2"]
    assert kt.length_per_key() == [3, 3, 129, 1] and kt.values().shape == (3, 136)
    assert kt.values().dtype == torch.float32
    for name, expected in _reference_pooled(ebc, kjt, weighted).items():
        torch.testing.assert_close(kt[name], expected, **tolerance(torch.float32))


def test_ebc_parameters_state_dict_and_repacking():
    ebc = EmbeddingBagCollection(_bag_tables(), backend="torch")
    assert list(ebc.state_dict()) == [
        "embedding_bags.t0.weight",
        "embedding_bags.t1.weight",
        "embedding_bags.t2.weight",
    ]
    assert ebc.embedding_bags["t1"].weight.dtype == torch.float16
    # torchrec's default init: U(-sqrt(1 / num_embeddings), sqrt(1 / num_embeddings))
    assert ebc.embedding_bags["t0"].weight.abs().max() <= 6**-0.5
    kjt = _kjt()
    before = ebc(kjt).values()
    other = EmbeddingBagCollection(_bag_tables(), backend="torch")
    other.load_state_dict(ebc.state_dict())
    assert torch.equal(other(kjt).values(), before)
    # replacing parameter storage (as .to() or assign-loading does) is repaired before the next forward
    param = other.embedding_bags["t0"].weight
    param.data = param.data.clone()
    assert torch.equal(other(kjt).values(), before)
    assert other.embedding_bags["t0"].weight is param
    # assign=True replaces the Parameter objects themselves: the module follows the new ones
    fresh = EmbeddingBagCollection(_bag_tables(), backend="torch")
    other.load_state_dict({k: v.clone() for k, v in fresh.state_dict().items()}, assign=True)
    assert torch.equal(other(kjt).values(), fresh(kjt).values())
    assert not torch.equal(other(kjt).values(), before)
    halved = EmbeddingBagCollection(_bag_tables(), backend="torch").half()
    assert halved(kjt).values().dtype == torch.float32


# torch's own sparse Adagrad builds COO tensors without opting in or out of invariant checks
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_ebc_trains_with_plain_torch_optimizers_like_embedding_bags(backend, sparse, tolerance):
    tables = [
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="a", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(num_embeddings=4, embedding_dim=3, name="b", feature_names=["f2"], pooling=PoolingType.MEAN),
    ]
    ebc = EmbeddingBagCollection(tables, sparse=sparse, backend=backend)
    bags = {
        c.name: torch.nn.EmbeddingBag.from_pretrained(
            ebc.embedding_bags[c.name].weight.detach().clone(),
            freeze=False,
            sparse=sparse,
            mode="mean" if c.pooling == PoolingType.MEAN else "sum",
        )
        for c in tables
    }
    opt = (torch.optim.Adagrad if sparse else torch.optim.SGD)(ebc.parameters(), lr=0.1)
    ref_opt = (torch.optim.Adagrad if sparse else torch.optim.SGD)([b.weight for b in bags.values()], lr=0.1)
    for step in range(3):
        kjt = _kjt(("f0", "f1", "f2"), seed=step)
        target = torch.randn(3, 11)
        opt.zero_grad()
        F.mse_loss(ebc(kjt).values(), target).backward()
        opt.step()
        ref_opt.zero_grad()
        feats = {n: bags["a" if n != "f2" else "b"](kjt[n].values(), kjt[n].offsets()[:-1]) for n in ("f0", "f1", "f2")}
        F.mse_loss(torch.cat([feats["f0"], feats["f1"], feats["f2"]], dim=1), target).backward()
        ref_opt.step()
    for name, bag in bags.items():
        torch.testing.assert_close(ebc.embedding_bags[name].weight, bag.weight, **tolerance(torch.float32))


def test_ebc_input_errors():
    ebc = EmbeddingBagCollection(_bag_tables(), is_weighted=True, backend="torch")
    with pytest.raises(ValueError, match="is_weighted=True but features has no weights"):
        ebc(_kjt())
    with pytest.raises(ValueError, match=r"features is missing keys \['f1'\]"):
        EmbeddingBagCollection(_bag_tables(), backend="torch")(_kjt(("f0", "f2", "f3")))
    with pytest.raises(TypeError, match="features must be a KeyedJaggedTensor, got dict"):
        ebc({"f0": None})
    variable = KeyedJaggedTensor(
        keys=["f0", "f1", "f2", "f3"],
        values=torch.zeros(4, dtype=torch.long),
        lengths=torch.ones(4, dtype=torch.long),
        stride_per_key_per_rank=[[1], [2], [1], [0]],
    )
    with pytest.raises(ValueError, match="needs one batch size for all keys"):
        EmbeddingBagCollection(_bag_tables(), backend="torch")(variable)


@pytest.mark.parametrize(
    ("tables", "error", "message"),
    [
        ([], ValueError, "EmbeddingBagCollection needs a non-empty list of EmbeddingBagConfig"),
        (
            [EmbeddingConfig(num_embeddings=3, embedding_dim=2, name="a")],
            TypeError,
            r"tables\[0\] must be an EmbeddingBagConfig, got EmbeddingConfig",
        ),
        ([EmbeddingBagConfig(num_embeddings=3, embedding_dim=2)], ValueError, r"tables\[0\] needs a name"),
        (
            [EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="a")] * 2,
            ValueError,
            "table names must be unique, got 'a' twice",
        ),
        (  # torchrec names both slots "f@a" (duplicate output keys); several tables may share "f", one table not
            [EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="a", feature_names=["f", "g", "f"])],
            ValueError,
            r"table 'a' lists features \['f'\] more than once in feature_names=\['f', 'g', 'f'\]",
        ),
        (
            [EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="a", data_type=DataType.INT8)],
            ValueError,
            "data_type DataType.INT8 has no float storage dtype",
        ),
    ],
)
def test_ebc_rejects_bad_tables(tables, error, message):
    with pytest.raises(error, match=message):
        EmbeddingBagCollection(tables)


def test_configs_validate_fields():
    with pytest.raises(ValueError, match="table 'a': num_embeddings must be a positive int, got num_embeddings=0"):
        EmbeddingBagConfig(num_embeddings=0, embedding_dim=2, name="a")
    with pytest.raises(ValueError, match="table 'a': embedding_dim must be a positive int, got embedding_dim=-2"):
        EmbeddingConfig(num_embeddings=3, embedding_dim=-2, name="a")
    with pytest.raises(ValueError, match="pooling must be PoolingType.SUM or MEAN, got <PoolingType.NONE"):
        EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="a", pooling=PoolingType.NONE)
    with pytest.raises(TypeError, match="table 'a': data_type must be a DataType, got 'fp16'"):
        EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="a", data_type="fp16")
    with pytest.raises(TypeError, match=r"feature_names must be a list of str, got \[1\]"):
        EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="a", feature_names=[1])
    with pytest.raises(ValueError, match=r"weight_init_min \(1.0\) exceeds weight_init_max \(0.5\)"):
        EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="a", weight_init_min=1.0, weight_init_max=0.5)
    config = EmbeddingBagConfig(100, 8, "t", DataType.FP32, ["f"])  # torchrec's positional order
    assert (config.num_embeddings, config.embedding_dim, config.name, config.feature_names) == (100, 8, "t", ["f"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_ec_returns_rows_per_value_with_different_dims(backend, tolerance):
    tables = [
        EmbeddingConfig(num_embeddings=6, embedding_dim=3, name="t0", feature_names=["f0", "f3"]),
        EmbeddingConfig(num_embeddings=5, embedding_dim=129, name="t1", feature_names=["f1"], data_type=DataType.BF16),
        EmbeddingConfig(num_embeddings=4, embedding_dim=1, name="t2", feature_names=["f2"]),
    ]
    ec = EmbeddingCollection(tables, need_indices=True, backend=backend)
    assert list(ec.state_dict()) == ["embeddings.t0.weight", "embeddings.t1.weight", "embeddings.t2.weight"]
    kjt = _kjt()
    out = ec(kjt)
    assert list(out) == ["f0", "f3", "f1", "f2"]
    owner = {"f0": "t0", "f3": "t0", "f1": "t1", "f2": "t2"}
    for name, jt in out.items():
        table = ec.embeddings[owner[name]].weight.detach().float()
        assert torch.equal(jt.values(), F.embedding(kjt[name].values(), table))
        assert torch.equal(jt.lengths(), kjt[name].lengths()) and torch.equal(jt.weights(), kjt[name].values())
    sum(jt.values().sum() for jt in out.values()).backward()
    counts = torch.bincount(torch.cat([kjt["f0"].values(), kjt["f3"].values()]), minlength=6).float()
    torch.testing.assert_close(
        ec.embeddings["t0"].weight.grad, counts[:, None].expand(6, 3), **tolerance(torch.float32)
    )
    with pytest.raises(ValueError, match=r"tables have different dims \[1, 3, 129\]"):
        ec.embedding_dim()


def test_reset_parameters_redraws_tables_in_place_from_init_fn():
    """torchrec's ``reset_parameters()`` (DMP and user code call it): each table re-drawn from its ``init_fn``, the
    parameters still views of the flat buffer (so the next forward reads the new rows); a no-op on ``meta``."""
    fill = lambda value: lambda t: t.fill_(value)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=5, embedding_dim=3, name="t0", feature_names=["f0"], init_fn=fill(2.0)),
            EmbeddingBagConfig(5, 2, "t1", DataType.FP16, ["f1"], init_fn=lambda t: torch.full_like(t, 3.0)),
        ],
        backend="torch",
    )
    with torch.no_grad():
        for param in ebc.parameters():
            param.zero_()
    ebc.reset_parameters()
    assert torch.equal(ebc.embedding_bags["t0"].weight, torch.full((5, 3), 2.0))
    assert torch.equal(ebc.embedding_bags["t1"].weight, torch.full((5, 2), 3.0, dtype=torch.float16))
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([4, 0]), lengths=torch.tensor([1, 1]))
    assert torch.equal(ebc(kjt).values(), torch.tensor([[2.0, 2.0, 2.0, 3.0, 3.0]]))
    ec = EmbeddingCollection([EmbeddingConfig(4, 2, "t", feature_names=["a", "b"], init_fn=fill(1.5))], backend="torch")
    with torch.no_grad():
        ec.embeddings["t"].weight.zero_()
    ec.reset_parameters()
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([3]), lengths=torch.tensor([1, 0]))
    assert torch.equal(ec(kjt)["a"].values(), torch.full((1, 2), 1.5))
    assert ec.embedding_names_by_table() == [["a", "b"]]
    EmbeddingBagCollection([EmbeddingBagConfig(5, 3, "t", feature_names=["f"])], device="meta").reset_parameters()
