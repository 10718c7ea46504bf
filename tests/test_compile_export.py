"""``torch.compile(fullgraph=True)`` with inductor on CPU, and ``torch.export``, over the ``tritonrec`` ops and the
modules built on them: compiled forward and backward equal eager ones (fused optimizers included: they update the
tables inside the compiled backward), value checks still raise from compiled graphs, and a
QuantEmbeddingBagCollection exports, runs other batch sizes and survives save / load.

Compiling costs seconds per graph on a small CPU, so shapes are tiny and cases few (the heaviest are marked slow).
Every test starts from a fresh dynamo and counts the graphs it compiled, so no test can pass on code compiled by
another. Inductor's on-disk cache may serve a graph compiled by an earlier run: that is the same code for the same
graph, and the test still runs and compares it.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator

import pytest
import torch
import torch._dynamo

from tritonrec.data import KeyedJaggedTensor
from tritonrec.data.batcher import Batcher
from tritonrec.dist.train.builders import build_data, build_dense_optimizer, build_model
from tritonrec.dist.train.config import DLRMConfig, OptimConfig, SyntheticDataConfig
from tritonrec.dist.train.loop import iterate_batches, train_step
from tritonrec.kernels import (
    dense_to_jagged,
    dequantize_fp8_rowwise,
    dequantize_half,
    dequantize_int8_rowwise,
    dequantize_mx4,
    jagged_to_padded_dense,
    permute_2d_sparse_data,
    quantize_fp8_rowwise,
    quantize_half,
    quantize_int8_rowwise,
    quantize_mx4,
)
from tritonrec.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    PoolingType,
    QuantEmbeddingBagCollection,
)

KEYS = ["f0", "f1", "f2"]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _compiled(fn: Callable, dynamic: bool | None = None, backend: str = "inductor") -> Callable:
    return torch.compile(fn, fullgraph=True, backend=backend, dynamic=dynamic)


def _assert_compiled() -> None:
    """The calls ran compiled code traced in this test (the fixture cleared the counters)."""
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


def _kjt(seed: int, batch: int = 3, rows: int = 5) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)


def test_jagged_dense_forward_and_backward_compile() -> None:
    def step(values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dense = jagged_to_padded_dense(values, offsets, 3, padding_value=-1.0)
        back = dense_to_jagged(dense * 2.0, offsets)  # length read from offsets: an unbacked size in the graph
        return dense, back.sum() + dense.sum()

    offsets = torch.tensor([0, 2, 2, 6])
    values = torch.randn(8, 2, requires_grad=True)  # two rows past offsets[-1]
    compiled_values = values.detach().clone().requires_grad_()
    dense, loss = step(values, offsets)
    compiled_dense, compiled_loss = _compiled(step)(compiled_values, offsets)
    _assert_compiled()
    assert torch.equal(compiled_dense, dense)
    torch.testing.assert_close(compiled_loss, loss)
    loss.backward()
    compiled_loss.backward()
    assert torch.equal(compiled_values.grad, values.grad) and not values.grad[6:].any()


def test_codecs_encode_decode_compile() -> None:
    def roundtrips(x: torch.Tensor) -> list[torch.Tensor]:
        return [
            dequantize_fp8_rowwise(quantize_fp8_rowwise(x, 16, "e5m2"), 16, "e5m2"),
            dequantize_int8_rowwise(quantize_int8_rowwise(x, 16, stochastic_rounding=True, seed=3), 16),
            dequantize_mx4(quantize_mx4(x, 8), 8),
            dequantize_half(quantize_half(x, "bf16", loss_scale=4.0), loss_scale=4.0),
            quantize_fp8_rowwise(x, 16),
        ]

    x = torch.randn(3, 40, requires_grad=True)
    eager = roundtrips(x)
    compiled = _compiled(roundtrips)(x)
    _assert_compiled()
    for got, expected in zip(compiled, eager, strict=True):
        assert torch.equal(got, expected)  # the same ops on the same bytes: bit-identical
    compiled[3].sum().backward()  # the half codec's straight-through gradient, through the compiled graph
    assert torch.equal(x.grad, torch.ones_like(x))


def _collection(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind in ("ebc", "fused_ebc"):
        tables = [
            EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
            EmbeddingBagConfig(
                num_embeddings=5, embedding_dim=2, name="t1", feature_names=["f2"], pooling=PoolingType.MEAN
            ),
        ]
        if kind == "ebc":
            return EmbeddingBagCollection(tables, backend="torch")
        return FusedEmbeddingBagCollection(tables, "EXACT_ROWWISE_ADAGRAD", {"lr": 0.1}, backend="torch")
    tables = [
        EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="t0", feature_names=["f0", "f1"]),
        EmbeddingConfig(num_embeddings=5, embedding_dim=2, name="t1", feature_names=["f2"]),
    ]
    if kind == "ec":
        return EmbeddingCollection(tables, backend="torch")
    return FusedEmbeddingCollection(tables, "ADAM", {"lr": 0.1}, backend="torch")


def _loss(module: torch.nn.Module, features: KeyedJaggedTensor) -> torch.Tensor:
    out = module(features)
    if isinstance(module, EmbeddingBagCollection):
        pooled = out.values()
        return (pooled * torch.arange(1, pooled.shape[1] + 1)).sum()
    return sum(((i + 1) * jt.values()).square().sum() for i, jt in enumerate(out.values()))


@pytest.mark.parametrize("kind", ["ebc", "fused_ebc", pytest.param("ec", marks=pytest.mark.slow), "fused_ec"], ids=str)
def test_embedding_collection_steps_compile(kind: str) -> None:
    """Three steps (different numbers of ids, one compile with dynamic shapes) of a loss over the collection's
    output, eager and compiled: same losses, same gradients (plain) or same updated tables and optimizer state
    (fused; the learning rate changes before the last step and takes effect without a recompile)."""
    eager, module = _collection(kind), _collection(kind)
    step = _compiled(_loss, dynamic=True)
    for seed in range(3):
        if seed == 2 and kind.startswith("fused"):
            for m in (eager, module):
                m.fused_optimizer.param_groups[0]["lr"] = 0.02
        expected = _loss(eager, _kjt(seed))
        got = step(module, _kjt(seed))
        torch.testing.assert_close(got, expected)
        expected.backward()
        got.backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for all three steps
    for (name, p), q in zip(eager.named_parameters(), module.parameters(), strict=True):
        assert torch.equal(q, p), name
        if not kind.startswith("fused"):
            assert torch.equal(q.grad, p.grad), name
    if kind.startswith("fused"):
        for eager_state, state in zip(eager._fused_states, module._fused_states, strict=True):
            for name, tensor in eager_state.state_tensors().items():
                assert torch.equal(state.state_tensors()[name], tensor), name


@pytest.mark.slow
def test_dlrm_train_step_compiles() -> None:
    """The training job's step (dist.train.loop.train_step: forward, loss, backward with the fused table update,
    dense optimizer step) on a compiled DLRMTrain equals the eager step."""
    data = SyntheticDataConfig(num_sparse_features=3, num_embeddings=20, num_dense=3, num_eval_samples=8)
    model_cfg = DLRMConfig(
        embedding_dim=4, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1], backend="torch"
    )
    optim = OptimConfig()
    sources = build_data(data)
    models, optimizers = [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model(model_cfg, sources, optim))
        optimizers.append(build_dense_optimizer(models[-1], optim))
    compiled = _compiled(models[1])
    batches = iterate_batches(Batcher(sources.element_spec), sources.train, 8)
    for _ in range(3):
        batch = next(batches)
        loss, logits = train_step(models[0], optimizers[0], batch)
        compiled_loss, compiled_logits = train_step(compiled, optimizers[1], batch)
        torch.testing.assert_close(compiled_loss, loss)
        torch.testing.assert_close(compiled_logits, logits)
    _assert_compiled()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(q, p, msg=name)


def test_triton_backend_is_kept_in_compiled_graphs() -> None:
    """``backend="triton"`` (the interpreter here) stays in the graph: the compiled forward and backward launch the
    kernels, fused table update included (aot_eager: what is tested is the graph, not inductor's code)."""
    values = torch.randn(7, 2, requires_grad=True)
    compiled_values = values.detach().clone().requires_grad_()
    offsets = torch.tensor([0, 2, 2, 5])
    pad = lambda v: jagged_to_padded_dense(v, offsets, 3, backend="triton")
    (pad(values) * 3.0).sum().backward()
    (_compiled(pad, backend="aot_eager")(compiled_values) * 3.0).sum().backward()
    assert torch.equal(compiled_values.grad, values.grad)

    tables = [EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t0", feature_names=KEYS)]
    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        modules.append(FusedEmbeddingBagCollection(tables, "ADAM", {"lr": 0.1}, backend="triton"))
    initial = modules[0].embedding_bags["t0"].weight.detach().clone()
    step = lambda module, features: module(features).values().square().sum()
    step(modules[0], _kjt(0)).backward()
    _compiled(step, backend="aot_eager")(modules[1], _kjt(0)).backward()
    _assert_compiled()
    updated = modules[1].embedding_bags["t0"].weight
    assert torch.equal(updated, modules[0].embedding_bags["t0"].weight) and not torch.equal(updated, initial)


def test_sparse_gradients_are_refused_under_compile() -> None:
    tables = [EmbeddingBagConfig(num_embeddings=5, embedding_dim=2, name="t0", feature_names=KEYS)]
    ebc = EmbeddingBagCollection(tables, sparse=True, backend="torch")
    step = _compiled(lambda features: ebc(features).values().sum(), backend="aot_eager")
    with pytest.raises(Exception, match=r"sparse_grad=True \(sparse COO table gradients\) is not supported"):
        step(_kjt(0))


def test_value_checks_raise_from_compiled_graphs() -> None:
    """Checks that read tensor contents run inside the ops at run time: the same compiled graph that ran a good
    batch rejects a bad one with the eager error."""
    pad = _compiled(lambda v, o: jagged_to_padded_dense(v, o, 2))
    values = torch.randn(5)
    assert pad(values, torch.tensor([0, 2, 5])).shape == (2, 2)
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        pad(values, torch.tensor([0, 3, 2]))

    permute = _compiled(lambda p, lengths, v: permute_2d_sparse_data(p, lengths, v, permuted_lengths_sum=3)[1])
    permute(torch.tensor([1, 0]), torch.tensor([[1, 0], [1, 1]]), torch.arange(3))
    with pytest.raises(ValueError, match=r"lengths must be non-negative, got -1 at position 1"):
        permute(torch.tensor([1, 0]), torch.tensor([[1, -1], [2, 1]]), torch.arange(3))

    ebc = _collection("ebc")
    lookup = _compiled(lambda features: ebc(features).values())
    lengths = torch.tensor([1, 1, 0, 1, 1, 0, 1, 0, 1])
    lookup(KeyedJaggedTensor(KEYS, torch.tensor([0, 1, 2, 3, 4, 0]), lengths=lengths))
    with pytest.raises(ValueError, match="index out of bounds: feature 'f2'.* has index 7"):
        lookup(KeyedJaggedTensor(KEYS, torch.tensor([0, 1, 2, 3, 4, 7]), lengths=lengths))  # t1 has 5 rows
    _assert_compiled()


def test_quant_ebc_exports() -> None:
    """A QuantEmbeddingBagCollection exports with a dynamic number of ids; the program (also after save / load)
    equals the eager module on batches of other sizes."""
    float_ebc = _collection("ebc")
    quant = QuantEmbeddingBagCollection.from_float(float_ebc, DataType.INT8)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = quant

        def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
            return self.ebc(features).values()

    model, example = Model(), _kjt(0)
    shapes = torch.export.ShapesCollection()
    shapes[example.values()] = {0: torch.export.Dim.DYNAMIC}
    program = torch.export.export(model, (example,), dynamic_shapes=shapes)
    ops = {
        str(node.target)
        for graph in program.graph_module.modules()
        if isinstance(graph, torch.fx.GraphModule)
        for node in graph.graph.nodes
        if node.op == "call_function"
    }
    assert {"tritonrec.lengths_to_offsets.default", "tritonrec.quantized_pooled_lookup.default"} <= ops
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([KeyedJaggedTensor]):
        loaded = torch.export.load(buffer)
    for seed in (1, 2):
        expected = model(_kjt(seed))
        # fresh KJTs: a KJT that computed its offsets holds one more tensor, so its pytree spec differs
        assert torch.equal(program.module()(_kjt(seed)), expected)
        assert torch.equal(loaded.module()(_kjt(seed)), expected)
