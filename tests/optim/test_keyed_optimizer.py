"""Keyed / combined optimizers (torchrec semantics) and hyperparameter validation of the fused optimizer: name-keyed
state round trips, LR schedules reaching fused and dense groups, the in-backward filter, and a bad ``lr`` / ``eps`` /
``weight_decay`` / ``betas`` refused at construction, on a ``param_groups`` edit (before the next update touches a
row) and in ``load_state_dict`` (before anything is written)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from tritonrec.data import KeyedJaggedTensor
from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, OptimType
from tritonrec.optim import (
    CombinedOptimizer,
    EmptyFusedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    in_backward_optimizer_filter,
)


class _Model(nn.Module):
    """Fused tables plus a dense layer (what DLRM looks like to the optimizers)."""

    def __init__(self, optim: OptimType = OptimType.EXACT_ROWWISE_ADAGRAD, **kwargs: object) -> None:
        super().__init__()
        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name="a", feature_names=["f0"]),
            EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="b", feature_names=["f1"]),
        ]
        self.ebc = FusedEmbeddingBagCollection(tables, optim, kwargs or {"lr": 0.1}, backend="torch")
        self.dense = nn.Linear(8, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.ebc(kjt).values()).sum()


def _kjt(seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (6,), generator=gen)
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)


def _combined(model: _Model) -> CombinedOptimizer:
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense = KeyedOptimizerWrapper(dense_params, lambda params: torch.optim.Adam(params, lr=0.01))
    return CombinedOptimizer([("ebc", model.ebc.fused_optimizer), dense])


def _train(model: _Model, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = model(_kjt(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_in_backward_filter_splits_fused_tables_from_dense_parameters() -> None:
    model = _Model()
    fused = [name for name, _ in in_backward_optimizer_filter(model.named_parameters(), include=True)]
    dense = [name for name, _ in in_backward_optimizer_filter(model.named_parameters())]
    assert fused == ["ebc.embedding_bags.a.weight", "ebc.embedding_bags.b.weight"]
    assert dense == ["dense.weight", "dense.bias"]
    optimizer = model.ebc.fused_optimizer
    assert isinstance(optimizer, KeyedOptimizer) and isinstance(optimizer, torch.optim.Optimizer)


def test_combined_state_dict_is_keyed_by_prefixed_names_and_round_trips_exactly() -> None:
    first = _Model()
    optimizer = _combined(first)
    optimizer.save_param_groups(True)
    _train(first, optimizer, range(3))
    saved = copy.deepcopy({"model": first.state_dict(), "optim": optimizer.state_dict()})
    assert sorted(saved["optim"]["state"]) == [
        "dense.bias",
        "dense.weight",
        "ebc.embedding_bags.a.weight",
        "ebc.embedding_bags.b.weight",
    ]
    assert set(saved["optim"]["state"]["ebc.embedding_bags.a.weight"]) == {"momentum1", "step"}
    assert [g["params"] for g in saved["optim"]["param_groups"]] == [
        ["ebc.embedding_bags.a.weight", "ebc.embedding_bags.b.weight"],
        ["dense.bias", "dense.weight"],
    ]
    expected = _train(first, optimizer, range(3, 6))

    second = _Model()
    resumed = _combined(second)
    resumed.save_param_groups(True)
    resumed.init_state()  # Adam's state is lazy: create it so the checkpoint loads in place
    second.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optim"])
    assert _train(second, resumed, range(3, 6)) == expected
    for name, param in first.named_parameters():
        assert torch.equal(param, second.get_parameter(name)), name


def test_lr_scheduler_on_the_combined_optimizer_reaches_fused_and_dense_groups() -> None:
    model = _Model()
    optimizer = _combined(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0 if step == 0 else 1.0)
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]
    assert model.ebc.fused_optimizer.param_groups[0]["lr"] == 0.0  # the dict the kernels read
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _train(model, optimizer, range(1))
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())  # lr 0: nothing moved
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]
    _train(model, optimizer, range(1, 2))
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters())


def test_keyed_load_checks_everything_before_writing() -> None:
    model = _Model()
    optimizer = _combined(model)
    _train(model, optimizer, range(2))
    assert optimizer.defaults["_save_param_groups"]  # torchrec's rule: as its first child (the fused one: saves)
    optimizer.save_param_groups(False)
    state = optimizer.state_dict()
    assert "param_groups" not in state and "param_groups" not in model.ebc.fused_optimizer.state_dict()
    bad = copy.deepcopy(state)
    bad["state"]["dense.weight"]["exp_avg"] = torch.zeros(3)
    momentum = model.ebc.fused_optimizer.state[model.ebc.embedding_bags["a"].weight]["momentum1"]
    before = momentum.clone()
    bad["state"]["ebc.embedding_bags.a.weight"]["momentum1"] = torch.full_like(before, 7.0)
    with pytest.raises(ValueError, match=r"state dense.weight.exp_avg has shape \(3,\), expected \(1, 8\)"):
        optimizer.load_state_dict(bad)
    assert torch.equal(momentum, before)  # the valid part was not written either
    missing = copy.deepcopy(state)
    del missing["state"]["dense.bias"]
    with pytest.raises(ValueError, match=r"has parameters .* this optimizer has"):
        optimizer.load_state_dict(missing)
    optimizer.save_param_groups(True)
    with pytest.raises(ValueError, match="state_dict has no 'param_groups'"):
        optimizer.load_state_dict(state)


def test_combined_and_wrapper_bad_input() -> None:
    model = _Model()
    with pytest.raises(ValueError, match="duplicate parameter key 'embedding_bags.a.weight'"):
        CombinedOptimizer([model.ebc.fused_optimizer, model.ebc.fused_optimizer])
    with pytest.raises(TypeError, match="optims must hold KeyedOptimizers"):
        CombinedOptimizer([torch.optim.SGD(model.dense.parameters(), lr=0.1)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="params must be a mapping of name -> parameter, got list"):
        KeyedOptimizerWrapper(list(model.dense.parameters()), torch.optim.SGD)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError):
        model.ebc.fused_optimizer.add_param_group({"params": []})
    assert EmptyFusedOptimizer().state_dict() == {"state": {}}


BAD_HYPERPARAMETERS = [
    (OptimType.EXACT_ROWWISE_ADAGRAD, "lr", math.nan, r"lr must be a non-negative number, got lr=nan"),
    (OptimType.EXACT_ROWWISE_ADAGRAD, "lr", math.inf, r"lr must be a non-negative number, got lr=inf"),
    (OptimType.EXACT_SGD, "lr", -0.5, r"lr must be a non-negative number, got lr=-0.5"),
    (OptimType.EXACT_ROWWISE_ADAGRAD, "eps", math.nan, r"eps must be a non-negative number, got eps=nan"),
    (OptimType.ADAM, "weight_decay", -1e-3, r"weight_decay must be a non-negative number, got weight_decay=-0.001"),
    (OptimType.ADAM, "weight_decay", math.nan, r"weight_decay must be a non-negative number, got weight_decay=nan"),
    (OptimType.ADAM, "betas", (0.9, 1.0), r"betas must be two numbers in \[0, 1\), got betas=\(0.9, 1.0\)"),
    (OptimType.ADAM, "betas", (math.nan, 0.9), r"betas must be two numbers in \[0, 1\), got betas=\(nan, 0.9\)"),
    (OptimType.ADAM, "betas", (-0.1, 0.9), r"betas must be two numbers in \[0, 1\), got betas=\(-0.1, 0.9\)"),
]
IDS = [f"{optim.name}-{field}={value}" for optim, field, value, _ in BAD_HYPERPARAMETERS]


@pytest.mark.parametrize(("optim", "field", "value", "message"), BAD_HYPERPARAMETERS, ids=IDS)
def test_bad_hyperparameter_at_construction(optim: OptimType, field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FusedEmbeddingBagCollection(_Model().ebc.embedding_bag_configs(), optim, {field: value})


@pytest.mark.parametrize(("optim", "field", "value", "message"), BAD_HYPERPARAMETERS, ids=IDS)
def test_bad_param_groups_edit_raises_before_the_update(
    optim: OptimType, field: str, value: object, message: str
) -> None:
    model = _Model(optim, lr=0.1)
    fused = model.ebc.fused_optimizer
    _train(model, torch.optim.SGD(model.dense.parameters(), lr=0.1), range(1))  # some state to protect
    weights = {name: p.detach().clone() for name, p in model.ebc.named_parameters()}
    state = copy.deepcopy(fused.state_dict()["state"])
    fused.param_groups[0][field] = value
    with pytest.raises(ValueError, match="fused optimizer param_groups\\[0\\]: " + message):
        model(_kjt(5)).backward()  # today's bug: a NaN lr turned every touched row into NaN here
    with pytest.raises(ValueError, match=message):
        fused.step()
    for name, param in model.ebc.named_parameters():
        assert torch.equal(param, weights[name]), name
    for name, table_state in fused.state_dict()["state"].items():
        for key, tensor in table_state.items():
            assert torch.equal(tensor, state[name][key]), f"{name}.{key}"  # the step counter did not move either


@pytest.mark.parametrize(("optim", "field", "value", "message"), BAD_HYPERPARAMETERS, ids=IDS)
def test_bad_hyperparameter_in_load_state_dict(optim: OptimType, field: str, value: object, message: str) -> None:
    model = _Model(optim, lr=0.1)
    fused = model.ebc.fused_optimizer
    saved = fused.state_dict()
    saved["param_groups"][0][field] = value
    for table_state in saved["state"].values():
        table_state["step"] = table_state["step"] + 3
    with pytest.raises(ValueError, match="loaded fused optimizer param_groups\\[0\\]: " + message):
        fused.load_state_dict(saved)
    assert all(int(s["step"]) == 0 for s in fused.state_dict()["state"].values())  # nothing written
    assert fused.param_groups[0]["lr"] == 0.1


def test_dense_wrapper_checks_edits_before_its_step_and_keyed_load() -> None:
    model = _Model()
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    with pytest.raises(ValueError, match=r"SGD param_groups\[0\]: lr must be a non-negative number, got lr=nan"):
        KeyedOptimizerWrapper(params, lambda p: torch.optim.SGD(p, lr=math.nan))  # torch's own check lets NaN in
    dense = KeyedOptimizerWrapper(params, lambda p: torch.optim.SGD(p, lr=0.1))
    model(_kjt(0)).backward()
    before = {name: p.detach().clone() for name, p in params.items()}
    dense.param_groups[0]["weight_decay"] = -1.0
    with pytest.raises(ValueError, match="weight_decay must be a non-negative number, got weight_decay=-1.0"):
        dense.step()
    assert all(torch.equal(before[name], p) for name, p in params.items())
    dense.param_groups[0]["weight_decay"] = 0.0
    dense.save_param_groups(True)
    saved = dense.state_dict()
    saved["param_groups"][0]["lr"] = math.inf
    with pytest.raises(ValueError, match=r"loaded SGD param_groups\[0\]: lr must be a non-neg"):
        dense.load_state_dict(saved)
    assert dense.param_groups[0]["lr"] == 0.1
