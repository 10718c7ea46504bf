"""torch's optimizer state-dict hooks on keyed and combined optimizers: ``register_state_dict_pre_hook`` /
``register_state_dict_post_hook`` / ``register_load_state_dict_pre_hook`` / ``register_load_state_dict_post_hook``
run (in torch's order, with torch's return-value rules) instead of being accepted and silently ignored."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tritonrec.optim import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper


def _trained() -> tuple[nn.Linear, CombinedOptimizer, KeyedOptimizerWrapper]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    dense = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: torch.optim.Adam(p, lr=0.1))
    combined = CombinedOptimizer([("dense", dense)])
    model(torch.ones(2, 3)).sum().backward()
    combined.step()
    return model, combined, dense


def _register_all(optimizer: KeyedOptimizer, calls: list[str]) -> None:
    optimizer.register_state_dict_pre_hook(lambda opt: calls.append("sd_pre"))

    def sd_post(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("sd_post")
        return {**sd, "extra": 7}

    def load_pre(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("load_pre")
        return {k: v for k, v in sd.items() if k != "extra"}

    optimizer.register_state_dict_post_hook(sd_post)
    optimizer.register_load_state_dict_pre_hook(load_pre)
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append("load_post"))


def test_state_dict_hooks_run_on_combined_and_wrapped_optimizers() -> None:
    _, combined, dense = _trained()
    for optimizer in (combined, dense):
        calls: list[str] = []
        _register_all(optimizer, calls)
        sd = optimizer.state_dict()
        assert calls == ["sd_pre", "sd_post"]
        assert sd["extra"] == 7  # the post hook's return value replaces the state dict
        optimizer.load_state_dict(sd)  # the pre hook strips "extra" again, or the load would see it unchanged
        assert calls == ["sd_pre", "sd_post", "load_pre", "load_post"]


def test_load_pre_hook_may_replace_the_state_dict() -> None:
    model, combined, _ = _trained()
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in combined.state_dict()["state"].items()}
    model(torch.ones(2, 3)).sum().backward()
    combined.step()
    combined.register_load_state_dict_pre_hook(lambda opt, sd: {"state": saved})
    combined.load_state_dict({"state": {}})  # replaced by the hook before any check
    for name, state in combined.state_dict()["state"].items():
        for key, tensor in state.items():
            assert torch.equal(tensor, saved[name][key]), (name, key)
