"""DeepFM, FactorizationMachine, FMInteractionArch and SimpleDeepFMNN against the formulas written out (explicit pair
loops, per-bag embedding sums, matmuls), torchrec's state-dict keys, gradients, odd shapes, bad input, and plain fx
tracing (the embedding collection one call_module leaf) equal to eager."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.modules import (
    DeepFM,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FactorizationMachine,
    FMInteractionArch,
    SimpleDeepFMNN,
)


def _pairwise_sum(flat: torch.Tensor) -> torch.Tensor:
    """``[B, M]`` -> ``[B, 1]``: ``sum_{i<j} x_i x_j`` by an explicit loop over the pairs."""
    m = flat.shape[1]
    total = torch.zeros(flat.shape[0], dtype=torch.float64)
    for i, j in itertools.combinations(range(m), 2):
        total += flat[:, i].double() * flat[:, j].double()
    return total.unsqueeze(1)


@pytest.mark.parametrize(
    "shapes", [[(4, 2, 3), (4, 5), (4, 1, 2)], [(1, 1, 1)], [(1, 1)], [(3, 1, 1), (3, 1)], [(2, 3, 2, 2)]]
)
def test_factorization_machine_is_the_sum_over_pairs(shapes: list[tuple[int, ...]]) -> None:
    torch.manual_seed(0)
    embeddings = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    out = FactorizationMachine()(embeddings)
    flat = torch.cat([e.reshape(e.shape[0], -1) for e in embeddings], dim=1)
    assert out.shape == (shapes[0][0], 1)
    torch.testing.assert_close(out, _pairwise_sum(flat), rtol=1e-12, atol=1e-12)


def test_factorization_machine_gradient() -> None:
    embeddings = [torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True), torch.randn(3, 3, dtype=torch.float64)]
    embeddings[1].requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: FactorizationMachine()([a, b]), tuple(embeddings))
    # d/dx_i sum_{i<j} x_i x_j = sum_{j != i} x_j
    FactorizationMachine()(embeddings).sum().backward()
    flat = torch.cat([embeddings[0].detach().flatten(1), embeddings[1].detach()], dim=1)
    grads = torch.cat([embeddings[0].grad.flatten(1), embeddings[1].grad], dim=1)
    torch.testing.assert_close(grads, flat.sum(1, keepdim=True) - flat)


def test_deep_fm_feeds_the_flattened_embeddings_to_its_module() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(2 * 3 + 4, 5)
    deep_fm = DeepFM(dense_module=linear)
    a, b = torch.randn(6, 2, 3, requires_grad=True), torch.randn(6, 4)
    out = deep_fm([a, b])
    # row-major flattening: a[:, 0, :], a[:, 1, :], then b
    flat = torch.cat([a[:, 0], a[:, 1], b], dim=1)
    torch.testing.assert_close(out, flat @ linear.weight.T + linear.bias)
    out.sum().backward()
    assert a.grad is not None and linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0
    assert set(deep_fm.state_dict()) == {"dense_module.weight", "dense_module.bias"}


@pytest.mark.parametrize("module", [FactorizationMachine(), DeepFM(nn.Linear(6, 2))])
def test_bad_embedding_lists_are_named(module: nn.Module) -> None:
    with pytest.raises(ValueError, match="embeddings must be a non-empty list"):
        module([])
    with pytest.raises(ValueError, match=r"embeddings\[1\] has shape \(2, 3\)"):
        module([torch.randn(3, 3), torch.randn(2, 3)])
    with pytest.raises(ValueError, match=r"embeddings\[0\] must have shape \[B, \.\.\.\] with at least 2 dims"):
        module([torch.randn(3)])
    with pytest.raises(TypeError, match=r"embeddings\[1\] must be a floating-point tensor"):
        module([torch.randn(3, 3), torch.ones(3, 3, dtype=torch.int64)])
    with pytest.raises(TypeError, match="dense_module"):
        DeepFM(dense_module=lambda x: x)  # type: ignore[arg-type]


def test_fm_interaction_arch_reads_the_named_blocks_in_order() -> None:
    torch.manual_seed(2)
    d, keys = 3, ["a", "b", "c"]
    arch = FMInteractionArch(fm_in_features=3 * d, sparse_feature_names=["c", "a"], deep_fm_dimension=4)
    dense = torch.randn(5, d)
    sparse = KeyedTensor(keys=keys, length_per_key=[d, d, d], values=torch.randn(5, 3 * d))
    out = arch(dense, sparse)
    flat = torch.cat([dense, sparse.values()[:, 2 * d :], sparse.values()[:, :d]], dim=1)
    linear = arch.deep_fm.dense_module[0]
    deep = torch.relu(flat @ linear.weight.T + linear.bias)
    torch.testing.assert_close(out, torch.cat([dense, deep, _pairwise_sum(flat).float()], dim=1))
    assert set(arch.state_dict()) == {"deep_fm.dense_module.0.weight", "deep_fm.dense_module.0.bias"}
    assert torch.equal(FMInteractionArch(3, [], 4)(dense, sparse), dense)
    with pytest.raises(ValueError, match="fm_in_features=10"):
        FMInteractionArch(fm_in_features=10, sparse_feature_names=["c", "a"], deep_fm_dimension=4)(dense, sparse)
    with pytest.raises(ValueError, match="deep_fm_dimension"):
        FMInteractionArch(fm_in_features=9, sparse_feature_names=["a"], deep_fm_dimension=0)
    with pytest.raises(TypeError, match="sparse_feature_names"):
        FMInteractionArch(fm_in_features=9, sparse_feature_names="ab", deep_fm_dimension=2)


D = 4
KEYS = ["f0", "f1", "f2"]


def _collection(dims: tuple[int, int] = (D, D)) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=11, embedding_dim=dims[0], name="t0", feature_names=["f0", "f2"]),
        EmbeddingBagConfig(num_embeddings=13, embedding_dim=dims[1], name="t1", feature_names=["f1"]),
    ]
    return EmbeddingBagCollection(tables, backend="torch")


def _kjt(batch: int = 3, seed: int = 0) -> KeyedJaggedTensor:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(KEYS) * batch,), generator=generator)
    values = torch.randint(0, 11, (int(lengths.sum()),), generator=generator)
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)


def _pooled(model: SimpleDeepFMNN, features: KeyedJaggedTensor, batch: int) -> dict[str, torch.Tensor]:
    """Per-bag sums of the table rows: ``{feature: [B, D]}``."""
    state = model.state_dict()
    table_of = {"f0": "t0", "f2": "t0", "f1": "t1"}
    lengths, values = features.lengths().tolist(), features.values().tolist()
    out, start = {}, 0
    for k, key in enumerate(KEYS):
        weight = state[f"sparse_arch.embedding_bag_collection.embedding_bags.{table_of[key]}.weight"]
        rows = []
        for b in range(batch):
            n = lengths[k * batch + b]
            rows.append(sum((weight[i] for i in values[start : start + n]), torch.zeros(D)))
            start += n
        out[key] = torch.stack(rows)
    return out


@pytest.mark.parametrize("batch", [3, 1])
def test_simple_deepfm_is_its_parts_written_out(batch: int) -> None:
    torch.manual_seed(3)
    model = SimpleDeepFMNN(num_dense_features=5, embedding_bag_collection=_collection(), hidden_layer_size=7,
                           deep_fm_dimension=2)  # fmt: skip
    dense, features = torch.randn(batch, 5), _kjt(batch)
    out = model(dense, features)
    s = model.state_dict()
    embedded = torch.relu(torch.relu(dense @ s["dense_arch.model.0.weight"].T + s["dense_arch.model.0.bias"])
                          @ s["dense_arch.model.2.weight"].T + s["dense_arch.model.2.bias"])  # fmt: skip
    pooled = _pooled(model, features, batch)
    flat = torch.cat([embedded, pooled["f0"], pooled["f2"], pooled["f1"]], dim=1)  # tables' feature order
    deep = torch.relu(
        flat @ s["inter_arch.deep_fm.dense_module.0.weight"].T + s["inter_arch.deep_fm.dense_module.0.bias"]
    )
    over_in = torch.cat([embedded, deep, _pairwise_sum(flat).float()], dim=1)
    expected = torch.sigmoid(over_in @ s["over_arch.model.0.weight"].T + s["over_arch.model.0.bias"])
    assert out.shape == (batch, 1)
    torch.testing.assert_close(out, expected)
    assert set(s) == {  # torchrec's SimpleDeepFMNN keys
        "sparse_arch.embedding_bag_collection.embedding_bags.t0.weight",
        "sparse_arch.embedding_bag_collection.embedding_bags.t1.weight",
        "dense_arch.model.0.weight", "dense_arch.model.0.bias", "dense_arch.model.2.weight", "dense_arch.model.2.bias",
        "inter_arch.deep_fm.dense_module.0.weight", "inter_arch.deep_fm.dense_module.0.bias",
        "over_arch.model.0.weight", "over_arch.model.0.bias",
    }  # fmt: skip


def test_simple_deepfm_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="one embedding_dim for all tables"):
        SimpleDeepFMNN(5, _collection((D, D + 1)), 7, 2)
    with pytest.raises(ValueError, match="hidden_layer_size"):
        SimpleDeepFMNN(5, _collection(), 0, 2)
    with pytest.raises(ValueError, match="num_dense_features"):
        SimpleDeepFMNN(-1, _collection(), 7, 2)
    with pytest.raises(ValueError, match="embedding_bag_collection"):
        SimpleDeepFMNN(5, nn.Linear(2, 2), 7, 2)
    model = SimpleDeepFMNN(5, _collection(), 7, 2)
    with pytest.raises(
        ValueError, match=r"dense_features must have shape \[B=3 .*num_dense_features=5\], got \(3, 4\)"
    ):
        model(torch.randn(3, 4), _kjt(3))
    with pytest.raises(ValueError, match=r"dense_features must have shape \[B=3 .*got \(2, 5\)"):
        model(torch.randn(2, 5), _kjt(3))


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_dense() for n, p in module.named_parameters() if p.grad is not None}


def test_traced_simple_deepfm_matches_eager() -> None:
    torch.manual_seed(4)
    model = SimpleDeepFMNN(5, _collection(), 7, 2)
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    leaves = [str(n.target) for n in traced.graph.nodes if n.op == "call_module" and "embedding" in str(n.target)]
    assert leaves == ["sparse_arch.embedding_bag_collection"]
    dense, features = torch.randn(3, 5), _kjt(3, seed=1)
    eager_out, traced_out = model(dense, features), traced(dense, features)
    assert torch.equal(eager_out, traced_out)
    eager_out.square().sum().backward()
    traced_out.square().sum().backward()
    eager, got = _grads(model), _grads(traced)
    assert eager.keys() == got.keys() and len(eager) == len(list(model.parameters()))
    for name, grad in eager.items():
        assert torch.equal(grad, got[name]), name


class _FMHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.deep = DeepFM(nn.Linear(2 * 3 + 2, 1))
        self.fm = FactorizationMachine()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.deep([a, b]) + self.fm([a, b])


def test_traced_fm_modules_match_eager_and_still_check_inputs() -> None:
    torch.manual_seed(5)
    model = _FMHead()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    assert any(n.op == "call_function" and "flatten_embeddings" in str(n.target) for n in traced.graph.nodes)
    a, b = torch.randn(4, 2, 3), torch.randn(4, 2)
    assert torch.equal(model(a, b), traced(a, b))
    with pytest.raises(ValueError, match=r"embeddings\[1\] has shape \(3, 2\)"):
        traced(a, torch.randn(3, 2))
