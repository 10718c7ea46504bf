"""DLRM parts against their formulas, torchrec's state-dict names, the masked loss, fused updates, and bad input.

Models use ``backend="torch"`` (the embedding ops' torch twins) except one test that runs the Triton kernels, under
the interpreter on CPU, at a tiny size.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tritonrec.data.batcher import Batcher
from tritonrec.data.elements import ElementSpec, RecElement
from tritonrec.dist.awaitable import LazyAwaitable
from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from tritonrec.modules.dlrm import DLRM, DLRM_DCN, DLRMTrain
from tritonrec.modules.dlrm_archs import InteractionArch, LowRankCrossNet, OverArch

D = 4
SPEC = ElementSpec(dense_dim=3, sparse_keys=("f0", "f1", "f2"))


def _collection(dims: tuple[int, ...] = (D, D, D), backend: str = "torch") -> FusedEmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"])
        for i, dim in enumerate(dims)
    ]
    return FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend=backend)


def _elements(n: int, seed: int = 0) -> list[RecElement]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = rng.integers(0, 3, 3)
        ids = rng.integers(0, 20, int(lengths.sum()))
        out.append(RecElement(rng.standard_normal(3, dtype=np.float32), ids, lengths, float(rng.integers(0, 2))))
    return out


def test_interaction_arch_is_the_pairwise_dot_products() -> None:
    dense, sparse = torch.randn(5, D), torch.randn(5, 3, D)
    out = InteractionArch(3)(dense, sparse)
    vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
    pairs = [(vectors[:, i] * vectors[:, j]).sum(-1) for i, j in itertools.combinations(range(4), 2)]
    torch.testing.assert_close(out, torch.cat([dense, torch.stack(pairs, 1)], dim=1))
    assert torch.equal(InteractionArch(0)(dense, sparse[:, :0]), dense)


def test_interaction_indices_live_with_the_dense_layers_but_never_on_meta() -> None:
    """The pair indices are built on the dense device (index_select on CUDA needs them there). On ``meta`` they stay
    on the CPU: a meta-built model is materialised with zero-filled buffers, which would pair vector 0 with itself."""
    expected = torch.triu_indices(4, 4, offset=1)
    for device in ("cpu", "meta", None):
        arch = InteractionArch(3, device)
        assert arch.triu_indices.device.type == "cpu" and torch.equal(arch.triu_indices, expected), device
        assert torch.equal(arch._pair_positions, expected[0] * 4 + expected[1])
    ebc = FusedEmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=10, embedding_dim=D, name="t0", feature_names=["f0"])],
        "EXACT_SGD", {"lr": 0.1}, device="meta",
    )  # fmt: skip
    model = DLRM(ebc, 3, [D], [4, 1], dense_device="meta")
    assert model.inter_arch.triu_indices.device.type == "cpu"


@pytest.mark.parametrize("num_sparse", [1, 3, 8])
def test_interaction_arch_gradient_matches_autograd_of_the_pairwise_formula(num_sparse: int) -> None:
    """Its one-bmm backward, against float64 finite differences and against autograd through the plain formula."""
    arch = InteractionArch(num_sparse).double()
    dense = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(3, num_sparse, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(arch, (dense, sparse))
    grad_out = torch.randn(3, D + num_sparse * (num_sparse + 1) // 2, dtype=torch.float64)
    ours = torch.autograd.grad(arch(dense, sparse), (dense, sparse), grad_out)
    vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
    pairs = [(vectors[:, i] * vectors[:, j]).sum(-1) for i, j in itertools.combinations(range(num_sparse + 1), 2)]
    plain = torch.autograd.grad(torch.cat([dense, torch.stack(pairs, 1)], dim=1), (dense, sparse), grad_out)
    for mine, theirs in zip(ours, plain, strict=True):
        torch.testing.assert_close(mine, theirs)


def test_interaction_arch_trains_under_autocast() -> None:
    """Under ``torch.autocast`` the Gram matrix is bf16 while the vectors are fp32 (bf16 dense, fp32 embeddings):
    the one-bmm backward computes in the forward's dtype and hands each input a gradient of its own dtype (it mixed
    a bf16 gradient with the fp32 vectors in one bmm and raised). Its gradients match autograd through the plain
    bmm formula under the same autocast, to bf16 rounding; and the whole DLRM takes a step."""
    num_sparse = 3
    arch = InteractionArch(num_sparse)
    dense = torch.randn(6, D, requires_grad=True)
    sparse = torch.randn(6, num_sparse, D, requires_grad=True)
    grad_out = torch.randn(6, D + num_sparse * (num_sparse + 1) // 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense_bf16 = dense.to(torch.bfloat16)  # a bf16 activation, as a dense layer's output under autocast
        out = arch(dense_bf16, sparse)
        vectors = torch.cat([dense_bf16.unsqueeze(1), sparse], dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        plain = torch.cat([dense_bf16, gram.flatten(1)[:, arch._pair_positions]], dim=1)
    ours = torch.autograd.grad(out, (dense, sparse), grad_out.to(out.dtype), retain_graph=True)
    theirs = torch.autograd.grad(plain, (dense, sparse), grad_out.to(plain.dtype))
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.dtype == reference.dtype == torch.float32
        torch.testing.assert_close(mine, reference, rtol=3e-2, atol=3e-2)
    model = DLRMTrain(DLRM(_collection(), 3, [8, D], [8, 1]))
    batch = next(Batcher(SPEC).process(_elements(8), 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(batch)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.model.dense_arch.parameters())


def test_low_rank_cross_net_formula() -> None:
    net = LowRankCrossNet(in_features=6, num_layers=2, low_rank=3)
    with torch.no_grad():
        for bias in net.bias:
            bias.normal_()
    x0 = torch.randn(4, 6)
    x = x0
    for w, v, b in zip(net.W_kernels, net.V_kernels, net.bias, strict=True):
        x = x0 * (x @ v.T @ w.T + b) + x
    torch.testing.assert_close(net(x0), x)


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_forward_shapes_and_torchrec_state_dict_names(arch: str) -> None:
    layers = dict(dense_in_features=3, dense_arch_layer_sizes=[8, D], over_arch_layer_sizes=[5, 1])
    if arch == "dlrm":
        model = DLRM(_collection(), **layers)
    else:
        model = DLRM_DCN(_collection(), **layers, dcn_num_layers=2, dcn_low_rank_dim=2)
    batch = next(Batcher(SPEC).process(_elements(6), 8))
    assert model(batch.dense_features, batch.sparse_features).shape == (8, 1)
    keys = set(DLRMTrain(model).state_dict())
    assert "model.dense_arch.model._mlp.1._linear.weight" in keys
    assert "model.sparse_arch.embedding_bag_collection.embedding_bags.t2.weight" in keys
    assert "model.over_arch.model.1.bias" in keys
    if arch == "dlrm_dcn":
        assert "model.inter_arch.crossnet.V_kernels.1" in keys
        assert model.over_arch.model[0]._mlp[0]._linear.in_features == 4 * D  # (F + 1) * D


def _train_model(seed: int = 0) -> DLRMTrain:
    torch.manual_seed(seed)
    return DLRMTrain(DLRM(_collection(), 3, [8, D], [5, 1]))


def test_padded_rows_change_neither_loss_nor_update() -> None:
    elements = _elements(5)
    padded = next(Batcher(SPEC).process(elements, 8))  # 3 padded rows
    exact = next(Batcher(SPEC).process(elements, 5))
    models = [_train_model(), _train_model()]
    losses = []
    for model, batch in zip(models, (padded, exact), strict=True):
        loss, (loss_value, logits, labels) = model(batch)
        loss.backward()
        losses.append(loss_value)
        assert logits.shape == labels.shape == (batch.batch_size,)
    torch.testing.assert_close(losses[0], losses[1])
    params = [dict(m.named_parameters()) for m in models]
    for name, p in params[0].items():  # dense grads and the fused table updates agree
        if p.grad is not None:
            torch.testing.assert_close(p.grad, params[1][name].grad)
        else:
            torch.testing.assert_close(p, params[1][name])


def test_fused_update_moves_only_touched_rows() -> None:
    model = _train_model()
    batch = next(Batcher(SPEC).process(_elements(4), 4))
    table = model.model.sparse_arch.embedding_bag_collection.embedding_bags["t0"].weight
    before = table.detach().clone()
    model(batch)[0].backward()
    touched = set(batch.sparse_features["f0"].values().tolist())
    changed = set((table.detach() != before).any(1).nonzero().flatten().tolist())
    assert changed == touched and table.grad is None


def test_triton_kernels_under_the_interpreter_match_the_twin() -> None:
    """backend="auto" runs the Triton kernels (interpreted on CPU in tests): same logits and same fused update."""
    batch = next(Batcher(SPEC).process(_elements(3), 3))
    results = []
    for backend in ("auto", "torch"):
        torch.manual_seed(1)
        model = DLRMTrain(DLRM(_collection(backend=backend), 3, [8, D], [5, 1]))
        loss, (_, logits, _) = model(batch)
        loss.backward()
        tables = model.model.sparse_arch.embedding_bag_collection.embedding_bags
        results.append((logits, [tables[f"t{i}"].weight.detach().clone() for i in range(3)]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for auto_table, torch_table in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(auto_table, torch_table)


class _RecordingAwaitable(LazyAwaitable):
    """A sharded collection's output stand-in: records when it is waited."""

    def __init__(self, result: object, events: list[str]) -> None:
        super().__init__()
        self._value, self._events = result, events

    def _wait_impl(self) -> object:
        self._events.append("wait embeddings")
        return self._value


def test_the_lookup_is_in_flight_while_the_dense_arch_runs_and_its_backward_comes_first() -> None:
    """A sharded collection returns a lazy awaitable: DLRM starts it before the dense arch and waits it after, so the
    output all-to-all overlaps the dense forward; autograd then reaches the dense arch's gradients (and DDP's
    all-reduce of them) before the embedding lookup's backward (the fused update), not after it."""
    events: list[str] = []
    model = DLRM(_collection(), 3, [8, D], [5, 1])
    collection = model.sparse_arch.embedding_bag_collection
    inner_forward = collection.forward

    def lazy_forward(features: object) -> _RecordingAwaitable:
        events.append("lookup")
        return _RecordingAwaitable(inner_forward(features), events)

    collection.forward = lazy_forward
    model.dense_arch.register_forward_hook(lambda *_: events.append("dense forward"))
    batch = next(Batcher(SPEC).process(_elements(4), 4))
    logits = model(batch.dense_features, batch.sparse_features)
    assert events == ["lookup", "dense forward", "wait embeddings"]
    table = collection.embedding_bags["t0"].weight
    before = table.detach().clone()
    first_dense = model.dense_arch.model._mlp[0]._linear.weight
    first_dense.register_hook(lambda g: events.append(f"dense grad, table updated: {not torch.equal(table, before)}"))
    logits.sum().backward()
    assert events[3:] == ["dense grad, table updated: False"]
    assert not torch.equal(table, before)  # the fused update ran, after the dense arch's backward


def test_bad_model_arguments() -> None:
    with pytest.raises(ValueError, match=r"dense_arch_layer_sizes must end with the embedding dim 4, got .*\[8, 5\]"):
        DLRM(_collection(), 3, [8, 5], [5, 1])
    with pytest.raises(
        ValueError, match=r"DLRM needs one embedding_dim for all tables, got \{'t0': 4, 't1': 4, 't2': 2"
    ):
        DLRM(_collection((D, D, 2)), 3, [8, D], [5, 1])
    with pytest.raises(ValueError, match=r"over_arch_layer_sizes must list at least 2 layer size\(s\), got .*\[1\]"):
        DLRM(_collection(), 3, [8, D], [1])
    with pytest.raises(ValueError, match=r"over_arch_layer_sizes\[0\] must be a positive int, got .*=0"):
        OverArch(4, [0, 1])
    with pytest.raises(ValueError, match="embedding_bag_collection must be an EmbeddingBagCollection"):
        DLRM(torch.nn.Linear(2, 2), 3, [8, D], [5, 1])
    with pytest.raises(ValueError, match="low_rank must be a positive int, got low_rank=0"):
        DLRM_DCN(_collection(), 3, [8, D], [5, 1], dcn_num_layers=2, dcn_low_rank_dim=0)
    with pytest.raises(TypeError, match="batch must be a tritonrec.data.batch.Batch, got dict"):
        _train_model()({"dense": torch.zeros(2, 3)})


def test_bad_forward_inputs_name_the_argument() -> None:
    """Dense features of the wrong width, batch size (against the KJT's stride) or dtype raise naming
    ``dense_features`` (before, torch's matmul / cat errors named neither argument nor expected shape)."""
    model = DLRM(_collection(), 3, [D], [4, 1])
    kjt = next(Batcher(SPEC).process(_elements(4), 4)).sparse_features  # stride 4
    assert model(torch.randn(4, 3), kjt).shape == (4, 1)
    with pytest.raises(ValueError, match=r"dense_features has batch size 5 but sparse_features has stride 4"):
        model(torch.randn(5, 3), kjt)
    with pytest.raises(ValueError, match=r"dense_features must have shape \[B, dense_in_features=3\], got \(4, 2\)"):
        model(torch.randn(4, 2), kjt)
    with pytest.raises(ValueError, match=r"dense_features must have shape \[B, dense_in_features=3\], got \(3,\)"):
        model(torch.randn(3), kjt)
    with pytest.raises(TypeError, match="dense_features must be a floating-point tensor, got torch.int64"):
        model(torch.ones(4, 3, dtype=torch.int64), kjt)
