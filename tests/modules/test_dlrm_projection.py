"""InteractionProjectionArch and DLRM_Projection: the projected interaction written out per sample (``Y [F1, D]``
times ``Z [D, F2]`` read from the branch outputs), torchrec's state-dict keys, gradients, odd shapes, bad input, and
plain fx tracing (the embedding collection one call_module leaf) equal to eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import DLRM_Projection, EmbeddingBagCollection, EmbeddingBagConfig, InteractionProjectionArch


def _projection_reference(dense: torch.Tensor, sparse: torch.Tensor, branch1: nn.Module, branch2: nn.Module):
    """Per sample: ``c`` = the ``F + 1`` vectors flattened, ``Y[i, d] = branch1(c)[i * D + d]``, ``Z[d, j] =
    branch2(c)[d * F2 + j]``, output ``[dense, (sum_d Y[i, d] Z[d, j]) for i, j]``."""
    d = dense.shape[1]
    rows = []
    for b in range(dense.shape[0]):
        c = torch.cat([dense[b], sparse[b].flatten()]).unsqueeze(0)
        y, z = branch1(c)[0], branch2(c)[0]
        f1, f2 = y.numel() // d, z.numel() // d
        products = [sum(y[i * d + k] * z[k * f2 + j] for k in range(d)) for i in range(f1) for j in range(f2)]
        rows.append(torch.cat([dense[b], torch.stack(products)]))
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("batch", "num_sparse", "dim", "f1", "f2"), [(4, 3, 2, 3, 2), (1, 1, 1, 1, 1), (2, 2, 3, 1, 4)]
)
def test_interaction_is_the_product_of_the_projections(batch: int, num_sparse: int, dim: int, f1: int, f2: int):
    torch.manual_seed(0)
    width = (num_sparse + 1) * dim
    branch1 = nn.Sequential(nn.Linear(width, 5), nn.ReLU(), nn.Linear(5, f1 * dim)).double()
    branch2 = nn.Linear(width, f2 * dim).double()
    arch = InteractionProjectionArch(num_sparse, branch1, branch2)
    dense = torch.randn(batch, dim, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(batch, num_sparse, dim, dtype=torch.float64, requires_grad=True)
    out = arch(dense, sparse)
    assert out.shape == (batch, dim + f1 * f2)
    torch.testing.assert_close(out, _projection_reference(dense, sparse, branch1, branch2), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(arch, (dense, sparse), fast_mode=True)
    out.sum().backward()
    assert all(p.grad is not None for p in arch.parameters()) and sparse.grad.abs().sum() > 0


def test_interaction_bad_input_is_named() -> None:
    arch = InteractionProjectionArch(2, nn.Linear(9, 6), nn.Linear(9, 3))
    dense, sparse = torch.randn(4, 3), torch.randn(4, 2, 3)
    assert arch(dense, sparse).shape == (4, 3 + 2 * 1)
    with pytest.raises(ValueError, match=r"sparse_features must have shape \[B=4, F=2, D=3\].*got \(4, 3, 3\)"):
        arch(dense, torch.randn(4, 3, 3))
    with pytest.raises(ValueError, match=r"sparse_features must have shape \[B=4, F=2, D=3\].*got \(5, 2, 3\)"):
        arch(dense, torch.randn(5, 2, 3))
    with pytest.raises(ValueError, match=r"dense_features must have shape \[B, D\], got \(4, 3, 1\)"):
        arch(dense.unsqueeze(2), sparse)
    bad_branch = InteractionProjectionArch(2, nn.Linear(9, 5), nn.Linear(9, 3))
    with pytest.raises(ValueError, match=r"interaction_branch1 must return \[B=4, a multiple of D=3\], got \(4, 5\)"):
        bad_branch(dense, sparse)
    with pytest.raises(TypeError, match="interaction_branch2"):
        InteractionProjectionArch(2, nn.Linear(9, 6), "mlp")  # type: ignore[arg-type]
    assert torch.equal(InteractionProjectionArch(0, nn.Linear(3, 3), nn.Linear(3, 3))(dense, sparse[:, :0]), dense)


D = 4
KEYS = ["f0", "f1", "f2"]


def _collection(dim: int = D) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=11, embedding_dim=dim, name="t0", feature_names=["f0", "f2"]),
        EmbeddingBagConfig(num_embeddings=13, embedding_dim=dim, name="t1", feature_names=["f1"]),
    ]
    return EmbeddingBagCollection(tables, backend="torch")


def _kjt(batch: int, seed: int = 0) -> KeyedJaggedTensor:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(KEYS) * batch,), generator=generator)
    values = torch.randint(0, 11, (int(lengths.sum()),), generator=generator)
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)


def _model(**overrides) -> DLRM_Projection:
    kwargs = {
        "embedding_bag_collection": _collection(),
        "dense_in_features": 5,
        "dense_arch_layer_sizes": [6, D],
        "over_arch_layer_sizes": [3, 1],
        "interaction_branch1_layer_sizes": [7, 3 * D],
        "interaction_branch2_layer_sizes": [2 * D],
    }
    return DLRM_Projection(**{**kwargs, **overrides})


@pytest.mark.parametrize("batch", [3, 1])
def test_dlrm_projection_is_its_parts_written_out(batch: int) -> None:
    torch.manual_seed(1)
    model = _model()
    dense, features = torch.randn(batch, 5), _kjt(batch)
    out = model(dense, features)
    state = model.state_dict()
    table_of = {"f0": "t0", "f1": "t1", "f2": "t0"}
    lengths, values, start = features.lengths().tolist(), features.values().tolist(), 0
    pooled = torch.zeros(batch, len(KEYS), D)
    for k, key in enumerate(KEYS):  # per-bag sums of the table rows, in KJT order (key-major)
        weight = state[f"sparse_arch.embedding_bag_collection.embedding_bags.{table_of[key]}.weight"]
        for b in range(batch):
            for i in values[start : start + lengths[k * batch + b]]:
                pooled[b, k] += weight[i]
            start += lengths[k * batch + b]
    sparse = pooled[:, [0, 2, 1]]  # the tables' feature order: t0's f0, f2, then t1's f1
    embedded = model.dense_arch(dense)
    inter = _projection_reference(embedded, sparse, model.inter_arch.interaction_branch1,
                                  model.inter_arch.interaction_branch2)  # fmt: skip
    assert inter.shape == (batch, D + 3 * 2)
    torch.testing.assert_close(out, model.over_arch(inter))
    prefixes = {name.rsplit(".", 3)[0] for name in state if "interaction_branch" in name}
    assert prefixes == {"inter_arch.interaction_branch1.model._mlp", "inter_arch.interaction_branch2.model._mlp"}
    assert state["inter_arch.interaction_branch1.model._mlp.0._linear.weight"].shape == (7, 4 * D)
    assert state["over_arch.model.0._mlp.0._linear.weight"].shape == (3, D + 3 * 2)


def test_dlrm_projection_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"interaction_branch1_layer_sizes must end with a multiple of .* 4"):
        _model(interaction_branch1_layer_sizes=[7, 6])
    with pytest.raises(ValueError, match="interaction_branch2_layer_sizes must list"):
        _model(interaction_branch2_layer_sizes=[])
    with pytest.raises(ValueError, match=r"interaction_branch2_layer_sizes\[0\]"):
        _model(interaction_branch2_layer_sizes=[0, 8])
    with pytest.raises(ValueError, match="dense_arch_layer_sizes must end with the embedding dim"):
        _model(dense_arch_layer_sizes=[6, 3])
    with pytest.raises(ValueError, match=r"dense_features must have shape \[B, dense_in_features=5\]"):
        _model()(torch.randn(3, 4), _kjt(3))


def test_traced_dlrm_projection_matches_eager() -> None:
    torch.manual_seed(2)
    model = _model()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    leaves = [str(n.target) for n in traced.graph.nodes if n.op == "call_module" and "embedding" in str(n.target)]
    assert leaves == ["sparse_arch.embedding_bag_collection"]
    dense, features = torch.randn(3, 5), _kjt(3, seed=1)
    eager_out, traced_out = model(dense, features), traced(dense, features)
    assert torch.equal(eager_out, traced_out)
    eager_out.square().sum().backward()
    traced_out.square().sum().backward()
    eager = {n: p.grad.to_dense() for n, p in model.named_parameters() if p.grad is not None}
    got = {n: p.grad.to_dense() for n, p in traced.named_parameters() if p.grad is not None}
    assert eager.keys() == got.keys() and len(eager) == len(list(model.parameters()))
    for name, grad in eager.items():
        assert torch.equal(grad, got[name]), name
