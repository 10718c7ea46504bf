"""Plain ``torch.fx.symbolic_trace`` of models holding the embedding collections (as torchrec's trace): each
collection is one ``call_module`` node, the DLRM interaction one ``call_function`` (its one-bmm backward kept), and
the traced ``GraphModule`` computes the eager model's outputs, gradients and fused updates bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batch import Batch
from tritonrec.modules import (
    DLRM,
    DLRM_DCN,
    DataType,
    DLRMTrain,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    FusedEmbeddingBagCollection,
    OptimType,
    PositionWeightedModuleCollection,
    QuantEmbeddingBagCollection,
)

KEYS = ["f0", "f1"]


def _bag_tables(dim: int = 4) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=7, embedding_dim=dim, name="t0", feature_names=["f0"]),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=dim, name="t1", feature_names=["f1"]),
    ]


def _kjt(weighted: bool = False) -> KeyedJaggedTensor:
    lengths = torch.tensor([2, 0, 3, 1, 2, 1])
    values = torch.tensor([0, 6, 1, 2, 3, 4, 0, 4, 1])
    weights = torch.linspace(0.5, 1.5, values.numel()) if weighted else None
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, weights=weights)


class _Head(nn.Module):
    """A collection followed by dense ops on its output, as a model would use it."""

    def __init__(self, collection: nn.Module, sequence: bool = False) -> None:
        super().__init__()
        self.collection = collection
        self.sequence = sequence

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        out = self.collection(features)
        if self.sequence:
            return out["f0"].values().sum(1) * 2.0
        return out.values().float().sum(1) * 2.0


def _leaf_targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module" and "collection" in str(n.target)]


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["ebc", "weighted_ebc", "ec", "fp_ebc", "quant_ebc"])
def test_traced_collection_is_one_call_module_and_matches_eager(kind):
    weighted = kind in ("weighted_ebc", "fp_ebc")
    if kind == "ec":
        tables = [EmbeddingConfig(num_embeddings=7, embedding_dim=3, name=f"t{i}", feature_names=[k])
                  for i, k in enumerate(KEYS)]  # fmt: skip
        collection: nn.Module = EmbeddingCollection(tables, backend="torch")
    elif kind == "fp_ebc":
        ebc = EmbeddingBagCollection(_bag_tables(), is_weighted=True, backend="torch")
        collection = FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection({"f0": 3, "f1": 3}))
    elif kind == "quant_ebc":
        ebc = EmbeddingBagCollection(_bag_tables(), backend="torch")
        collection = QuantEmbeddingBagCollection.from_float(ebc, DataType.INT8)
    else:
        collection = EmbeddingBagCollection(_bag_tables(), is_weighted=weighted, backend="torch")
    model = _Head(collection, sequence=kind == "ec")
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    assert _leaf_targets(traced) == ["collection"]
    features = _kjt(weighted and kind != "fp_ebc")
    eager_out, traced_out = model(features), traced(features)
    assert torch.equal(eager_out, traced_out)
    if kind != "quant_ebc":  # the quant tables hold no parameters
        eager_out.sum().backward()
        traced_out.sum().backward()
        eager, got = _grads(model), _grads(traced)
        assert eager.keys() == got.keys() and eager
        for name, grad in eager.items():
            assert torch.equal(grad.to_dense(), got[name].to_dense()), name


def test_traced_fused_collection_applies_the_same_update():
    model = _Head(FusedEmbeddingBagCollection(_bag_tables(), OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1},
                                              backend="torch"))  # fmt: skip
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    for step in range(3):
        features = _kjt()
        model(features).pow(step + 1).sum().backward()
        traced(features).pow(step + 1).sum().backward()
    assert torch.equal(
        model.collection.state_dict()["embedding_bags.t0.weight"],
        traced.collection.state_dict()["embedding_bags.t0.weight"],
    )
    before = FusedEmbeddingBagCollection(_bag_tables(), OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="torch")
    assert not torch.equal(
        before.state_dict()["embedding_bags.t0.weight"], model.collection.state_dict()["embedding_bags.t0.weight"]
    )


@pytest.mark.parametrize("arch", [DLRM, DLRM_DCN])
def test_traced_dlrm_matches_eager_forward_and_backward(arch):
    torch.manual_seed(0)
    kwargs = {"dcn_num_layers": 2, "dcn_low_rank_dim": 2} if arch is DLRM_DCN else {}
    model = arch(EmbeddingBagCollection(_bag_tables(), backend="torch"), 3, [8, 4], [8, 1], **kwargs)
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    assert [str(n.target) for n in traced.graph.nodes if n.op == "call_module" and "embedding" in str(n.target)] == [
        "sparse_arch.embedding_bag_collection"
    ]
    if arch is DLRM:  # the interaction stays one function, so autograd runs its one-bmm backward
        assert any(n.op == "call_function" and "pairwise_dots" in str(n.target) for n in traced.graph.nodes)
    dense = torch.randn(3, 3)
    eager_out, traced_out = model(dense, _kjt()), traced(dense, _kjt())
    assert torch.equal(eager_out, traced_out)
    eager_out.square().sum().backward()
    traced_out.square().sum().backward()
    eager, got = _grads(model), _grads(traced)
    assert eager.keys() == got.keys()
    for name, grad in eager.items():
        assert torch.equal(grad.to_dense(), got[name].to_dense()), name


def test_traced_dlrm_train_takes_a_batch():
    torch.manual_seed(1)
    model = DLRMTrain(DLRM(EmbeddingBagCollection(_bag_tables(), backend="torch"), 3, [8, 4], [8, 1]))
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    batch = Batch(torch.randn(3, 3), _kjt(), torch.tensor([0.0, 1.0, 1.0]), torch.tensor([True, True, False]))
    (loss, (_, logits, labels)), (traced_loss, (_, traced_logits, traced_labels)) = model(batch), traced(batch)
    assert torch.equal(loss, traced_loss) and torch.equal(logits, traced_logits) and torch.equal(labels, traced_labels)


def test_a_collection_as_the_traced_root_is_refused_clearly():
    with pytest.raises(TypeError, match="root module"):
        torch.fx.symbolic_trace(EmbeddingBagCollection(_bag_tables(), backend="torch"))


def test_a_standalone_position_weighted_module_traces_as_one_call_module():
    """torchrec's PositionWeightedModuleCollection traces under plain fx in front of a weighted EBC (ours checked
    its input's type against the proxy and raised); the single-feature module does too."""
    from tritonrec.data import JaggedTensor
    from tritonrec.modules import PositionWeightedModule

    class WeightedHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pw = PositionWeightedModuleCollection({"f0": 3, "f1": 3})
            self.one = PositionWeightedModule(3)
            self.ebc = EmbeddingBagCollection(_bag_tables(), is_weighted=True, backend="torch")

        def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
            weights = self.one(features["f0"]).weights()
            return self.ebc(self.pw(features)).values().sum(1) + weights.sum()

    torch.manual_seed(2)
    model = WeightedHead()
    with torch.no_grad():
        model.pw.position_weights["f0"].copy_(torch.tensor([0.5, 2.0, 3.0]))
        model.one.position_weight.copy_(torch.tensor([1.5, 0.25, 4.0]))
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    modules = [str(n.target) for n in traced.graph.nodes if n.op == "call_module"]
    assert modules == ["one", "pw", "ebc"]
    eager_out, traced_out = model(_kjt()), traced(_kjt())
    assert torch.equal(eager_out, traced_out)
    eager_out.sum().backward()
    traced_out.sum().backward()
    for name, grad in _grads(model).items():
        assert torch.equal(grad.to_dense(), _grads(traced)[name].to_dense()), name
    assert isinstance(traced.one(JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([2]))), JaggedTensor)
