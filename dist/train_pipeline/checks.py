"""Argument checks shared by the pipelines' constructors, and the check of what the model's forward returns.

Every public entry names the argument and the value it rejects. The torchrec arguments tritonrec accepts only at
their defaults (``apply_jit``, ``pipeline_postproc``) are refused when set, instead of being ignored: a user who
asks for them would otherwise get a pipeline that silently does something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tritonrec.dist.train_pipeline.tracing import TrainPipelineContext

# what to do instead of each torchrec option tritonrec does not implement
_UNSUPPORTED = {
    "apply_jit": "TorchScript is not applied to the dense modules (compile them with torch.compile before building "
    "the pipeline if needed)",
    "pipeline_postproc": "postproc modules are not pipelined (a sharded module fed by one runs its own input dist)",
}


def check_parts(model: object, optimizer: object, device: object, optimizer_required: bool = True) -> torch.device:
    """``device`` as a torch.device, after checking the model, the optimizer (unless not required) and the device."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer_required and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    return torch.device(device)


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")
    return value


def check_unsupported(**options: object) -> None:
    """Each torchrec option (``apply_jit=...``) must be a bool, and False: tritonrec does not implement it."""
    for name, value in options.items():
        if check_bool(value, name):
            raise NotImplementedError(f"{name}=True is not supported: {_UNSUPPORTED[name]}; pass {name}=False")


def check_model_fwd(custom_model_fwd: object) -> Callable[[Any], Any] | None:
    if custom_model_fwd is not None and not callable(custom_model_fwd):
        raise TypeError(
            f"custom_model_fwd must be a callable batch -> (loss, output) or None, got {custom_model_fwd!r}"
        )
    return custom_model_fwd  # type: ignore[return-value]


def check_context_type(context_type: object) -> type[TrainPipelineContext]:
    if not (isinstance(context_type, type) and issubclass(context_type, TrainPipelineContext)):
        raise TypeError(
            f"context_type must be TrainPipelineContext or a subclass of it, got context_type={context_type!r}"
        )
    return context_type


def split_model_output(result: Any, source: str, training: bool) -> tuple[Any, Any]:
    """``(loss, output)`` from what ``source`` (``model(batch)`` or ``custom_model_fwd(batch)``) returned, or a
    clear error naming the contract, instead of an unpacking error from inside the pipeline."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = f"a {type(result).__name__}"
        if isinstance(result, (tuple, list)):
            got += f" of {len(result)} items"
        elif isinstance(result, torch.Tensor):
            got += f" of shape {list(result.shape)}"
        raise TypeError(
            f"{source} must return a pair (loss, output) (torchrec's contract: the pipeline runs backward on the loss "
            f"and progress() returns the output), got {got}"
        )
    losses, output = result
    if training and not isinstance(losses, torch.Tensor):
        raise TypeError(f"{source} must return (loss, output) with a tensor loss, got a {type(losses).__name__} loss")
    return losses, output


__all__ = [
    "check_bool",
    "check_context_type",
    "check_model_fwd",
    "check_parts",
    "check_unsupported",
    "split_model_output",
]
