"""Field checks of a :class:`~tritonrec.dist.train.config.TrainConfig`, run by ``as_train_config`` before anything is
built, spawned or written: every value that would otherwise fail deep inside a rank, at step 1 with torch's message,
or not at all (a misspelled key, a string where a bool goes) is named here with its field and value. The one-process
and the distributed job go through the same checks, so the same mistake reads the same in both.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from tritonrec.kernels.checks import check_int, check_optional_int

DENSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}
ARCHS = ("dlrm", "dlrm_dcn")
MODEL_BACKENDS = ("auto", "triton", "torch")


def _positive_int(value: object, name: str) -> None:
    check_int(value, name, 1)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def reject_unknown_keys(node: DictConfig, where: str = "") -> None:
    """A composed config's keys that its schema lacks (``+model.embeding_dim=8`` adds one, which ``to_object`` would
    silently drop), named with their dotted path. Free-form dicts (``optim.dense_kwargs``) are not walked."""
    schema = OmegaConf.get_type(node)
    if schema is None or not dataclasses.is_dataclass(schema):
        return
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(str(k) for k in node.keys() if k not in known)
    if unknown:
        names = ", ".join(f"{where}{k}" for k in unknown)
        raise ValueError(
            f"unknown config key(s) {names}: {schema.__name__} has no such field (a misspelling added with `+`?); "
            f"its fields are {sorted(known)}"
        )
    for key in node.keys():
        child = node._get_node(key)  # the raw node: no interpolation resolved, no value converted
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            reject_unknown_keys(child, f"{where}{key}.")


def check_top_level(cfg: Any) -> None:
    """The TrainConfig's own scalar fields whose type nothing else checks (a str name, bools, paths)."""
    if not isinstance(cfg.name, str) or not cfg.name:
        raise ValueError(f"name must be a non-empty str, got name={cfg.name!r}")
    for name in ("progress", "plot", "drop_remainder"):
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {name}={value!r}")
    for name in ("resume", "output_dir"):
        value = getattr(cfg, name)
        if value is None:
            continue
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise TypeError(f"{name} must be a path (str) or None, got {name}={value!r}")
        setattr(cfg, name, os.fspath(value))  # a pathlib.Path from Python is fine: kept as the str the schema says


def check_model(model: Any) -> None:
    """The DLRM fields, named ``model.<field>`` (the modules' own checks would name their arguments instead)."""
    if model.arch not in ARCHS:
        raise ValueError(f"model.arch must be one of {ARCHS}, got {model.arch!r}")
    if model.backend not in MODEL_BACKENDS:
        raise ValueError(f"model.backend must be one of {MODEL_BACKENDS}, got {model.backend!r}")
    if model.pooling not in ("SUM", "MEAN"):
        raise ValueError(f"model.pooling must be 'SUM' or 'MEAN', got {model.pooling!r}")
    _positive_int(model.embedding_dim, "model.embedding_dim")
    for name in ("dense_arch_layer_sizes", "over_arch_layer_sizes"):
        sizes = getattr(model, name)
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise ValueError(f"model.{name} must list positive layer sizes, got model.{name}={sizes!r}")
        for i, size in enumerate(sizes):
            check_int(size, f"model.{name}[{i}]", 1, what="a positive layer size")
    if model.dense_arch_layer_sizes[-1] != model.embedding_dim:
        raise ValueError(
            f"model.dense_arch_layer_sizes must end with model.embedding_dim={model.embedding_dim} (the dense "
            f"features join the embeddings), got model.dense_arch_layer_sizes={list(model.dense_arch_layer_sizes)}"
        )
    if len(model.over_arch_layer_sizes) < 2:  # DLRM's over arch: at least one hidden layer before the logit
        raise ValueError(
            "model.over_arch_layer_sizes must list at least 2 layer sizes (hidden layers, then the logit's 1), got "
            f"model.over_arch_layer_sizes={list(model.over_arch_layer_sizes)}"
        )
    if model.over_arch_layer_sizes[-1] != 1:
        raise ValueError(
            "model.over_arch_layer_sizes must end with 1 (one logit per sample for the BCE loss), got "
            f"model.over_arch_layer_sizes={list(model.over_arch_layer_sizes)}"
        )
    if model.arch == "dlrm_dcn":
        _positive_int(model.dcn_num_layers, "model.dcn_num_layers")
        _positive_int(model.dcn_low_rank_dim, "model.dcn_low_rank_dim")


def check_data(data: Any) -> None:
    """The data fields the sources would take silently or report without the ``data.`` prefix."""
    if hasattr(data, "num_dense"):
        _positive_int(data.num_dense, "data.num_dense")
    if hasattr(data, "num_sparse_features"):
        _positive_int(data.num_sparse_features, "data.num_sparse_features")
    if hasattr(data, "num_eval_samples"):
        what = "a non-negative int (0: no held-out evaluation)"
        check_int(data.num_eval_samples, "data.num_eval_samples", 0, what=what)
    check_optional_int(getattr(data, "chunk_size", None), "data.chunk_size", 1)


def sparse_optimizer_kwargs(optim: Any) -> dict[str, Any]:
    """``optim.sparse_lr`` and ``optim.sparse_kwargs`` as the fused collection takes them (betas a tuple)."""
    kwargs = {"lr": optim.sparse_lr, **dict(optim.sparse_kwargs)}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def check_optim(optim: Any) -> None:
    """Both rules and their arguments, tried on a one-row table and a one-element parameter (so a kwarg the rule
    lacks fails here, with torch's or the fused module's reason, not inside a rank after the model is built)."""
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection

    if not isinstance(optim.sparse_kwargs, Mapping):
        raise TypeError(f"optim.sparse_kwargs must be a mapping, got optim.sparse_kwargs={optim.sparse_kwargs!r}")
    if not isinstance(optim.dense_kwargs, Mapping):
        raise TypeError(f"optim.dense_kwargs must be a mapping, got optim.dense_kwargs={optim.dense_kwargs!r}")
    table = EmbeddingBagConfig(num_embeddings=1, embedding_dim=1, name="check", feature_names=["check"])
    try:
        FusedEmbeddingBagCollection([table], optim.sparse, sparse_optimizer_kwargs(optim), device="cpu",
                                    backend="torch")  # fmt: skip
    except (ValueError, TypeError) as error:
        raise ValueError(f"optim.sparse / optim.sparse_kwargs: {error}") from None
    if optim.dense not in DENSE_OPTIMIZERS:
        raise ValueError(f"optim.dense must be one of {sorted(DENSE_OPTIMIZERS)}, got {optim.dense!r}")
    if not _is_number(optim.dense_lr) or not math.isfinite(optim.dense_lr) or not optim.dense_lr > 0:
        raise ValueError(f"optim.dense_lr must be a positive number, got {optim.dense_lr!r}")
    probe = [torch.nn.Parameter(torch.zeros(1))]
    try:
        DENSE_OPTIMIZERS[optim.dense](probe, lr=optim.dense_lr, **dict(optim.dense_kwargs))
    except TypeError as error:
        raise TypeError(
            f"optim.dense_kwargs={dict(optim.dense_kwargs)!r} do not fit optim.dense={optim.dense!r}: {error}"
        ) from None
    except ValueError as error:  # torch's own range checks (e.g. "Invalid beta parameter")
        raise ValueError(f"optim.dense_kwargs={dict(optim.dense_kwargs)!r}: {error}") from None


__all__ = [
    "ARCHS",
    "DENSE_OPTIMIZERS",
    "MODEL_BACKENDS",
    "check_data",
    "check_model",
    "check_optim",
    "check_top_level",
    "reject_unknown_keys",
    "sparse_optimizer_kwargs",
]
