"""FusedEmbeddingBagCollection / FusedEmbeddingCollection: updates inside backward (SGD and per-element Adagrad
against torch's optimizers on plain collections), the fused optimizer's state dict round trip, live learning rate,
torchrec-style optimizer types, device / dtype moves, ``reset_parameters`` resetting the optimizer state."""

from __future__ import annotations

import io

import pytest
import torch
from embedding.tbe_testing import BACKENDS

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    OptimType,
    PoolingType,
)


def _tables(data_type: DataType = DataType.FP32) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            num_embeddings=5, embedding_dim=4, name="a", feature_names=["f0", "f1"], data_type=data_type
        ),
        EmbeddingBagConfig(num_embeddings=4, embedding_dim=3, name="b", feature_names=["f2"], pooling=PoolingType.MEAN),
    ]


def _batch(seed: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (9,), generator=gen)
    values = torch.randint(0, 4, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths), torch.randn(3, 11, generator=gen)


def _train(module, steps, start=0) -> None:
    for step in range(start, start + steps):
        kjt, grad = _batch(step)
        module(kjt).values().backward(grad)


# torch's rule and its fused equivalent (torchrec's mapping); Adagrad with lr_decay=0 and no initial accumulator
RULES = {"sgd": (torch.optim.SGD, {"lr": 0.2}), "adagrad": (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-3})}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_rule_equals_ebc_with_the_torch_optimizer(backend, rule, tolerance):
    torch_rule, kwargs = RULES[rule]
    fused = FusedEmbeddingBagCollection(_tables(), torch_rule, kwargs, backend=backend)
    plain = EmbeddingBagCollection(_tables(), backend=backend)
    plain.load_state_dict(fused.state_dict())
    opt = torch_rule(plain.parameters(), **kwargs)
    for step in range(4):
        kjt, grad = _batch(step)
        fused(kjt).values().backward(grad)
        opt.zero_grad()
        plain(kjt).values().backward(grad)
        opt.step()
    for name, param in fused.named_parameters():
        assert param.grad is None
        torch.testing.assert_close(param, plain.get_parameter(name), **tolerance(torch.float32))
        if rule == "adagrad":  # torch's "sum" is the fused "momentum1", per element
            momentum, expected = fused.fused_optimizer.state[param]["momentum1"], opt.state[plain.get_parameter(name)]
            torch.testing.assert_close(momentum, expected["sum"], **tolerance(torch.float32))


@pytest.mark.parametrize("optim", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM, OptimType.EXACT_ADAGRAD])
def test_checkpoint_round_trip_resumes_bit_identically(optim):
    kwargs = {"lr": 0.1, "betas": (0.8, 0.9)} if optim == OptimType.ADAM else {"lr": 0.1, "eps": 1e-6}
    first = FusedEmbeddingBagCollection(_tables(), optim, kwargs, backend="torch")
    _train(first, 2)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": first.fused_optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    second = FusedEmbeddingBagCollection(_tables(), optim, {"lr": 0.5}, backend="torch")
    second.load_state_dict(saved["model"])
    second.fused_optimizer.load_state_dict(saved["optim"])
    assert second.fused_optimizer.param_groups[0]["lr"] == 0.1
    state = second.fused_optimizer.state_dict()["state"]
    assert set(state) == {"embedding_bags.a.weight", "embedding_bags.b.weight"}
    assert state["embedding_bags.a.weight"]["momentum1"].shape == (
        (5,) if optim == OptimType.EXACT_ROWWISE_ADAGRAD else (5, 4)
    )
    assert int(state["embedding_bags.b.weight"]["step"]) == 2
    for name, tensors in saved["optim"]["state"].items():
        for key, value in tensors.items():
            assert torch.equal(state[name][key], value)
    _train(first, 2, start=2)
    _train(second, 2, start=2)
    for name, param in first.named_parameters():
        assert torch.equal(param, second.get_parameter(name))


def test_state_dict_is_a_snapshot_and_load_checks_its_input():
    module = FusedEmbeddingBagCollection(_tables(), OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="torch")
    snapshot = module.fused_optimizer.state_dict()
    _train(module, 1)
    assert snapshot["state"]["embedding_bags.a.weight"]["momentum1"].abs().sum() == 0
    module.fused_optimizer.load_state_dict(snapshot)
    assert module.fused_optimizer.state[module.embedding_bags["a"].weight]["momentum1"].abs().sum() == 0
    bad = {"state": {"embedding_bags.a.weight": {}}, "param_groups": [{}]}
    with pytest.raises(ValueError, match=r"state_dict\['state'\] has tables \['embedding_bags.a.weight'\]"):
        module.fused_optimizer.load_state_dict(bad)
    wrong_shape = module.fused_optimizer.state_dict()
    wrong_shape["state"]["embedding_bags.b.weight"]["momentum1"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"state embedding_bags.b.weight.momentum1 has shape \(3,\), expected \(4,\)"):
        module.fused_optimizer.load_state_dict(wrong_shape)
    with pytest.raises(ValueError, match="state_dict must hold 'state' and 'param_groups'"):
        module.fused_optimizer.load_state_dict({"state": {}})


def test_learning_rate_changes_take_effect_on_the_next_backward():
    module = FusedEmbeddingBagCollection(_tables(), OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="torch")
    optimizer = module.fused_optimizer
    assert optimizer() is optimizer  # torchrec spells it fused_optimizer()
    optimizer.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in module.parameters()]
    _train(module, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    # an LR scheduler drives the same live value (step() itself is a no-op: the update ran in backward)
    optimizer.param_groups[0]["lr"] = 0.05
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=3.0)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.15)
    _train(module, 1, start=1)
    assert not all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_optimizer_types_and_kwargs():
    assert (
        FusedEmbeddingBagCollection(_tables(), torch.optim.Adam, {"lr": 0.1})._fused_states[0].optim == OptimType.ADAM
    )
    assert FusedEmbeddingBagCollection(_tables(), "exact_rowwise_adagrad", {})._fused_states[0].optim == (
        OptimType.EXACT_ROWWISE_ADAGRAD
    )
    assert FusedEmbeddingBagCollection(_tables(), torch.optim.Adagrad, {})._fused_states[0].optim == (
        OptimType.EXACT_ADAGRAD
    )
    assert FusedEmbeddingBagCollection(_tables(), "exact_adagrad", {})._fused_states[0].optim == OptimType.EXACT_ADAGRAD
    with pytest.raises(ValueError, match="optimizer_type=<class 'torch.optim.rmsprop.RMSprop'> cannot be fused"):
        FusedEmbeddingBagCollection(_tables(), torch.optim.RMSprop, {"lr": 0.1})
    with pytest.raises(ValueError, match=r"torch.optim.SGD argument momentum=0.9 cannot be honoured"):
        FusedEmbeddingBagCollection(_tables(), torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match=r"EXACT_SGD does not take \['momentum'\]"):
        FusedEmbeddingBagCollection(_tables(), OptimType.EXACT_SGD, {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(TypeError, match="optimizer_kwargs must be a dict, got list"):
        FusedEmbeddingBagCollection(_tables(), torch.optim.SGD, [0.1])


def test_half_precision_tables_keep_fp32_state():
    module = FusedEmbeddingBagCollection(_tables(), OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="torch")
    module = module.half()
    assert module.embedding_bags["a"].weight.dtype == torch.float16
    before = module.embedding_bags["a"].weight.detach().clone()
    _train(module, 1)
    momentum = module.fused_optimizer.state[module.embedding_bags["a"].weight]["momentum1"]
    assert momentum.dtype == torch.float32 and momentum.abs().sum() > 0
    assert not torch.equal(before, module.embedding_bags["a"].weight)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_ec_rule_equals_ec_with_the_torch_optimizer(backend, rule, tolerance):
    tables = [
        EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="a", feature_names=["f0", "f1"]),
        EmbeddingConfig(num_embeddings=4, embedding_dim=3, name="b", feature_names=["f2"], data_type=DataType.FP32),
    ]
    torch_rule, kwargs = RULES[rule]
    fused = FusedEmbeddingCollection(tables, torch_rule, kwargs, backend=backend)
    plain = EmbeddingCollection(tables, backend=backend)
    plain.load_state_dict(fused.state_dict())
    opt = torch_rule(plain.parameters(), **kwargs)
    for step in range(2):
        kjt, _ = _batch(step)
        sum((jt.values() ** 2).sum() for jt in fused(kjt).values()).backward()
        opt.zero_grad()
        sum((jt.values() ** 2).sum() for jt in plain(kjt).values()).backward()
        opt.step()
    assert list(fused.fused_optimizer.state_dict()["state"]) == ["embeddings.a.weight", "embeddings.b.weight"]
    for name, param in fused.named_parameters():
        torch.testing.assert_close(param, plain.get_parameter(name), **tolerance(torch.float32))


def test_assign_loading_rebinds_the_optimizer_to_the_new_parameters():
    module = FusedEmbeddingBagCollection(_tables(), OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="torch")
    source = FusedEmbeddingBagCollection(_tables(), OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="torch")
    module.load_state_dict({k: v.clone() for k, v in source.state_dict().items()}, assign=True)
    _train(module, 1)
    _train(source, 1)
    for name, param in module.named_parameters():
        assert torch.equal(param, source.get_parameter(name))
        assert any(param is p for p in module.fused_optimizer.param_groups[0]["params"])
        assert param in module.fused_optimizer.state


def _reset_ec_tables(data_type: DataType) -> list[EmbeddingConfig]:
    return [EmbeddingConfig(5, 4, "a", data_type, ["f0", "f1"]), EmbeddingConfig(4, 3, "b", feature_names=["f2"])]


@pytest.mark.parametrize("collection", ["ebc", "ec"])
@pytest.mark.parametrize("optim", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM, OptimType.EXACT_ADAGRAD])
def test_reset_parameters_also_resets_the_optimizer_state(optim, collection):
    """After training, ``reset_parameters()`` leaves the module as a freshly built one with the same (re-drawn)
    weights: zero momenta, zero step counts (Adam's bias correction starts over) and stochastic rounding of the fp16
    table drawing the same stream again, so both then train bit-identically."""

    def build():
        if collection == "ebc":
            return FusedEmbeddingBagCollection(_tables(DataType.FP16), optim, {"lr": 0.1}, backend="torch")
        return FusedEmbeddingCollection(_reset_ec_tables(DataType.FP16), optim, {"lr": 0.1}, backend="torch")

    def train(module, steps: int) -> None:
        for step in range(steps):
            kjt, grad = _batch(step)
            out = module(kjt)
            loss = out.values() * grad if collection == "ebc" else [jt.values() ** 2 for jt in out.values()]
            sum(x.sum() for x in (loss if isinstance(loss, list) else [loss])).backward()

    used = build()
    train(used, 3)
    used.fused_optimizer.param_groups[0]["lr"] = 0.05  # hyperparameters are kept
    used.reset_parameters()
    state = used.fused_optimizer.state_dict()["state"]
    assert all(not tensor.any() for entry in state.values() for tensor in entry.values())
    assert used.fused_optimizer.param_groups[0]["lr"] == 0.05
    fresh = build()
    fresh.load_state_dict(used.state_dict())
    fresh.fused_optimizer.param_groups[0]["lr"] = 0.05
    train(used, 2)
    train(fresh, 2)
    for name, param in fresh.named_parameters():
        assert torch.equal(param, used.get_parameter(name))
    for name, entry in fresh.fused_optimizer.state_dict()["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(tensor, used.fused_optimizer.state_dict()["state"][name][key])
