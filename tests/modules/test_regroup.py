"""KTRegroupAsDict against manual ``torch.cat`` of the right column slices, on the first call (which caches where the
blocks sit) and the later ones; key order, emb_dtype, gradients, key_dim 0, odd widths, bad input naming the argument,
a changed layout after the first call, plain fx tracing (one call_module node) and torch.compile equal to eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor, KeyedTensor
from tritonrec.modules import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KTRegroupAsDict

# input 0: f1 [0:4], f2 [4:5], f3 [5:7]; input 1: g0 [0:3], g1 [3:8]
WIDTHS = {"f1": 4, "f2": 1, "f3": 2, "g0": 3, "g1": 5}
GROUPS = [["f3", "g1"], ["f1", "f2", "g0"], ["g1", "f1"], ["f2"]]
KEYS = ["x", "y", "z", "w"]


def _inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[KeyedTensor]]:
    g = torch.Generator().manual_seed(seed)
    v0, v1 = torch.randn(batch, 7, generator=g), torch.randn(batch, 8, generator=g)
    kts = [KeyedTensor(["f1", "f2", "f3"], [4, 1, 2], v0), KeyedTensor(["g0", "g1"], [3, 5], v1)]
    return v0, v1, kts


def _expected(v0: torch.Tensor, v1: torch.Tensor) -> dict[str, torch.Tensor]:
    """The groups written out as column slices of the two value tensors."""
    return {
        "x": torch.cat([v0[:, 5:7], v1[:, 3:8]], dim=1),
        "y": torch.cat([v0[:, 0:4], v0[:, 4:5], v1[:, 0:3]], dim=1),
        "z": torch.cat([v1[:, 3:8], v0[:, 0:4]], dim=1),
        "w": v0[:, 4:5],
    }


@pytest.mark.parametrize("batch", [3, 1])
def test_regroup_is_the_slices_concatenated_on_every_call(batch: int) -> None:
    module = KTRegroupAsDict(GROUPS, KEYS)
    for seed in range(3):  # the first call fills the cache, the later ones read it
        v0, v1, kts = _inputs(batch, seed)
        out = module(kts)
        assert list(out) == KEYS
        for key, expected in _expected(v0, v1).items():
            assert torch.equal(out[key], expected), (seed, key)
    assert module.state_dict() == {}  # torchrec's permute buffers are non-persistent: no keys there either


def test_output_order_follows_keys_not_groups() -> None:
    v0, v1, kts = _inputs(2)
    out = KTRegroupAsDict([["g0"], ["f1"]], ["b", "a"])(kts)
    assert list(out) == ["b", "a"]
    assert torch.equal(out["b"], v1[:, :3]) and torch.equal(out["a"], v0[:, :4])


def test_emb_dtype_casts_the_outputs() -> None:
    module = KTRegroupAsDict(GROUPS, KEYS, emb_dtype=DataType.FP16)
    for _ in range(2):
        v0, v1, kts = _inputs(2)
        out = module(kts)
        for key, expected in _expected(v0, v1).items():
            assert out[key].dtype == torch.float16
            assert torch.equal(out[key], expected.half())


def test_gradients_reach_each_column_once_per_use() -> None:
    module = KTRegroupAsDict(GROUPS, KEYS)
    for _ in range(2):
        v0, v1, _ = _inputs(2)
        v0.requires_grad_(), v1.requires_grad_()
        kts = [KeyedTensor(["f1", "f2", "f3"], [4, 1, 2], v0), KeyedTensor(["g0", "g1"], [3, 5], v1)]
        sum(t.sum() for t in module(kts).values()).backward()
        uses = {key: sum(group.count(key) for group in GROUPS) for key in WIDTHS}
        assert torch.equal(v0.grad[0], torch.tensor([uses["f1"]] * 4 + [uses["f2"]] + [uses["f3"]] * 2).float())
        assert torch.equal(v1.grad[0], torch.tensor([uses["g0"]] * 3 + [uses["g1"]] * 5).float())


def test_key_dim_zero_concatenates_rows() -> None:
    values = torch.randn(6, 2)
    module = KTRegroupAsDict([["c", "a"], ["b"]], ["x", "y"])
    for _ in range(2):
        out = module([KeyedTensor(["a", "b", "c"], [1, 2, 3], values, key_dim=0)])
        assert torch.equal(out["x"], torch.cat([values[3:6], values[0:1]]))
        assert torch.equal(out["y"], values[1:3])


def test_a_changed_layout_is_refused_until_the_cache_is_cleared() -> None:
    module = KTRegroupAsDict([["f1"], ["f3"]], ["x", "y"])
    module([KeyedTensor(["f1", "f3"], [1, 1], torch.tensor([[0.0, 2.0]]))])
    reordered = [KeyedTensor(["f3", "f1"], [1, 1], torch.tensor([[2.0, 0.0]]))]
    # torchrec 1.8 reuses its cached positions here and returns {"x": [[2.]], "y": [[0.]]}
    with pytest.raises(ValueError, match=r"keyed_tensors are laid out as .*'f3', 'f1'.*clear_cache\(\)"):
        module(reordered)
    with pytest.raises(ValueError, match="keyed_tensors are laid out as"):  # other widths
        module([KeyedTensor(["f1", "f3"], [2, 1], torch.zeros(1, 3))])
    module.clear_cache()
    out = module(reordered)
    assert out["x"].tolist() == [[0.0]] and out["y"].tolist() == [[2.0]]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"keys must name each of the 2 groups once, got keys=\['a'\]"):
        KTRegroupAsDict([["f1"], ["f2"]], ["a"])
    with pytest.raises(ValueError, match="keys must name each"):
        KTRegroupAsDict([["f1"], ["f2"]], ["a", "a"])
    with pytest.raises(ValueError, match=r"groups\[1\] is empty"):
        KTRegroupAsDict([["f1"], []], ["a", "b"])
    with pytest.raises(TypeError, match=r"groups\[0\] must be a list of str"):
        KTRegroupAsDict([["f1", 2]], ["a"])
    with pytest.raises(TypeError, match="groups must be a list"):
        KTRegroupAsDict("f1", ["a"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="emb_dtype"):
        KTRegroupAsDict([["f1"]], ["a"], emb_dtype=torch.float16)  # type: ignore[arg-type]
    module = KTRegroupAsDict([["f1", "zz"]], ["a"])
    _, _, kts = _inputs(2)
    with pytest.raises(ValueError, match="keyed_tensors must be a non-empty list"):
        module([])
    with pytest.raises(TypeError, match=r"keyed_tensors\[1\] must be a KeyedTensor, got Tensor"):
        module([kts[0], torch.zeros(2, 2)])
    with pytest.raises(KeyError, match=r"groups\[0\] names key 'zz'"):
        module(kts)
    with pytest.raises(ValueError, match=r"key 'f1' is held by keyed_tensors\[0\] and keyed_tensors\[1\]"):
        KTRegroupAsDict([["f1"]], ["a"])([kts[0], KeyedTensor(["f1"], [1], torch.zeros(2, 1))])
    with pytest.raises(ValueError, match="mixes batch sizes"):
        KTRegroupAsDict([["f1", "g0"]], ["a"])([kts[0], KeyedTensor(["g0"], [1], torch.zeros(3, 1))])
    with pytest.raises(ValueError, match="keyed_tensors must be on one device"):
        KTRegroupAsDict([["f1"]], ["a"])([kts[0], KeyedTensor(["g0"], [1], torch.zeros(2, 1, device="meta"))])


class _TwoCollections(nn.Module):
    """Two EBCs' pooled outputs regrouped into a user and an item block, each through a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        make = lambda name, feature, dim: EmbeddingBagConfig(
            num_embeddings=9, embedding_dim=dim, name=name, feature_names=[feature]
        )
        self.user = EmbeddingBagCollection([make("u0", "a", 2), make("u1", "b", 3)], backend="torch")
        self.item = EmbeddingBagCollection([make("i0", "c", 1)], backend="torch")
        self.regroup = KTRegroupAsDict([["c", "a"], ["b"]], ["item", "user"])
        self.head = nn.Linear(6, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        grouped = self.regroup([self.user(features), self.item(features)])
        return self.head(torch.cat([grouped["item"], grouped["user"]], dim=1))


def _kjt(batch: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (3 * batch,), generator=g)
    return KeyedJaggedTensor(["a", "b", "c"], torch.randint(0, 9, (int(lengths.sum()),), generator=g), lengths=lengths)


def test_traced_model_matches_eager() -> None:
    torch.manual_seed(0)
    model = _TwoCollections()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    calls = [str(n.target) for n in traced.graph.nodes if n.op == "call_module"]
    assert calls == ["user", "item", "regroup", "head"]
    for seed in range(2):  # the traced graph's regroup fills its cache on its first call, like the eager one
        features = _kjt(3, seed)
        assert torch.equal(traced(features), model(features))
    assert traced.regroup._is_inited


def test_compiled_regroup_matches_eager() -> None:
    module = KTRegroupAsDict(GROUPS, KEYS)

    def regroup(v0: torch.Tensor, v1: torch.Tensor) -> dict[str, torch.Tensor]:
        return module([KeyedTensor(["f1", "f2", "f3"], [4, 1, 2], v0), KeyedTensor(["g0", "g1"], [3, 5], v1)])

    compiled = torch.compile(regroup, backend="aot_eager", fullgraph=True)
    for seed in range(2):  # the first compiled call also fills the cache
        v0, v1, _ = _inputs(2, seed)
        out = compiled(v0, v1)
        for key, expected in _expected(v0, v1).items():
            assert torch.equal(out[key], expected), (seed, key)
