"""Dense optimizer state in a checkpoint (one process, no process group): a parameter that never had a gradient (an
unused head, a frozen branch) has no state in torch's optimizers; the checkpoint has none for it either, and the
resumed optimizer must hold exactly the saved state - a load used to create state for every parameter first and then
fail, strictly, on the one the checkpoint lacked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.model_parallel.dlrm_cases import batch_slice, build_dlrm, global_batch, loss_of
from tritonrec.dist.checkpoint import load_checkpoint, save_checkpoint
from tritonrec.optim import KeyedOptimizerWrapper, in_backward_optimizer_filter

UNUSED = "unused_head.weight"


def _model(seed: int) -> nn.Module:
    model = build_dlrm(seed=seed)
    torch.manual_seed(seed)
    model.unused_head = nn.Linear(3, 2)  # registered, never in the forward: no gradient, no Adam state
    return model


def _dense(model: nn.Module, keyed: bool) -> Any:
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    if keyed:
        return KeyedOptimizerWrapper(params, lambda p: torch.optim.Adam(p, lr=0.01))
    return torch.optim.Adam(list(params.values()), lr=0.01)


def _train(model: nn.Module, optimizer: Any, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_of(model, *batch_slice(global_batch(step, 4), 0, 4)).backward()
        optimizer.step()


def _state(model: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items() if s}


def _same_state(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> bool:
    return sorted(a) == sorted(b) and all(
        sorted(a[n]) == sorted(b[n]) and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a
    )


def _round_trip(tmp_path: Path, keyed: bool, loader_has_state: bool) -> None:
    saved_model = _model(3)
    saved_opt = _dense(saved_model, keyed)
    _train(saved_model, saved_opt, range(2))
    assert UNUSED not in _state(saved_model, saved_opt)
    save_checkpoint(tmp_path / "ckpt", saved_model, {"dense": saved_opt}, step=2)

    model = _model(9)
    optimizer = _dense(model, keyed)
    if loader_has_state:  # an optimizer that already stepped, its unused head included: the load must drop that
        loss = loss_of(model, *batch_slice(global_batch(0, 4), 0, 4)) + model.unused_head(torch.ones(1, 3)).sum()
        loss.backward()
        optimizer.step()
        assert UNUSED in _state(model, optimizer)
    load_checkpoint(tmp_path / "ckpt", model, {"dense": optimizer})
    assert _same_state(_state(model, optimizer), _state(saved_model, saved_opt))
    # resumed: trains on exactly like the saved one, the unused head without state
    _train(saved_model, saved_opt, range(2, 4))
    _train(model, optimizer, range(2, 4))
    assert _same_state(_state(model, optimizer), _state(saved_model, saved_opt))
    for name, param in saved_model.named_parameters():
        assert torch.equal(param, model.get_parameter(name)), name


def test_checkpoint_with_a_parameter_without_state_resumes_exactly(tmp_path: Path) -> None:
    _round_trip(tmp_path, keyed=False, loader_has_state=False)


def test_loading_drops_state_the_checkpoint_has_not(tmp_path: Path) -> None:
    _round_trip(tmp_path, keyed=True, loader_has_state=True)
