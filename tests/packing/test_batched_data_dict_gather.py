"""BatchedDataDict.all_gather on real gloo ranks holding different numbers of rows (one spawn for every case)."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from packing.batch_gather_ranks import gather_cases

pytestmark = pytest.mark.dist


def test_all_gather_jagged_rows() -> None:
    results = run_ranks(gather_cases, 3)
    expected_ids = [0, 10, 11, 20, 21, 22]
    for result in results:
        assert result["type"] == "BatchedDataDict"
        assert result["ids"] == expected_ids
        assert result["hidden"] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        assert result["hidden_shape"] == (6, 2, 3)
        assert result["tags"] == ["r0.0", "r1.0", "r1.1", "r2.0", "r2.1", "r2.2"]
        assert result["shape_error"].startswith("ValueError: key 'x' needs the same trailing shape and dtype")
        assert result["key_error"].startswith("ValueError: all_gather needs the same keys on every rank")
        assert result["kind_error"] == "TypeError: key 'x' is a tensor on some ranks and a list on others"
