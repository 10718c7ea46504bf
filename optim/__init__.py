"""Optimizers with torchrec's names: keyed optimizers (state keyed by parameter name, so checkpoints re-shard),
the combined optimizer spanning fused tables and dense layers, and the filter that tells them apart."""

from tritonrec.optim.keyed import (
    CombinedOptimizer,
    EmptyFusedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerFactory,
    in_backward_optimizer_filter,
)

__all__ = [
    "CombinedOptimizer",
    "EmptyFusedOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerFactory",
    "in_backward_optimizer_filter",
]
