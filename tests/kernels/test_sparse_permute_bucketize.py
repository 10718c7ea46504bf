"""permute_2d/1d_sparse_data and block_bucketize_sparse_features: Triton (interpreter) vs twin, bit-exact;
hand-worked examples; FBGEMM parity when fbgemm_gpu is installed; bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from jagged_strategies import lengths_2d

from tritonrec.kernels import (
    block_bucketize_sparse_features,
    block_bucketize_sparse_features_reference,
    permute_1d_sparse_data,
    permute_2d_sparse_data,
    permute_2d_sparse_data_reference,
)


def _assert_all_equal(got: tuple, expected: tuple) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert (g is None) == (e is None)
        if g is not None:
            assert g.dtype == e.dtype and torch.equal(g, e), (g, e)


# ----------------------------------------------------------------------------------------------------------- permute
def test_permute_2d_example() -> None:
    # keys 0..2, B = 3 (torchrec's permute example): lengths [[0, 2, 0], [1, 1, 1], [0, 3, 0]]
    lengths = torch.tensor([[0, 2, 0], [1, 1, 1], [0, 3, 0]], dtype=torch.int32)
    values = torch.arange(1, 9)
    weights = torch.tensor([1.0, 0.5, 1.5, 1.0, 0.5, 1.0, 1.0, 1.5])
    for backend in ("triton", "torch"):
        out_lengths, out_values, out_weights = permute_2d_sparse_data(
            torch.tensor([1, 0, 2, 1]), lengths, values, weights, backend=backend
        )
        assert out_lengths.tolist() == [[1, 1, 1], [0, 2, 0], [0, 3, 0], [1, 1, 1]]
        assert out_values.tolist() == [3, 4, 5, 1, 2, 6, 7, 8, 3, 4, 5]
        assert out_weights.tolist() == [1.5, 1.0, 0.5, 1.0, 0.5, 1.0, 1.0, 1.5, 1.5, 1.0, 0.5]


@given(lengths_2d(), st.data())
def test_permute_2d_matches_twin(lengths: torch.Tensor, data: st.DataObject) -> None:
    num_keys = lengths.shape[0]
    permute = torch.tensor(
        data.draw(st.lists(st.integers(0, max(num_keys - 1, 0)), max_size=6 if num_keys else 0)), dtype=torch.int32
    )
    total = int(lengths.sum())
    width = data.draw(st.sampled_from([None, 1, 3]))
    values = torch.randint(0, 1000, (total,) if width is None else (total, width))
    weights = data.draw(st.sampled_from([None, torch.rand(total)]))
    got = permute_2d_sparse_data(permute, lengths, values, weights, backend="triton")
    _assert_all_equal(got, permute_2d_sparse_data_reference(permute, lengths, values, weights))
    # giving the output size explicitly (no sync) changes nothing
    sized = permute_2d_sparse_data(permute, lengths, values, weights, int(got[0].sum()), backend="triton")
    _assert_all_equal(sized, got)


def test_permute_1d_segments() -> None:
    lengths = torch.tensor([2, 0, 3])
    values = torch.arange(5)
    for backend in ("triton", "torch"):
        out_lengths, out_values, _ = permute_1d_sparse_data(torch.tensor([2, 0, 2]), lengths, values, backend=backend)
        assert out_lengths.tolist() == [3, 2, 3]
        assert out_values.tolist() == [2, 3, 4, 0, 1, 2, 3, 4]


def test_permute_bad_input() -> None:
    lengths = torch.tensor([[1, 2], [0, 1]])
    values = torch.arange(4)
    with pytest.raises(ValueError, match=r"permute out of range: permute\[1\] = 2 is outside \[0, 2\)"):
        permute_2d_sparse_data(torch.tensor([0, 2]), lengths, values)
    with pytest.raises(ValueError, match=r"lengths must be non-negative, got -1"):
        permute_2d_sparse_data(torch.tensor([0]), torch.tensor([[1, -1], [0, 1]]), values)
    with pytest.raises(ValueError, match=r"values has 3 rows but sum\(lengths\) = 4"):
        permute_2d_sparse_data(torch.tensor([0]), lengths, values[:3])
    with pytest.raises(ValueError, match=r"weights must have one row per value \(4\)"):
        permute_2d_sparse_data(torch.tensor([0]), lengths, values, torch.rand(3))
    with pytest.raises(TypeError, match="permute must be int32 or int64"):
        permute_2d_sparse_data(torch.tensor([0.0]), lengths, values)
    with pytest.raises(ValueError, match="lengths must have 2 dimension"):
        permute_2d_sparse_data(torch.tensor([0]), lengths.reshape(-1), values)
    with pytest.raises(ValueError, match="permuted_lengths_sum must be a non-negative int"):
        permute_2d_sparse_data(torch.tensor([0]), lengths, values, permuted_lengths_sum=-3)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("wrong_sum", [1, 7])
def test_permute_wrong_permuted_lengths_sum(backend: str, wrong_sum: int) -> None:
    # permute [1, 0, 1] of keys holding 1 + 2 and 0 + 3 values moves 3 + 3 + 3 = 9 values. The Triton path sizes its
    # output by permuted_lengths_sum: it used to return 1 value (silently truncated) or leave 7 rows unwritten.
    lengths = torch.tensor([[1, 2], [0, 3]], dtype=torch.int32)
    values, permute = torch.arange(6.0), torch.tensor([1, 0, 1])
    with pytest.raises(ValueError, match=rf"permuted_lengths_sum = {wrong_sum} but the permuted keys hold 9 values"):
        permute_2d_sparse_data(permute, lengths, values, permuted_lengths_sum=wrong_sum, backend=backend)
    with pytest.raises(ValueError, match="permuted_lengths_sum must be a non-negative int"):
        permute_2d_sparse_data(torch.tensor([1]), lengths, values, permuted_lengths_sum=True, backend=backend)
    out = permute_2d_sparse_data(permute, lengths, values, permuted_lengths_sum=9, backend=backend)
    assert out[1].tolist() == [3.0, 4.0, 5.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


# ------------------------------------------------------------------------------------------------------ bucketize
def test_bucketize_hand_example() -> None:
    # T = 1, B = 2, block size 4, 2 buckets: ids 5 -> (bucket 1, local 1), 1 -> (0, 1), 7 -> (1, 3);
    # 9 >= 4 * 2 is past the blocks: bucket 9 % 2 = 1, local 9 // 2 = 4
    lengths = torch.tensor([2, 2], dtype=torch.int32)
    indices = torch.tensor([5, 1, 7, 9])
    for backend in ("triton", "torch"):
        new_lengths, new_indices, _, new_pos, unbucketize = block_bucketize_sparse_features(
            lengths, indices, torch.tensor([4]), 2, bucketize_pos=True, sequence=True, backend=backend
        )
        assert new_lengths.tolist() == [1, 0, 1, 2]  # [bucket][feature][sample]
        assert new_indices.tolist() == [1, 1, 3, 4]
        assert new_pos.tolist() == [1, 0, 0, 1]
        assert unbucketize.tolist() == [1, 0, 2, 3]
        _, kept, *_ = block_bucketize_sparse_features(
            lengths, indices, torch.tensor([4]), 2, keep_orig_idx=True, backend=backend
        )
        assert kept.tolist() == [1, 5, 7, 9]


@st.composite
def bucketize_case(draw: st.DrawFn) -> dict:
    lengths = draw(lengths_2d(max_keys=3, max_batch=4, max_len=6))
    num_keys = lengths.shape[0]
    total = int(lengths.sum())
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return {
        "lengths": lengths.reshape(-1),
        "indices": torch.tensor(draw(st.lists(st.integers(0, 60), min_size=total, max_size=total)), dtype=index_dtype),
        "block_sizes": torch.tensor(draw(st.lists(st.integers(1, 12), min_size=num_keys, max_size=num_keys)),
                                    dtype=index_dtype),
        "num_buckets": draw(st.integers(1, 5)),
        "weights": draw(st.sampled_from([None, torch.rand(total)])),
        "bucketize_pos": draw(st.booleans()),
        "sequence": draw(st.booleans()),
        "keep_orig_idx": draw(st.booleans()),
    }  # fmt: skip


@given(bucketize_case())
def test_bucketize_matches_twin(case: dict) -> None:
    got = block_bucketize_sparse_features(**case, backend="triton")
    expected = block_bucketize_sparse_features_reference(**case)
    _assert_all_equal(got, expected)
    new_lengths, new_indices, new_weights, new_pos, unbucketize = expected
    # invariants: every index lands once; the inverse permutation restores the input order and in-bag positions
    assert int(new_lengths.sum()) == case["indices"].numel()
    if unbucketize is not None:
        assert sorted(unbucketize.tolist()) == list(range(case["indices"].numel()))
        if case["keep_orig_idx"]:
            assert torch.equal(new_indices[unbucketize], case["indices"])
        if case["weights"] is not None:
            assert torch.equal(new_weights[unbucketize], case["weights"])
        if new_pos is not None:
            lengths = case["lengths"].to(torch.int64)
            starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
            assert torch.equal(new_pos[unbucketize].to(torch.int64), torch.arange(starts.numel()) - starts)


def test_bucketize_many_buckets_and_long_bags() -> None:
    """Bags of 100+ indices over 130 buckets: each lane walks its bag through many (bucket, bag) cursors."""
    lengths = torch.tensor([150, 0, 37, 129], dtype=torch.int64)
    indices = torch.randint(0, 5000, (int(lengths.sum()),))
    case = {"lengths": lengths, "indices": indices, "block_sizes": torch.tensor([7, 31]), "num_buckets": 130,
            "bucketize_pos": True, "sequence": True}  # fmt: skip
    _assert_all_equal(
        block_bucketize_sparse_features(**case, backend="triton"), block_bucketize_sparse_features_reference(**case)
    )


def test_bucketize_any_bucket_count() -> None:
    """Past the 8192 buckets the old register-tile kernel stopped at: registers no longer grow with the count."""
    lengths = torch.tensor([3, 0, 5, 2], dtype=torch.int32)
    indices = torch.tensor([0, 9999, 123456, 5, 20000, 20001, 7, 99999, 1, 40000], dtype=torch.int32)
    case = {"lengths": lengths, "indices": indices, "block_sizes": torch.tensor([2, 3], dtype=torch.int32),
            "num_buckets": 20000, "weights": torch.rand(10), "bucketize_pos": True, "sequence": True}  # fmt: skip
    got = block_bucketize_sparse_features(**case, backend="triton")
    _assert_all_equal(got, block_bucketize_sparse_features_reference(**case))
    assert got[0].numel() == 20000 * 4 and int(got[0].sum()) == 10


def test_bucketize_matches_fbgemm() -> None:
    pytest.importorskip("fbgemm_gpu")
    gen = torch.Generator().manual_seed(3)
    for num_buckets in (1, 3, 8):
        lengths = torch.randint(0, 7, (4 * 6,), generator=gen, dtype=torch.int32)
        indices = torch.randint(0, 400, (int(lengths.sum()),), generator=gen)
        block_sizes = torch.tensor([10, 50, 3, 100])
        weights = torch.rand(indices.numel(), generator=gen)
        ours = block_bucketize_sparse_features(
            lengths, indices, block_sizes, num_buckets, weights, bucketize_pos=True, sequence=True
        )
        theirs = torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths, indices, True, True, block_sizes, num_buckets, weights
        )
        _assert_all_equal(ours, tuple(theirs))


def test_permute_matches_fbgemm() -> None:
    pytest.importorskip("fbgemm_gpu")
    lengths = torch.randint(0, 5, (5, 7), dtype=torch.int32)
    values = torch.randint(0, 99, (int(lengths.sum()),))
    weights = torch.rand(values.numel())
    permute = torch.tensor([4, 0, 0, 2], dtype=torch.int32)
    ours = permute_2d_sparse_data(permute, lengths, values, weights)
    theirs = torch.ops.fbgemm.permute_2D_sparse_data(permute, lengths, values, weights, None)
    _assert_all_equal(ours, tuple(theirs))


def test_bucketize_bad_input() -> None:
    lengths, indices, block_sizes = torch.tensor([1, 2]), torch.tensor([0, 5, 9]), torch.tensor([4])
    with pytest.raises(ValueError, match=r"indices must be non-negative, got -5 at position 1"):
        block_bucketize_sparse_features(lengths, torch.tensor([0, -5, 9]), block_sizes, 2)
    with pytest.raises(ValueError, match=r"block_sizes must be positive, got block_sizes\[0\] = 0"):
        block_bucketize_sparse_features(lengths, indices, torch.tensor([0]), 2)
    with pytest.raises(ValueError, match="num_buckets must be a positive int, got num_buckets=0"):
        block_bucketize_sparse_features(lengths, indices, block_sizes, 0)
    with pytest.raises(ValueError, match=r"sum\(lengths\) = 3 exceeds the number of indices \(2\)"):
        block_bucketize_sparse_features(lengths, indices[:2], block_sizes, 2)
    with pytest.raises(ValueError, match="lengths has 3 entries, not a multiple of the number of features"):
        block_bucketize_sparse_features(torch.tensor([1, 1, 1]), indices, torch.tensor([4, 4]), 2)
    with pytest.raises(ValueError, match="lengths must be non-negative"):
        block_bucketize_sparse_features(torch.tensor([4, -1]), indices, block_sizes, 2)
    with pytest.raises(ValueError, match=r"weights must have one entry per index \(3\)"):
        block_bucketize_sparse_features(lengths, indices, block_sizes, 2, weights=torch.rand(2))
    with pytest.raises(TypeError, match="indices must be int32 or int64"):
        block_bucketize_sparse_features(lengths, indices.float(), block_sizes, 2)


@pytest.mark.parametrize("num_values", [7000, 40000])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_bucketize_twin_sort_paths_match_fbgemm(num_values: int, index_dtype: torch.dtype) -> None:
    """Sizes where the twin pads its sort up to torch's radix path (7000) or sorts int8 keys directly (40000), with
    ids past the sharded range (round-robin) and per-feature block sizes."""
    pytest.importorskip("fbgemm_gpu")
    gen = torch.Generator().manual_seed(num_values)
    lengths = torch.randint(0, 9, (2 * (num_values // 8),), generator=gen, dtype=torch.int32)
    indices = torch.randint(0, 5000, (int(lengths.sum()),), generator=gen, dtype=index_dtype)
    weights = torch.rand(indices.numel(), generator=gen)
    for block_sizes in (torch.tensor([400, 400]), torch.tensor([300, 700])):
        block_sizes = block_sizes.to(index_dtype)
        ours = block_bucketize_sparse_features(
            lengths, indices, block_sizes, 11, weights, bucketize_pos=True, sequence=True, backend="torch"
        )
        theirs = torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths, indices, True, True, block_sizes, 11, weights
        )
        _assert_all_equal(ours, tuple(theirs))
