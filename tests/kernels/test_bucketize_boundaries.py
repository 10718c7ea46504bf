"""block_bucketize_sparse_features with per-feature row boundaries (``block_bucketize_pos``, FBGEMM's argument for
uneven row-wise shards): Triton (interpreter) vs twin bit-exact, both against a plain per-index Python loop and a
hand-worked example (FBGEMM 1.8 gives the same outputs, checked outside the suite), empty blocks (a rank without
rows), ids past the last boundary, the twin's per-feature search where shifted ids would overflow, the weights
gradient, and bad boundaries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from jagged_strategies import lengths_2d

from tritonrec.kernels import block_bucketize_sparse_features, block_bucketize_sparse_features_reference

BACKENDS = ["torch", "triton"]


def loop_reference(
    lengths: list[int], indices: list[int], bounds: list[list[int]], num_buckets: int, keep_orig_idx: bool
) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(new_lengths, new_indices, new_pos, unbucketize)`` by one Python loop over the ids: id ``i`` of a bag of
    feature ``t`` goes to the last bucket ``p`` with ``bounds[t][p] <= i`` while ``i < bounds[t][-1]``, else to
    ``i % num_buckets`` (local ``i // num_buckets``); outputs ordered by (bucket, bag, position in bag)."""
    batch = len(lengths) // max(len(bounds), 1)
    placed: list[list[list[tuple[int, int, int]]]] = [[[] for _ in lengths] for _ in range(num_buckets)]
    j = 0
    for bag, length in enumerate(lengths):
        pos = bounds[bag // batch]
        for k in range(length):
            i = indices[j]
            if i < pos[num_buckets]:
                p = max(q for q in range(num_buckets) if pos[q] <= i)
                local = i - pos[p]
            else:
                p, local = i % num_buckets, i // num_buckets
            placed[p][bag].append((i if keep_orig_idx else local, j, k))
            j += 1
    new_lengths = [len(placed[p][bag]) for p in range(num_buckets) for bag in range(len(lengths))]
    flat = [entry for per_bag in placed for entries in per_bag for entry in entries]
    unbucketize = [0] * len(flat)
    for out, (_, source, _) in enumerate(flat):
        unbucketize[source] = out
    return new_lengths, [e[0] for e in flat], [e[2] for e in flat], unbucketize


def _assert_all_equal(got: tuple, expected: tuple) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert (g is None) == (e is None)
        if g is not None:
            assert g.dtype == e.dtype and torch.equal(g, e), (g, e)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_example(backend: str) -> None:
    # feature 0 rows [0, 5) on bucket 0, none on 1, [5, 10) on 2; feature 1 none on 0, [0, 3) on 1, [3, 8) on 2
    lengths, indices = torch.tensor([3, 2, 2, 1]), torch.tensor([0, 5, 9, 10, 4, 7, 12, 2])
    bounds = [torch.tensor([0, 5, 5, 10]), torch.tensor([0, 0, 3, 8])]
    block_sizes = torch.tensor([4, 4])  # unused with boundaries
    out = block_bucketize_sparse_features(
        lengths, indices, block_sizes, 3, bucketize_pos=True, sequence=True, block_bucketize_pos=bounds, backend=backend
    )
    assert out[0].tolist() == [1, 1, 1, 0, 0, 1, 0, 1, 2, 0, 1, 0]
    assert out[1].tolist() == [0, 4, 4, 3, 2, 0, 4, 4]  # 10 and 12 are past the rows: round-robin
    assert out[3].tolist() == [0, 1, 1, 0, 0, 1, 2, 0]
    assert out[4].tolist() == [0, 5, 6, 3, 1, 7, 2, 4]
    kept = block_bucketize_sparse_features(
        lengths, indices, block_sizes, 3, keep_orig_idx=True, block_bucketize_pos=bounds, backend=backend
    )
    assert kept[1].tolist() == [0, 4, 12, 10, 2, 5, 9, 7]


@st.composite
def boundaries_case(draw: st.DrawFn) -> dict:
    lengths = draw(lengths_2d(max_keys=3, max_batch=4, max_len=6))
    num_keys, total = lengths.shape[0], int(lengths.sum())
    num_buckets = draw(st.integers(1, 5))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    bounds = []
    for _ in range(num_keys):  # empty blocks likely (ranks without rows)
        sizes = draw(st.lists(st.sampled_from([0, 0, 1, 2, 5, 9]), min_size=num_buckets, max_size=num_buckets))
        bounds.append([sum(sizes[:p]) for p in range(num_buckets + 1)])
    return {
        "lengths": lengths.reshape(-1),
        "indices": torch.tensor(draw(st.lists(st.integers(0, 50), min_size=total, max_size=total)), dtype=index_dtype),
        "block_sizes": torch.ones(num_keys, dtype=index_dtype),
        "num_buckets": num_buckets,
        "weights": draw(st.sampled_from([None, torch.rand(total)])),
        "bucketize_pos": draw(st.booleans()),
        "sequence": draw(st.booleans()),
        "keep_orig_idx": draw(st.booleans()),
        "block_bucketize_pos": torch.tensor(bounds, dtype=torch.int64).reshape(num_keys, num_buckets + 1),
    }


@given(boundaries_case())
def test_triton_and_twin_match_a_loop(case: dict) -> None:
    got = block_bucketize_sparse_features(**case, backend="triton")
    twin = block_bucketize_sparse_features_reference(**case)
    _assert_all_equal(got, twin)
    new_lengths, new_indices, new_pos, unbucketize = loop_reference(
        case["lengths"].tolist(),
        case["indices"].tolist(),
        case["block_bucketize_pos"].tolist(),
        case["num_buckets"],
        case["keep_orig_idx"],
    )
    assert twin[0].tolist() == new_lengths and twin[1].tolist() == new_indices
    assert twin[0].dtype == case["lengths"].dtype and twin[1].dtype == case["indices"].dtype
    if case["bucketize_pos"]:
        assert twin[3].tolist() == new_pos
    if case["sequence"]:
        assert twin[4].tolist() == unbucketize
    if case["weights"] is not None:
        assert torch.equal(twin[2], case["weights"][torch.tensor(unbucketize, dtype=torch.int64).argsort()])


@pytest.mark.parametrize("backend", BACKENDS)
def test_list_and_tensor_boundaries_agree_with_a_loop_on_many_buckets(backend: str) -> None:
    """40 buckets, half of them empty, bags of 30+ ids: the binary search walks 6 halvings per id."""
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 6, (2, 40), generator=gen) * (torch.rand(2, 40, generator=gen) < 0.5)
    bounds = torch.cat([torch.zeros(2, 1, dtype=torch.int64), sizes.cumsum(1)], dim=1)
    lengths = torch.tensor([31, 0, 45, 12, 38, 3])
    indices = torch.randint(0, 150, (int(lengths.sum()),), generator=gen)
    args = (lengths, indices, torch.tensor([7, 7]), 40)
    as_tensor = block_bucketize_sparse_features(*args, sequence=True, block_bucketize_pos=bounds, backend=backend)
    as_list = block_bucketize_sparse_features(*args, sequence=True, block_bucketize_pos=list(bounds), backend=backend)
    _assert_all_equal(as_tensor, as_list)
    expected = loop_reference(lengths.tolist(), indices.tolist(), bounds.tolist(), 40, False)
    assert (as_tensor[0].tolist(), as_tensor[1].tolist(), as_tensor[4].tolist()) == (
        expected[0],
        expected[1],
        expected[3],
    )


def test_twin_searches_per_feature_where_shifted_ids_would_overflow() -> None:
    """Ids near 2**61 over 3 features: ``T * span`` passes 2**62, so the twin searches each feature on its own."""
    big = 2**61
    lengths = torch.tensor([2, 1, 2])
    indices = torch.tensor([big + 5, 3, big - 1, 7, big])
    bounds = torch.tensor([[0, 10, big], [0, 0, 4], [0, big, big + 1]])
    case = {"lengths": lengths, "indices": indices, "block_sizes": torch.ones(3, dtype=torch.int64), "num_buckets": 2,
            "sequence": True, "block_bucketize_pos": bounds}  # fmt: skip
    twin = block_bucketize_sparse_features_reference(**case)
    _assert_all_equal(block_bucketize_sparse_features(**case, backend="triton"), twin)
    expected = loop_reference(lengths.tolist(), indices.tolist(), bounds.tolist(), 2, False)
    assert (twin[0].tolist(), twin[1].tolist(), twin[4].tolist()) == (expected[0], expected[1], expected[3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_gradient_follows_the_boundaries(backend: str) -> None:
    lengths, indices = torch.tensor([3, 1, 2, 2]), torch.tensor([6, 0, 2, 5, 1, 4, 0, 3])
    bounds = torch.tensor([[0, 2, 6], [0, 4, 4]])
    weights = torch.rand(8, dtype=torch.float64, requires_grad=True)
    _, _, new_weights, _, _ = block_bucketize_sparse_features(
        lengths, indices, torch.ones(2, dtype=torch.int64), 2, weights, block_bucketize_pos=bounds, backend=backend
    )
    grad_out = torch.arange(1.0, 9.0, dtype=torch.float64)
    (new_weights * grad_out).sum().backward()
    unbucketize = loop_reference(lengths.tolist(), indices.tolist(), bounds.tolist(), 2, False)[3]
    assert torch.equal(weights.grad, grad_out[torch.tensor(unbucketize)])


def test_empty_batch_and_no_ids() -> None:
    for backend in BACKENDS:
        out = block_bucketize_sparse_features(
            torch.zeros(4, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.ones(2, dtype=torch.int64), 3,
            sequence=True, block_bucketize_pos=torch.tensor([[0, 1, 1, 2], [0, 0, 0, 0]]), backend=backend,
        )  # fmt: skip
        assert out[0].tolist() == [0] * 12 and out[1].numel() == 0 and out[4].numel() == 0


@pytest.mark.parametrize(
    ("bounds", "error", "message"),
    [
        ([torch.tensor([0, 2, 4])], ValueError, r"block_bucketize_pos must hold one tensor per feature \(2"),
        (torch.tensor([[0, 2, 4]]), ValueError, r"block_bucketize_pos must have shape \[T=2, num_buckets \+ 1=3\]"),
        (torch.tensor([0, 2, 4]), ValueError, r"block_bucketize_pos must have 2 dimension"),
        (
            [torch.tensor([0, 2]), torch.tensor([0, 1, 2])],
            ValueError,
            r"block_bucketize_pos\[0\] must hold .* 3 .*\[0, 2\]",
        ),
        ([torch.tensor([0, 2, 4]), torch.tensor([0.0, 1, 2])], TypeError, r"block_bucketize_pos\[1\] must be int32"),
        ("0, 2, 4", TypeError, r"block_bucketize_pos must be a list of tensors or a tensor, got str"),
        (torch.tensor([[0, 2, 4], [1, 2, 3]]), ValueError, r"block_bucketize_pos\[1\] must start at 0 .*\[1, 2, 3\]"),
        (
            torch.tensor([[0, 5, 4], [0, 2, 3]]),
            ValueError,
            r"block_bucketize_pos\[0\] must be non-decreasing .*\[0, 5, 4\]",
        ),
    ],
)
def test_bad_boundaries_name_the_argument(bounds: object, error: type, message: str) -> None:
    lengths, indices = torch.tensor([1, 1]), torch.tensor([0, 1])
    for backend in BACKENDS:
        with pytest.raises(error, match=message):
            block_bucketize_sparse_features(
                lengths, indices, torch.ones(2, dtype=torch.int64), 2, block_bucketize_pos=bounds, backend=backend
            )
