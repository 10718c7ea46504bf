"""``apply_optimizer_in_backward``'s marks on a table -> the sharded module's ``fused_params`` (rank-free parts of
dist/in_backward.py; the 2-rank training is tests/model_parallel/test_dmp_in_backward.py)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.distributed.optim import _apply_optimizer_in_backward

from tritonrec.dist.fused_params import parse_fused_params, table_fused_configs
from tritonrec.dist.in_backward import in_backward_fused_params, torch_optimizer_fused_params
from tritonrec.kernels.embedding import OptimType
from tritonrec.modules import EmbeddingBagConfig, EmbeddingConfig, FusedEmbeddingBagCollection, FusedEmbeddingCollection
from tritonrec.optim import in_backward_optimizer_filter


def _marked(optimizer: type, kwargs: dict, times: int = 1) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(3, 2))
    for _ in range(times):
        _apply_optimizer_in_backward(optimizer, [param], kwargs)
    return param


def test_left_out_hyperparameters_take_the_torch_class_defaults() -> None:
    assert torch_optimizer_fused_params(torch.optim.SGD, {}, "t") == {
        "optimizer": OptimType.EXACT_SGD, "lr": 1e-3, "weight_decay": 0
    }  # fmt: skip
    adagrad = torch_optimizer_fused_params(torch.optim.Adagrad, {"lr": 0.5}, "t")
    assert adagrad == {
        "optimizer": OptimType.EXACT_ADAGRAD, "lr": 0.5, "eps": 1e-10, "weight_decay": 0, "initial_accumulator_value": 0
    }  # fmt: skip
    adam = torch_optimizer_fused_params(torch.optim.Adam, {"betas": (0.5, 0.75), "weight_decay": 0.1}, "t")
    assert adam["optimizer"] == OptimType.ADAM and (adam["beta1"], adam["beta2"]) == (0.5, 0.75)
    assert adam["lr"] == 1e-3 and adam["eps"] == 1e-8 and adam["weight_decay"] == 0.1


def test_initial_accumulator_value_reaches_the_adagrad_rules() -> None:
    got = torch_optimizer_fused_params(torch.optim.Adagrad, {"initial_accumulator_value": 0.25}, "t")
    assert got["initial_accumulator_value"] == 0.25


def test_implementation_choices_of_torch_are_accepted() -> None:
    for optimizer in (torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad):
        got = torch_optimizer_fused_params(optimizer, {"lr": 0.1, "foreach": True, "fused": False}, "t")
        assert got["lr"] == 0.1 and "foreach" not in got and "fused" not in got


@pytest.mark.parametrize(
    ("optimizer", "kwargs", "message"),
    [
        (torch.optim.SGD, {"momentum": 0.9}, "momentum=0.9"),
        (torch.optim.SGD, {"nesterov": True, "momentum": 0.5}, "nesterov=True"),
        (torch.optim.Adam, {"capturable": True}, "capturable=True"),
        (torch.optim.SGD, {"maximize": True}, "maximize=True"),
        (torch.optim.Adam, {"amsgrad": True}, "amsgrad=True"),
        (torch.optim.Adagrad, {"lr_decay": 0.1}, "lr_decay=0.1"),
        (torch.optim.Adagrad, {"differentiable": True}, "differentiable=True"),
    ],
)
def test_what_a_fused_rule_cannot_apply_is_refused_by_name(optimizer, kwargs, message) -> None:
    with pytest.raises(ValueError, match=f"table 't3'.*{message}"):
        torch_optimizer_fused_params(optimizer, kwargs, "table 't3'")


def test_unknown_keywords_and_classes_are_refused() -> None:
    with pytest.raises(ValueError, match="SGD takes no argument 'betas'"):
        torch_optimizer_fused_params(torch.optim.SGD, {"betas": (0.9, 0.9)}, "t")
    with pytest.raises(ValueError, match="cannot be fused"):
        torch_optimizer_fused_params(torch.optim.RMSprop, {}, "t")


def test_the_tables_optimizer_overrides_the_sharders_fused_params() -> None:
    weights = {"a": _marked(torch.optim.Adagrad, {"lr": 0.3}), "b": _marked(torch.optim.Adagrad, {"lr": 0.3})}
    sharder = {"optimizer": OptimType.EXACT_SGD, "learning_rate": 9.0, "weight_decay": 0.5, "backend": "torch"}
    merged = in_backward_fused_params(sharder, weights)
    assert sorted(merged) == ["a", "b"] and merged["a"] == merged["b"]
    # the table's rule replaces every rule key of the sharder's (its learning_rate would shadow nothing, but an
    # Adagrad table must not inherit SGD's weight decay); the other keys stay
    assert merged["a"]["optimizer"] == OptimType.EXACT_ADAGRAD and merged["a"]["lr"] == 0.3
    assert "learning_rate" not in merged["a"] and merged["a"]["weight_decay"] == 0 and merged["a"]["backend"] == "torch"
    assert in_backward_fused_params({"backend": "torch"}, {"a": torch.nn.Parameter(torch.zeros(1, 1))}) == {}


def test_each_table_keeps_its_own_optimizer() -> None:
    weights = {
        "a": _marked(torch.optim.Adagrad, {"lr": 0.3}),
        "b": _marked(torch.optim.SGD, {"lr": 0.2}),
        "c": _marked(torch.optim.Adagrad, {"lr": 0.1}),
        "plain": torch.nn.Parameter(torch.zeros(3, 2)),
    }
    merged = in_backward_fused_params({"backend": "torch"}, weights)
    assert sorted(merged) == ["a", "b", "c"]  # "plain" takes the sharder's fused_params as given
    assert [(merged[t]["optimizer"], merged[t]["lr"]) for t in "abc"] == [
        (OptimType.EXACT_ADAGRAD, 0.3), (OptimType.EXACT_SGD, 0.2), (OptimType.EXACT_ADAGRAD, 0.1)
    ]  # fmt: skip


def test_tables_with_equal_optimizers_share_one_config_and_others_get_their_own() -> None:
    weights = {
        "a": _marked(torch.optim.Adagrad, {"lr": 0.3}),
        "b": _marked(torch.optim.Adagrad, {"lr": 0.3}),
        "c": _marked(torch.optim.Adagrad, {"lr": 0.1}),
        "d": _marked(torch.optim.SGD, {"lr": 0.3}),
    }
    options = parse_fused_params({"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "lr": 0.5})
    options.table_fused = table_fused_configs(in_backward_fused_params(None, weights), None, options.fused)
    configs = options.fused_configs(["plain", "a", "b", "c", "d"])
    assert [(c.optim, c.hyperparams["lr"]) for c in configs] == [
        (OptimType.EXACT_ROWWISE_ADAGRAD, 0.5), (OptimType.EXACT_ADAGRAD, 0.3), (OptimType.EXACT_ADAGRAD, 0.1),
        (OptimType.EXACT_SGD, 0.3),
    ]  # fmt: skip
    assert options.fused_of("a") is options.fused_of("b") and options.fused_of("plain") is options.fused
    assert len({id(c.hyperparams) for c in configs}) == 4  # one live hyperparameter dict (param group) each


def test_a_tables_optimizer_equal_to_the_modules_shares_its_config() -> None:
    weights = {"a": _marked(torch.optim.SGD, {"lr": 0.3})}
    options = parse_fused_params({"optimizer": OptimType.EXACT_SGD, "lr": 0.3, "weight_decay": 0})
    options.table_fused = table_fused_configs(in_backward_fused_params(None, weights), None, options.fused)
    assert options.fused_of("a") is options.fused and options.fused_configs(["a", "b"]) == [options.fused]


def test_a_table_carrying_two_optimizers_is_refused() -> None:
    with pytest.raises(ValueError, match="table 'c' has 2 optimizers applied in backward"):
        in_backward_fused_params(None, {"c": _marked(torch.optim.SGD, {"lr": 0.1}, times=2)})


@pytest.mark.parametrize("collection", ["ebc", "ec"])
def test_in_backward_optimizer_on_a_fused_collection_is_refused_by_name(collection: str) -> None:
    """torch appends to the fused table's marker list; that used to end in a bare AttributeError inside torch."""
    if collection == "ebc":
        config = EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])
        module = FusedEmbeddingBagCollection([config], OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1})
        name = "embedding_bags.t0.weight"
    else:
        config = EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])
        module = FusedEmbeddingCollection([config], OptimType.EXACT_SGD, {"lr": 0.1})
        name = "embeddings.t0.weight"
    rule = "EXACT_ROWWISE_ADAGRAD" if collection == "ebc" else "EXACT_SGD"
    with pytest.raises(ValueError, match=rf"'{name}'.*fused collection.*{rule}.*SGD cannot be added"):
        _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.5})
    param = dict(module.named_parameters())[name]
    assert len(param._in_backward_optimizers) == 1  # nothing was added before the refusal
    # the marker still reads as torchrec's, and survives the copies users make of modules
    assert [n for n, _ in in_backward_optimizer_filter(module.named_parameters(), include=True)] == [name]
    for copied in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        marker = dict(copied.named_parameters())[name]._in_backward_optimizers
        assert len(marker) == 1 and type(marker[0]).__name__ == "EmptyFusedOptimizer"
        with pytest.raises(ValueError, match="fused collection"):
            marker.append(object())
