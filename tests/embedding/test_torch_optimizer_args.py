"""torch.optim.SGD / Adam / Adagrad keyword arguments on fused collections (modules/torch_optimizer_args.py): every
keyword at its default, and the implementation choices (``foreach``, ``fused``) at any value, are accepted and train
exactly as if left out; a value the fused rule cannot honour, or a keyword the class does not take, is a ValueError
naming it and its value. ``initial_accumulator_value`` starts both Adagrad rules' state (torch.optim.Adagrad's
``state_sum``): checked against torch.optim.Adagrad on a plain collection, against the rowwise rule written out by
hand, through ``reset_parameters`` and into the sharded lookups' ``fused_params``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.fused_params import parse_fused_params
from tritonrec.kernels.embedding import TableBatchedLayout, TableSpec
from tritonrec.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedEmbeddingBagCollection, OptimType


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name="a", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(num_embeddings=5, embedding_dim=3, name="b", feature_names=["f2"]),
    ]


def _batch(seed: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (9,), generator=gen)
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths), torch.randn(3, 11, generator=gen)


def _trained(optimizer: type, kwargs: dict[str, Any], steps: int = 3) -> FusedEmbeddingBagCollection:
    torch.manual_seed(0)
    module = FusedEmbeddingBagCollection(_tables(), optimizer, kwargs, backend="torch")
    for step in range(steps):
        kjt, grad = _batch(step)
        module(kjt).values().backward(grad)
    return module


BASE = {torch.optim.SGD: {"lr": 0.1}, torch.optim.Adam: {"lr": 0.05}, torch.optim.Adagrad: {"lr": 0.1, "eps": 1e-3}}
COMMON_HARMLESS = [
    ("foreach", None),
    ("foreach", True),
    ("foreach", False),
    ("fused", None),
    ("fused", False),
    ("maximize", False),
    ("differentiable", False),
]
ACCEPTED = [
    *[(cls, key, value) for cls in BASE for key, value in COMMON_HARMLESS],
    (torch.optim.SGD, "momentum", 0),
    (torch.optim.SGD, "momentum", 0.0),
    (torch.optim.SGD, "dampening", 0),
    (torch.optim.SGD, "dampening", 0.5),  # no effect without momentum
    (torch.optim.SGD, "nesterov", False),
    (torch.optim.SGD, "weight_decay", 0),
    (torch.optim.Adam, "amsgrad", False),
    (torch.optim.Adam, "capturable", False),
    (torch.optim.Adam, "decoupled_weight_decay", False),
    (torch.optim.Adam, "betas", (0.9, 0.999)),
    (torch.optim.Adam, "eps", 1e-8),
    (torch.optim.Adagrad, "lr_decay", 0),
    (torch.optim.Adagrad, "lr_decay", 0.0),
    (torch.optim.Adagrad, "lr_decay", torch.tensor(0.0)),
    (torch.optim.Adagrad, "initial_accumulator_value", 0),
    (torch.optim.Adagrad, "weight_decay", 0.0),
]


@pytest.mark.parametrize(("optimizer", "key", "value"), ACCEPTED, ids=lambda x: getattr(x, "__name__", repr(x)))
def test_defaults_and_harmless_keywords_train_as_if_left_out(optimizer: type, key: str, value: Any) -> None:
    with_keyword = _trained(optimizer, {**BASE[optimizer], key: value})
    without = _trained(optimizer, BASE[optimizer])
    for (name, mine), (_, theirs) in zip(with_keyword.named_parameters(), without.named_parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    assert "foreach" not in with_keyword.fused_optimizer.param_groups[0]  # not a hyperparameter of the rule


REFUSED = [
    (torch.optim.SGD, "momentum", 0.9, "keeps no momentum buffer"),
    (torch.optim.SGD, "nesterov", True, "keeps no momentum buffer"),
    (torch.optim.SGD, "maximize", True, "descend the gradient"),
    (torch.optim.SGD, "differentiable", True, "outside autograd"),
    (torch.optim.Adam, "amsgrad", True, "running maximum"),
    (torch.optim.Adam, "capturable", True, "capturable"),
    (torch.optim.Adam, "decoupled_weight_decay", True, "not to the weights"),
    (torch.optim.Adagrad, "lr_decay", 0.01, "no learning-rate decay"),
    (torch.optim.Adagrad, "maximize", True, "descend the gradient"),
    (torch.optim.Adagrad, "lr_decay", torch.tensor(0.1), "no learning-rate decay"),
    (torch.optim.Adam, "amsgrad", "no", "running maximum"),
]


@pytest.mark.parametrize(("optimizer", "key", "value", "why"), REFUSED, ids=lambda x: getattr(x, "__name__", repr(x)))
def test_values_the_fused_rule_cannot_honour_are_refused_by_name(optimizer: type, key: str, value: Any, why: str):
    with pytest.raises(ValueError) as info:
        FusedEmbeddingBagCollection(_tables(), optimizer, {**BASE[optimizer], key: value})
    message = str(info.value)
    assert f"torch.optim.{optimizer.__name__} argument {key}={value!r}" in message and why in message


def test_keywords_the_class_does_not_take_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"torch.optim.SGD takes no argument 'betas' \(got betas=\(0.9, 0.99\)\)"):
        FusedEmbeddingBagCollection(_tables(), torch.optim.SGD, {"betas": (0.9, 0.99)})
    with pytest.raises(ValueError, match=r"torch.optim.Adagrad takes no argument 'lr_decays'"):
        FusedEmbeddingBagCollection(_tables(), torch.optim.Adagrad, {"lr_decays": 0})
    # the OptimType spelling takes the rule's own names only
    with pytest.raises(ValueError, match=r"EXACT_ADAGRAD does not take \['lr_decay'\]"):
        FusedEmbeddingBagCollection(_tables(), OptimType.EXACT_ADAGRAD, {"lr_decay": 0})
    with pytest.raises(ValueError, match="initial_accumulator_value must be a non-negative number, got .*=-0.5"):
        FusedEmbeddingBagCollection(_tables(), torch.optim.Adagrad, {"initial_accumulator_value": -0.5})


def test_initial_accumulator_value_matches_torch_adagrad() -> None:
    kwargs = {"lr": 0.2, "eps": 1e-3, "initial_accumulator_value": 0.5, "lr_decay": 0, "foreach": False}
    fused = FusedEmbeddingBagCollection(_tables(), torch.optim.Adagrad, kwargs, backend="torch")
    plain = EmbeddingBagCollection(_tables(), backend="torch")
    plain.load_state_dict(fused.state_dict())
    opt = torch.optim.Adagrad(plain.parameters(), **kwargs)
    for step in range(4):
        kjt, grad = _batch(step)
        fused(kjt).values().backward(grad)
        opt.zero_grad()
        plain(kjt).values().backward(grad)
        opt.step()
    for name, param in fused.named_parameters():
        theirs = plain.get_parameter(name)
        torch.testing.assert_close(param, theirs, rtol=1e-6, atol=1e-6)
        # rows no batch read keep torch's initial sum too
        torch.testing.assert_close(fused.fused_optimizer.state[param]["momentum1"], opt.state[theirs]["sum"])
    assert fused.fused_optimizer.param_groups[0]["initial_accumulator_value"] == 0.5
    fused.reset_parameters()
    for param in fused.parameters():
        assert torch.equal(fused.fused_optimizer.state[param]["momentum1"], torch.full(param.shape, 0.5))


def test_initial_accumulator_value_starts_the_rowwise_rule() -> None:
    lr, eps, start = 0.2, 1e-3, 0.25
    kwargs = {"lr": lr, "eps": eps, "initial_accumulator_value": start}
    fused = FusedEmbeddingBagCollection(_tables(), OptimType.EXACT_ROWWISE_ADAGRAD, kwargs, backend="torch")
    plain = EmbeddingBagCollection(_tables(), backend="torch")
    plain.load_state_dict(fused.state_dict())
    for param in fused.parameters():
        assert torch.equal(fused.fused_optimizer.state[param]["momentum1"], torch.full(param.shape[:1], start))
    kjt, grad = _batch(0)
    fused(kjt).values().backward(grad)
    plain(kjt).values().backward(grad)
    read = {"a": torch.cat([kjt["f0"].values(), kjt["f1"].values()]).unique(), "b": kjt["f2"].values().unique()}
    for table, rows in read.items():
        weight = plain.embedding_bags[table].weight
        g = weight.grad[rows]
        momentum = start + (g * g).mean(dim=1)  # the rowwise rule, written out
        expected = weight.detach().clone()
        expected[rows] -= lr * g / (momentum.sqrt() + eps)[:, None]
        mine = fused.embedding_bags[table].weight
        torch.testing.assert_close(mine.detach(), expected, rtol=1e-6, atol=1e-6)
        state = fused.fused_optimizer.state[mine]["momentum1"]
        untouched = torch.ones(state.shape[0], dtype=torch.bool)
        untouched[rows] = False
        torch.testing.assert_close(state[rows], momentum)
        assert torch.equal(state[untouched], torch.full((int(untouched.sum()),), start))


def test_initial_accumulator_value_reaches_the_sharded_lookups() -> None:
    layout = TableBatchedLayout([TableSpec(3, 2)], [0])
    module = FusedEmbeddingBagCollection(_tables(), torch.optim.Adagrad, {"initial_accumulator_value": 0.5})
    carried = parse_fused_params(None, module).fused
    assert carried is not None and carried.kwargs["initial_accumulator_value"] == 0.5
    assert torch.equal(carried.create_state(layout, torch.device("cpu"), 0).momentum1, torch.full((6,), 0.5))
    given = parse_fused_params({"optimizer": "EXACT_ROWWISE_ADAGRAD", "initial_accumulator_value": 0.3}).fused
    assert given is not None
    assert torch.equal(given.create_state(layout, torch.device("cpu"), 0).momentum1, torch.full((3,), 0.3))
    with pytest.raises(ValueError, match=r"EXACT_SGD does not take \['initial_accumulator_value'\]"):
        parse_fused_params({"optimizer": torch.optim.SGD, "initial_accumulator_value": 0.3})
