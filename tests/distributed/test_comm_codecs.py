"""Every comm op through every codec ``get_qcomm_codecs`` builds (2 gloo ranks): outputs and gradients within that
codec's error bound, and split sizes on the wire equal to ``calc_quantized_size`` of the padded per-rank blocks.
Bounds and their derivation: codec_cases.py.
"""

from __future__ import annotations

import pytest

from tests.distributed.codec_cases import CODECS, codec_op_cases
from tests.distributed.spawned import suite_results

pytestmark = pytest.mark.dist

WORLD = 2
CASE_NAMES = [case.name for case in codec_op_cases(WORLD)]


@pytest.mark.parametrize("case_name", CASE_NAMES)
@pytest.mark.parametrize("codec", list(CODECS))
def test_outputs_within_codec_bound(codec: str, case_name: str) -> None:
    _, forward_bound, backward_bound = CODECS[codec]
    for rank, results in enumerate(suite_results("codecs", WORLD)):
        result = results[codec][case_name]
        allowed_forward = result["forward_sums"] * forward_bound
        allowed_grad = result["backward_sums"] * backward_bound / (WORLD if result["division"] else 1)
        assert result["forward_err"] <= allowed_forward, f"rank {rank}: forward error {result['forward_err']}"
        assert result["grad_err"] <= allowed_grad, f"rank {rank}: gradient error {result['grad_err']}"
        if codec == "fp32":
            assert result["forward_exact"], f"rank {rank}: the fp32 codec must not change values"


@pytest.mark.parametrize("codec", list(CODECS))
def test_wire_sizes_equal_calc_quantized_size(codec: str) -> None:
    for rank, results in enumerate(suite_results("codecs", WORLD)):
        wire = results[codec]["wire"]
        checks = {name: ok for name, ok in wire.items() if name != "detail"}
        assert all(checks.values()), f"rank {rank}: {checks} {wire['detail']}"
