"""Bad inputs to every public entry of the comm layer that needs a process group, run on 2 gloo ranks.

Each case is (call, expected exception type, fragments the message must contain: the argument's name and the
offending value). The calls are lambdas over the default group, built only on the ranks.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist import comm, comm_ops
from tritonrec.dist.dist_data import (
    KJTAllToAll,
    PooledEmbeddingsAllToAll,
    SequenceEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsAllToAll,
)
from tritonrec.kernels.checks import NotAnIntError

WORLD = 2  # these cases are written for 2 ranks


def _world() -> dist.ProcessGroup:
    return dist.group.WORLD  # type: ignore[return-value]


def _f(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["a", "b", "c"], torch.arange(3), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))


@dataclass(frozen=True)
class BadCase:
    name: str
    call: Callable[[], Any]
    error: type
    fragments: tuple[str, ...]


_a2a = comm_ops.alltoall_pooled
_vb = comm_ops.variable_batch_alltoall_pooled
_seq = comm_ops.alltoall_sequence
_i = torch.tensor

BAD_CASES: list[BadCase] = [
    # alltoall_pooled
    BadCase("a2a/not_tensor", lambda: _a2a([[1.0]], [1, 0], [1, 1]), TypeError,
            ("a2a_pooled_embs_tensor must be a torch.Tensor", "list")),
    BadCase("a2a/wrong_dims", lambda: _a2a(_f(6), [3, 3], [1, 1]), ValueError,
            ("a2a_pooled_embs_tensor must have 2 dimension(s)", "(6,)")),
    BadCase("a2a/int_dtype", lambda: _a2a(torch.zeros(6, 1, dtype=torch.int64), [3, 3], [1, 1]), TypeError,
            ("a2a_pooled_embs_tensor must be a floating-point tensor", "torch.int64")),
    BadCase("a2a/world_size_mismatch", lambda: _a2a(_f(6, 1), [2, 2, 2], [1, 1]), ValueError,
            ("batch_size_per_rank must have one entry per rank (2)", "got 3", "[2, 2, 2]")),
    BadCase("a2a/negative_batch", lambda: _a2a(_f(2, 1), [3, -1], [1, 1]), ValueError,
            ("batch_size_per_rank[1] must be an int >= 0", "batch_size_per_rank[1]=-1")),
    BadCase("a2a/float_batch", lambda: _a2a(_f(6, 1), [3.0, 3], [1, 1]), NotAnIntError,  # a TypeError
            ("batch_size_per_rank[0] must be an int", "float", "3.0")),
    BadCase("a2a/rows_mismatch", lambda: _a2a(_f(6, 1), [2, 2], [1, 1]), ValueError,
            ("a2a_pooled_embs_tensor has 6 rows", "sum(batch_size_per_rank) = 4", "[2, 2]")),
    BadCase("a2a/cols_mismatch", lambda: _a2a(_f(4, 3), [2, 2], [2, 2]), ValueError,
            ("a2a_pooled_embs_tensor has 3 columns", "dim_sum_per_rank[", "= 2")),
    BadCase("a2a/dims_negative", lambda: _a2a(_f(4, 1), [2, 2], [1, -5]), ValueError,
            ("dim_sum_per_rank[1] must be an int >= 0", "dim_sum_per_rank[1]=-5")),
    BadCase("a2a/group_type", lambda: _a2a(_f(4, 1), [2, 2], [1, 1], group="world"), TypeError,
            ("group must be a torch.distributed.ProcessGroup or None", "str")),
    BadCase("a2a/codecs_type", lambda: _a2a(_f(4, 1), [2, 2], [1, 1], codecs=object()), TypeError,
            ("codecs must be QuantizedCommCodecs", "codecs.forward = None")),
    BadCase("a2a/dim_tensor_dtype", lambda: _a2a(_f(4, 1), [2, 2], [1, 1], dim_sum_per_rank_tensor=_f(2)), TypeError,
            ("dim_sum_per_rank_tensor must be int32 or int64", "torch.float32")),
    # variable_batch_alltoall_pooled (both ranks own one feature of dim 2)
    BadCase("vb/dims_rows", lambda: _vb(_f(4), [[1], [1]], [1, 1], [[2]]), ValueError,
            ("emb_dim_per_rank_per_feature must have 2 rows (one per rank)", "got 1")),
    BadCase("vb/batch_row_length", lambda: _vb(_f(4), [[1, 1], [1]], [1, 1], [[2], [2]]), ValueError,
            ("batch_size_per_rank_per_feature[0] must have one entry per feature (1)", "got 2")),
    BadCase("vb/pre_a2a_length", lambda: _vb(_f(4), [[1], [1]], [1], [[2], [2]]), ValueError,
            ("batch_size_per_feature_pre_a2a must have one entry per feature (2)", "got 1")),
    BadCase("vb/numel", lambda: _vb(_f(5), [[1], [1]], [1, 1], [[2], [2]]), ValueError,
            ("a2a_pooled_embs_tensor has 5 values", "needs 4")),
    # alltoall_sequence
    BadCase("seq/output_splits_sum", lambda: _seq(_f(4, 2), None, None, _i([4]), [2, 2], [1, 2]), ValueError,
            ("a2a_sequence_embs_tensor has 4 rows", "sum(output_splits) = 3", "[1, 2]")),
    BadCase("seq/lengths_sum", lambda: _seq(_f(4, 2), None, None, _i([2, 3]), [2, 2], [2, 2]), ValueError,
            ("sum(lengths_after_sparse_data_all2all) = 5", "(4)")),
    BadCase("seq/one_recat", lambda: _seq(_f(4, 2), _i([0, 1]), None, _i([2, 2]), [2, 2], [2, 2]), ValueError,
            ("forward_recat_tensor and backward_recat_tensor must both", "'backward_recat_tensor': 'None'")),
    BadCase("seq/recat_size", lambda: _seq(_f(4, 2), _i([0, 1, 2]), _i([0, 1, 2]), _i([2, 2]), [2, 2], [2, 2]),
            ValueError, ("forward_recat_tensor has 3 entries", "the 2 entries")),
    BadCase("seq/variable_batch_type", lambda: _seq(_f(4, 2), None, None, _i([4]), [2, 2], [2, 2], 1), TypeError,
            ("variable_batch_size must be a bool", "variable_batch_size=1")),
    BadCase("seq/lengths_dtype", lambda: _seq(_f(4, 2), None, None, _f(4), [2, 2], [2, 2]), TypeError,
            ("lengths_after_sparse_data_all2all must be int32 or int64", "torch.float32")),
    # alltoallv
    BadCase("alltoallv/no_split", lambda: comm_ops.alltoallv([_f(4, 1)]), ValueError,
            ("out_split=None", "per_rank_split_lengths=None")),
    BadCase("alltoallv/empty", lambda: comm_ops.alltoallv([], out_split=[1, 1]), TypeError,
            ("inputs must be a non-empty list of tensors", "[]")),
    BadCase("alltoallv/rows", lambda: comm_ops.alltoallv([_f(4, 1), _f(3, 1)], out_split=[2, 2]), ValueError,
            ("inputs must share rows", "inputs[1] is (3, 1)")),
    BadCase("alltoallv/out_split", lambda: comm_ops.alltoallv([_f(4, 1), _f(4, 2)], out_split=[2, 2]), ValueError,
            ("inputs have 3 columns", "output split for rank", "is 2")),
    # reduce-scatter / all-gather
    BadCase("rs_pooled/count", lambda: comm_ops.reduce_scatter_pooled([_f(2)] * 3), ValueError,
            ("inputs must hold one tensor per rank (2)", "got 3")),
    BadCase("rs_base/rows", lambda: comm_ops.reduce_scatter_base_pooled(_f(3, 2)), ValueError,
            ("input has 3 rows", "not divisible by the world size 2")),
    BadCase("rs_v/splits_sum", lambda: comm_ops.reduce_scatter_v_pooled(_f(4, 2), [2, 3]), ValueError,
            ("input has 4 rows", "sum(input_splits) = 5", "[2, 3]")),
    BadCase("rs_v/splits_length", lambda: comm_ops.reduce_scatter_v_pooled(_f(4, 2), [4]), ValueError,
            ("input_splits must have one entry per rank (2)", "got 1")),
    BadCase("rs_vpf/ndim", lambda: comm_ops.reduce_scatter_v_per_feature_pooled(_f(4, 2), [[1], [1]], [2]), ValueError,
            ("input must have 1 dimension(s)", "(4, 2)")),
    BadCase("rs_vpf/row", lambda: comm_ops.reduce_scatter_v_per_feature_pooled(_f(6), [[1, 1], [1]], [2, 1]),
            ValueError, ("batch_size_per_rank_per_feature[1] must have one entry per feature (2)", "got 1")),
    BadCase("rs_vpf/numel", lambda: comm_ops.reduce_scatter_v_per_feature_pooled(_f(5), [[1], [1]], [2]), ValueError,
            ("input has 5 values", "needs 4")),
    BadCase("all_gather/scalar", lambda: comm_ops.all_gather_base_pooled(torch.tensor(1.0)), ValueError,
            ("input must have at least 1 dimension(s)", "()")),
    BadCase("all_gather/int", lambda: comm_ops.all_gather_base_pooled(torch.zeros(2, dtype=torch.int32)), TypeError,
            ("input must be a floating-point tensor", "torch.int32")),
    # dist_data modules
    BadCase("kjt_a2a/splits", lambda: KJTAllToAll(_world(), [1, 1, 1]), ValueError,
            ("splits must have one entry per rank (2)", "got 3", "[1, 1, 1]")),
    BadCase("kjt_a2a/pg", lambda: KJTAllToAll("pg", [1, 1]), TypeError,
            ("pg must be a torch.distributed.ProcessGroup", "str")),
    BadCase("kjt_a2a/stagger", lambda: KJTAllToAll(_world(), [2, 1], stagger=3), ValueError,
            ("stagger must be a positive int dividing the world size 2", "stagger=3")),
    BadCase("kjt_a2a/input_type", lambda: KJTAllToAll(_world(), [2, 1])(torch.zeros(3)), TypeError,
            ("input must be a KeyedJaggedTensor", "Tensor")),
    BadCase("kjt_a2a/keys", lambda: KJTAllToAll(_world(), [2, 2])(_kjt()), ValueError,
            ("splits=[2, 2] sums to 4 keys but input has 3", "'a', 'b', 'c'")),
    BadCase("pooled_a2a/dims", lambda: PooledEmbeddingsAllToAll(_world(), [2]), ValueError,
            ("dim_sum_per_rank must have one entry per rank (2)", "got 1")),
    BadCase("pooled_a2a/rows", lambda: PooledEmbeddingsAllToAll(_world(), [1, 1])(_f(5, 1)), ValueError,
            ("local_embs has 5 rows", "not divisible by the world size 2")),
    BadCase("pooled_a2a/callbacks", lambda: PooledEmbeddingsAllToAll(_world(), [1, 1], callbacks=len), TypeError,
            ("callbacks must be a list of callables or None",)),
    BadCase("vb_a2a/dims", lambda: VariableBatchPooledEmbeddingsAllToAll(_world(), [[1]]), ValueError,
            ("emb_dim_per_rank_per_feature must have 2 rows", "got 1")),
    BadCase("seq_a2a/features", lambda: SequenceEmbeddingsAllToAll(_world(), [1, 1, 1]), ValueError,
            ("features_per_rank must have one entry per rank (2)", "got 3")),
    BadCase("seq_a2a/recat_missing",
            lambda: SequenceEmbeddingsAllToAll(_world(), [1, 1])(_f(2, 2), _i([1, 1]), [1, 1], [1, 1],
                                                                 batch_size_per_rank=[1, 2]),
            ValueError, ("batch_size_per_rank=[1, 2]", "sparse_features_recat", "got None")),
    # process-group helpers
    BadCase("invoke/rank", lambda: comm.invoke_on_rank_and_broadcast_result(_world(), 5, int), ValueError,
            ("rank must be an int in [0, 2) (the group size)", "rank=5")),
    BadCase("invoke/pg", lambda: comm.invoke_on_rank_and_broadcast_result(None, 0, int), TypeError,
            ("pg must be a torch.distributed.ProcessGroup", "NoneType")),
    BadCase("invoke/func", lambda: comm.invoke_on_rank_and_broadcast_result(_world(), 0, 3), TypeError,
            ("func must be callable", "int")),
]  # fmt: skip


def run_bad_input_cases(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """Case name -> (exception type name, message); ``("none", "")`` when the call did not raise."""
    assert world == WORLD
    outcomes = {}
    for case in BAD_CASES:
        try:
            case.call()
        except Exception as error:  # every exception is recorded; the test checks the type
            outcomes[case.name] = (type(error).__name__, str(error) or traceback.format_exc())
        else:
            outcomes[case.name] = ("none", "")
    return outcomes
