"""Position-weighted features feeding the weighted pooled lookup: outputs and gradients of the position weights
against EmbeddingBag with per_sample_weights, both processor forms, and input errors."""

from __future__ import annotations

import pytest
import torch
from embedding.tbe_testing import BACKENDS

from tritonrec.data import JaggedTensor, KeyedJaggedTensor
from tritonrec.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FeatureProcessedEmbeddingBagCollection,
    PoolingType,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)

MAX_LENGTHS = {"f0": 4, "f1": 3}


def _ebc(backend: str) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=5, name="t0", feature_names=["f0"]),
        EmbeddingBagConfig(
            num_embeddings=4, embedding_dim=3, name="t1", feature_names=["f1"], pooling=PoolingType.MEAN
        ),
    ]
    return EmbeddingBagCollection(tables, is_weighted=True, backend=backend)


def _kjt() -> KeyedJaggedTensor:
    lengths = torch.tensor([3, 0, 4, 1, 3, 2])
    values = torch.tensor([0, 1, 1, 5, 4, 3, 2, 3, 0, 1, 2, 1, 1])
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)


def test_position_weighted_module_weights_each_position():
    module = PositionWeightedModule(4)
    with torch.no_grad():
        module.position_weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    jt = module(JaggedTensor(values=torch.arange(6), lengths=torch.tensor([2, 0, 4])))
    assert torch.equal(jt.weights(), torch.tensor([1.0, 2.0, 1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(jt.values(), torch.arange(6))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["dict", "collection"])
def test_outputs_and_position_weight_gradients_match_embedding_bag(backend, form, tolerance):
    ebc = _ebc(backend)
    if form == "dict":
        processors = {name: PositionWeightedModule(length) for name, length in MAX_LENGTHS.items()}
    else:
        processors = PositionWeightedModuleCollection(MAX_LENGTHS)
    fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    position_weights = {n: p for n, p in fp_ebc.named_parameters() if "position" in n}
    with torch.no_grad():
        for p in position_weights.values():
            p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())) + 0.5)
    kjt = _kjt()
    grad = torch.randn(3, 8)
    out = fp_ebc(kjt).values()
    out.backward(grad)

    outs, refs = [], {}
    for feature, table, mode in (("f0", "t0", "sum"), ("f1", "t1", "mean")):
        weight = next(p for n, p in position_weights.items() if n.endswith(feature) or f".{feature}." in n)
        ref_weight = weight.detach().clone().requires_grad_()
        jt = kjt[feature]
        positions = torch.arange(jt.values().numel()) - torch.repeat_interleave(jt.offsets()[:-1], jt.lengths())
        pooled = torch.nn.functional.embedding_bag(
            jt.values(),
            ebc.embedding_bags[table].weight.detach(),
            jt.offsets()[:-1],
            mode="sum",
            per_sample_weights=ref_weight[positions],
        )
        outs.append(pooled / jt.lengths().clamp(min=1)[:, None] if mode == "mean" else pooled)
        refs[feature] = (weight, ref_weight)
    expected = torch.cat(outs, dim=1)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    expected.backward(grad)
    for weight, ref_weight in refs.values():
        torch.testing.assert_close(weight.grad, ref_weight.grad, **tolerance(torch.float32))


def test_bags_longer_than_max_length_and_unweighted_ebc_are_rejected():
    processors = PositionWeightedModuleCollection({"f0": 2, "f1": 3})
    with pytest.raises(ValueError, match="feature 'f0' has a bag of 4 values, more than its max_feature_length 2"):
        processors(_kjt())
    unweighted = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="t", feature_names=["f0"])]
    )
    with pytest.raises(ValueError, match="must be built with is_weighted=True"):
        FeatureProcessedEmbeddingBagCollection(unweighted, {"f0": PositionWeightedModule(3)})
    with pytest.raises(ValueError, match=r"feature_processors must cover exactly the EBC's features \['f0', 'f1'\]"):
        FeatureProcessedEmbeddingBagCollection(_ebc("torch"), {"f0": PositionWeightedModule(3)})
    with pytest.raises(ValueError, match=r"max_feature_lengths\['f0'\] must be a positive int, got .*=0"):
        PositionWeightedModuleCollection({"f0": 0})
    with pytest.raises(ValueError, match="max_feature_length must be a positive int, got max_feature_length=-1"):
        PositionWeightedModule(-1)


def test_processed_collection_with_a_processor_per_feature_names_the_feature():
    # a dict of processors: each sees a bare JaggedTensor, so a long bag was "feature '<jagged tensor>'", a missing
    # feature a bare KeyError and a non-KJT an AttributeError
    fp = FeatureProcessedEmbeddingBagCollection(
        _ebc("torch"), {"f0": PositionWeightedModule(2), "f1": PositionWeightedModule(3)}
    )
    with pytest.raises(ValueError, match="feature 'f0' has a bag of 4 values, more than its max_feature_length 2"):
        fp(_kjt())
    only_f0 = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([0, 1]), lengths=torch.tensor([1, 1, 0]))
    with pytest.raises(ValueError, match=r"features is missing keys \['f1'\] \(it has \['f0'\]\)"):
        fp(only_f0)
    with pytest.raises(TypeError, match="features must be a KeyedJaggedTensor, got Tensor"):
        fp(torch.ones(3))
