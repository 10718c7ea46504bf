"""``check_index_bounds`` (the sharded modules' FATAL bounds check) in one process: it finds the first index outside
its feature's table in value order, whether the features share one row count (one span) or not, and skips the
features it is not asked to check."""

from __future__ import annotations

import re

import pytest
import torch

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.embeddingbag import check_index_bounds

KEYS = ["f0", "f1", "f2", "f3"]
LENGTHS = [2, 1, 0, 2, 1, 1, 3, 0]  # batch 2: f0 [2, 1], f1 [0, 2], f2 [1, 1], f3 [3, 0]


def kjt(values: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(KEYS, torch.tensor(values), lengths=torch.tensor(LENGTHS))


def reference_culprit(values: list[int], limits: dict[str, int]) -> tuple[int, str] | None:
    """First (value, key) out of its key's ``[0, rows)`` in value order, by a plain loop."""
    per_key = [sum(LENGTHS[2 * k : 2 * k + 2]) for k in range(len(KEYS))]
    keys = [key for key, n in zip(KEYS, per_key, strict=True) for _ in range(n)]
    for value, key in zip(values, keys, strict=True):
        if key in limits and not 0 <= value < limits[key]:
            return value, key
    return None


GOOD = [0, 9, 3, 5, 1, 2, 0, 1, 6, 7]
CASES = {
    "all_in_range_shared_rows": (GOOD, dict.fromkeys(KEYS, 10)),
    "last_value_too_big": ([*GOOD[:-1], 10], dict.fromkeys(KEYS, 10)),
    "negative_first": ([-1, *GOOD[1:]], dict.fromkeys(KEYS, 10)),
    "first_bad_in_value_order": ([0, 9, 3, 5, 1, 2, 0, 12, 6, -3], dict.fromkeys(KEYS, 10)),
    "mixed_rows_second_span": (GOOD, {"f0": 10, "f1": 4, "f2": 10, "f3": 10}),
    "mixed_rows_all_fine": (GOOD, {"f0": 10, "f1": 6, "f2": 3, "f3": 8}),
    "unchecked_key_skipped": ([0, 9, 3, 55, 1, 2, 0, 1, 6, 7], {"f0": 10, "f2": 10, "f3": 10}),
    "unchecked_between_checked": ([0, 9, 3, 55, 1, 2, 0, 1, 6, 17], {"f0": 10, "f2": 10, "f3": 10}),
    "empty_feature_in_span": (GOOD, {"f0": 10, "f2": 3}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_index_bounds_names_the_first_culprit(case: str) -> None:
    values, limits = CASES[case]
    culprit = reference_culprit(values, limits)
    if culprit is None:
        check_index_bounds(kjt(values), limits)
        return
    value, key = culprit
    expected = f"index {value} of feature '{key}' is outside its table's [0, {limits[key]}) rows"
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_index_bounds(kjt(values), limits)


def test_check_index_bounds_without_checked_values_is_a_no_op() -> None:
    check_index_bounds(kjt([-5] * 10), {})
    empty = KeyedJaggedTensor(KEYS, torch.tensor([], dtype=torch.int64), lengths=torch.zeros(8, dtype=torch.int64))
    check_index_bounds(empty, dict.fromkeys(KEYS, 1))


def test_a_shared_feature_is_bounded_by_the_smallest_table_reading_it() -> None:
    from tritonrec.dist.embeddingbag import feature_row_limits
    from tritonrec.modules import EmbeddingBagConfig

    configs = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=2, name="big", feature_names=["f0", "f1"]),
        EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="small", feature_names=["f1"]),
    ]
    limits = feature_row_limits(configs)
    assert limits == {"f0": 10, "f1": 4}
    # f1's 5 fits "big" but not "small": row-wise bucketizing would send it past "small"'s last block
    values = [0, 9, 3, 1, 5, 2, 0, 1, 6, 7]
    with pytest.raises(ValueError, match=re.escape("index 5 of feature 'f1' is outside its table's [0, 4) rows")):
        check_index_bounds(kjt(values), limits)
