"""Every comm op on real gloo ranks (2 and 4): forward equals a single-process reference built from all ranks'
inputs, gradients equal the reference's autograd gradients (divided by the world size under gradient division), both
exactly (integer-valued fp32 data, so even the reductions are exact). Cases include uneven and zero-size splits and
variable batch per rank and per feature; see comm_cases.py (the spawn itself: spawned.py).
"""

from __future__ import annotations

import pytest

from tests.distributed.comm_cases import build_op_cases
from tests.distributed.spawned import suite_results
from tritonrec.dist.comm_ops import get_gradient_division, set_gradient_division

pytestmark = pytest.mark.dist

CASE_NAMES = [case.name for case in build_op_cases(2)]


def test_cases_are_the_same_for_every_world_size() -> None:
    assert [case.name for case in build_op_cases(4)] == CASE_NAMES


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case_name", CASE_NAMES)
def test_forward_and_gradients_equal_reference(case_name: str, world: int) -> None:
    for rank, results in enumerate(suite_results("ops", world)):
        result = results[case_name]
        assert result["forward"]["exact"], f"rank {rank} forward: {result['forward']['detail']}"
        assert result["grad"]["exact"], f"rank {rank} gradient: {result['grad']['detail']}"
        assert result["launched_before_wait"], f"rank {rank}: the collective was not launched by the call"


@pytest.mark.parametrize("world", [2, 4])
def test_zero_size_blocks_are_really_exercised(world: int) -> None:
    """The uneven cases do send empty blocks: some rank has zero columns, and a zero split goes on the wire."""
    results = suite_results("ops", world)
    shapes = [r["alltoall_pooled/uneven_batch_zero_dims"]["input_shapes"][0] for r in results]
    assert any(cols == 0 for _, cols in shapes), shapes
    traffic = results[0]["reduce_scatter_v_pooled/uneven"]["traffic"][0]
    assert 0 in traffic["send"], traffic


@pytest.mark.parametrize("world", [2, 4])
def test_request_semantics(world: int) -> None:
    for rank, results in enumerate(suite_results("ops", world)):
        semantics = results["request_semantics"]
        assert all(semantics.values()), f"rank {rank}: {semantics}"


def test_gradient_division_setting() -> None:
    previous = get_gradient_division()
    try:
        set_gradient_division(False)
        assert get_gradient_division() is False
        with pytest.raises(TypeError, match=r"val must be a bool, got int: val=1"):
            set_gradient_division(1)  # type: ignore[arg-type]
    finally:
        set_gradient_division(previous)
    assert get_gradient_division() is previous
