"""EmbeddingTower and EmbeddingTowerCollection against per-bag loops over the tables' rows fed to the interactions by
hand: the routing of ``features`` / ``weighted_features`` per tower, the concatenation, torchrec's state-dict keys,
odd shapes (batch 1, dim 1), bad input naming the argument, and plain fx tracing (each collection one call_module
leaf) equal to eager, gradients included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    EmbeddingTower,
    EmbeddingTowerCollection,
)
from tritonrec.modules.embedding_tower import tower_input_params

KEYS = ["f0", "f1", "f2", "f3"]  # f0, f1: the bag tower's table t0; f2: its t1 (dim 1); f3: the sequence tower


class _Linear(nn.Module):
    """Interaction of a bag tower: ``Linear(kt.values())``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 2)

    def forward(self, kt: KeyedTensor) -> torch.Tensor:
        return self.linear(kt.values())


class _SumRows(nn.Module):
    """Interaction of a sequence tower: each sample's rows of ``name`` summed, ``[B, D]``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, embeddings: dict) -> torch.Tensor:
        jt = embeddings[self.name]
        sample_of_row = torch.repeat_interleave(jt.lengths())  # fx-traceable: no Python loop over the lengths
        return (
            jt.values().new_zeros(jt.lengths().shape[0], jt.values().shape[1]).index_add(0, sample_of_row, jt.values())
        )


def _towers() -> EmbeddingTowerCollection:
    torch.manual_seed(0)
    bags = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="t0", feature_names=["f0", "f1"]),
         EmbeddingBagConfig(num_embeddings=7, embedding_dim=1, name="t1", feature_names=["f2"])],
        backend="torch",
    )  # fmt: skip
    sequences = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=9, embedding_dim=4, name="s0", feature_names=["f3"])], backend="torch"
    )
    weighted = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=6, embedding_dim=2, name="w0", feature_names=["w"])],
        is_weighted=True,
        backend="torch",
    )
    return EmbeddingTowerCollection(
        [
            EmbeddingTower(bags, _Linear(7)),
            EmbeddingTower(sequences, _SumRows("f3")),
            EmbeddingTower(weighted, _Linear(2)),
        ]
    )


def _inputs(batch: int, seed: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(KEYS) * batch,), generator=g)
    features = KeyedJaggedTensor(KEYS, torch.randint(0, 6, (int(lengths.sum()),), generator=g), lengths=lengths)
    w_lengths = torch.randint(0, 3, (batch,), generator=g)
    n = int(w_lengths.sum())
    weighted = KeyedJaggedTensor(
        ["w"], torch.randint(0, 6, (n,), generator=g), torch.rand(n, generator=g), lengths=w_lengths
    )
    return features, weighted


def _bags(features: KeyedJaggedTensor, key: str, weight: torch.Tensor) -> torch.Tensor:
    """``[B, D]``: per sample, the sum of ``weight``'s rows of ``key``'s ids (times the KJT's weights if any)."""
    jt = features.to_dict()[key]
    ids, lengths = jt.values().tolist(), jt.lengths().tolist()
    scales = jt.weights().tolist() if features.weights_or_none() is not None else [1.0] * len(ids)
    out, start = [], 0
    for n in lengths:
        row = torch.zeros(weight.shape[1])
        for i in range(start, start + n):
            row += scales[i] * weight[ids[i]]
        out.append(row)
        start += n
    return torch.stack(out)


def _expected(
    model: EmbeddingTowerCollection, features: KeyedJaggedTensor, weighted: KeyedJaggedTensor
) -> torch.Tensor:
    s = {k: v.detach() for k, v in model.state_dict().items()}
    linear = lambda x, i: x @ s[f"towers.{i}.interaction.linear.weight"].T + s[f"towers.{i}.interaction.linear.bias"]
    t0, t1 = s["towers.0.embedding.embedding_bags.t0.weight"], s["towers.0.embedding.embedding_bags.t1.weight"]
    pooled = torch.cat([_bags(features, "f0", t0), _bags(features, "f1", t0), _bags(features, "f2", t1)], dim=1)
    sequence = _bags(features, "f3", s["towers.1.embedding.embeddings.s0.weight"])  # summed rows: a sum-pooled bag
    weighted_pooled = _bags(weighted, "w", s["towers.2.embedding.embedding_bags.w0.weight"])
    return torch.cat([linear(pooled, 0), sequence, linear(weighted_pooled, 2)], dim=1)


@pytest.mark.parametrize("batch", [3, 1])
def test_collection_routes_each_tower_and_concatenates(batch: int) -> None:
    model = _towers()
    for seed in range(2):
        features, weighted = _inputs(batch, seed)
        out = model(features, weighted)
        assert out.shape == (batch, 2 + 4 + 2)
        torch.testing.assert_close(out, _expected(model, features, weighted))


def test_tower_is_its_interaction_of_its_embedding() -> None:
    tower = _towers().towers[0]
    features, _ = _inputs(2, 0)
    expected = tower.interaction.linear(tower.embedding(features).values())
    assert torch.equal(tower(features), expected)
    assert torch.equal(tower(features=features), expected)


def test_input_params_follow_torchrec() -> None:
    towers = _towers().towers
    assert [tower_input_params(t.embedding) for t in towers] == [(True, False), (True, False), (False, True)]
    assert tower_input_params(nn.Linear(2, 2)) == (True, True)


class _BothKJTs(nn.Module):
    """An embedding module that is neither collection: it takes both KJTs (and reports how many ids each holds)."""

    def forward(self, features: KeyedJaggedTensor, weighted_features: KeyedJaggedTensor) -> torch.Tensor:
        batch = features.stride()
        sizes = [float(features.values().numel()), float(weighted_features.values().numel())]
        return torch.tensor([sizes] * batch)


def test_other_embedding_modules_get_both_kjts() -> None:
    features, weighted = _inputs(2, 1)
    model = EmbeddingTowerCollection([EmbeddingTower(_BothKJTs(), nn.Identity())])
    out = model(features, weighted)
    assert out.tolist() == [[features.values().numel(), weighted.values().numel()]] * 2


def test_torchrec_state_dict_keys() -> None:
    assert {k: tuple(v.shape) for k, v in _towers().state_dict().items()} == {
        "towers.0.embedding.embedding_bags.t0.weight": (10, 3),
        "towers.0.embedding.embedding_bags.t1.weight": (7, 1),
        "towers.0.interaction.linear.weight": (2, 7),
        "towers.0.interaction.linear.bias": (2,),
        "towers.1.embedding.embeddings.s0.weight": (9, 4),
        "towers.2.embedding.embedding_bags.w0.weight": (6, 2),
        "towers.2.interaction.linear.weight": (2, 2),
        "towers.2.interaction.linear.bias": (2,),
    }


class _FirstRow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:1]


def test_bad_input_is_named() -> None:
    model = _towers()
    features, weighted = _inputs(2, 0)
    with pytest.raises(ValueError, match=r"towers\[2\] reads weighted_features, but weighted_features is None"):
        model(features)
    with pytest.raises(ValueError, match=r"towers\[0\] reads features, but features is None"):
        model(weighted_features=weighted)
    with pytest.raises(ValueError, match="towers must be a non-empty list"):
        EmbeddingTowerCollection([])
    with pytest.raises(TypeError, match=r"towers\[1\] must be an EmbeddingTower, got Linear"):
        EmbeddingTowerCollection([model.towers[0], nn.Linear(2, 2)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="embedding_module must be an nn.Module"):
        EmbeddingTower(lambda f: f, nn.Identity())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="interaction_module must be an nn.Module, got function"):
        EmbeddingTower(nn.Identity(), lambda f: f)  # type: ignore[arg-type]
    bags = model.towers[0].embedding
    flat = EmbeddingTowerCollection([EmbeddingTower(bags, nn.Sequential(_Linear(7), nn.Flatten(0)))])
    with pytest.raises(ValueError, match=r"towers\[0\] must return a \[B, N\] tensor, got \(4,\)"):
        flat(features)
    short = EmbeddingTower(bags, nn.Sequential(_Linear(7), _FirstRow()))
    with pytest.raises(ValueError, match=r"towers\[1\] returned 1 rows but towers\[0\] returned 2"):
        EmbeddingTowerCollection([model.towers[0], short])(features)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower_arch = _towers()
        self.over = nn.Linear(8, 1)

    def forward(self, features: KeyedJaggedTensor, weighted_features: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.tower_arch(features, weighted_features))


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def test_traced_model_matches_eager() -> None:
    model = _Model()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    leaves = [str(n.target) for n in traced.graph.nodes if n.op == "call_module" and "embedding" in str(n.target)]
    assert leaves == [f"tower_arch.towers.{i}.embedding" for i in range(3)]
    features, weighted = _inputs(3, 2)
    eager_out, traced_out = model(features, weighted), traced(features, weighted)
    assert torch.equal(eager_out, traced_out)
    eager_out.sum().backward()
    traced_out.sum().backward()
    eager, got = _grads(model), _grads(traced)
    assert eager.keys() == got.keys() and len(eager) == len(list(model.parameters()))
    for name, grad in eager.items():
        assert torch.equal(grad, got[name]), name
