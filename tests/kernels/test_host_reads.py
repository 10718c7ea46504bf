"""How often an op reads a device value back to the host (``.item()``, ``.tolist()``, ``int(t)``, ...). On a GPU each
read is a sync that drains the launch queue: the first H200 profile (benchmarks/profile_gpu_ops.py) showed
``permute_2d_sparse_data`` spending half its 0.5 ms call in 9 of them. The Triton paths now read once per call: the
value checks gather everything they test into one read, and the permute's output size comes with it. Counted here
on CPU tensors under the interpreter, where each read is the same Python call it is on a GPU, with the ops told
that reads are not free (on real CPU tensors they skip the batching, which only adds work there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tritonrec.kernels import block_bucketize_sparse_features, checks, lengths_to_offsets, permute_2d_sparse_data
from tritonrec.kernels.checks import set_value_checks

_READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


@contextmanager
def counted_reads() -> Iterator[list[int]]:
    """Counts every tensor -> Python conversion while the block runs."""
    calls = [0]
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            calls[0] += 1
            return original(self, *args, **kwargs)

        return read

    for name in _READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture(autouse=True)
def accelerator_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' accelerator path: every read is a sync, so they batch them."""
    monkeypatch.setattr(checks, "reads_are_free", lambda t: False)


@pytest.fixture
def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 5, (4, 3), generator=g, dtype=torch.int32)
    n = int(lengths.sum())
    return {"lengths": lengths, "values": torch.arange(n), "weights": torch.rand(n, generator=g)}


@pytest.mark.parametrize(("checks", "expected"), [(True, 1), (False, 1)])
def test_permute_reads_the_host_once(inputs: dict[str, torch.Tensor], checks: bool, expected: int) -> None:
    """Checks on: their one read also yields the output size. Off: the size alone (it shapes the output)."""
    permute = torch.tensor([2, 0, 3, 2], dtype=torch.int32)
    set_value_checks(checks)
    try:
        with counted_reads() as reads:
            out = permute_2d_sparse_data(
                permute, inputs["lengths"], inputs["values"], inputs["weights"], backend="triton"
            )
    finally:
        set_value_checks(None)
    assert reads[0] == expected
    expected_lengths = inputs["lengths"][permute.long()]
    assert torch.equal(out[0], expected_lengths) and out[1].numel() == int(expected_lengths.sum())
    size = int(expected_lengths.sum())
    with counted_reads() as reads:  # a caller who knows the size: no read for it
        permute_2d_sparse_data(permute, inputs["lengths"], inputs["values"], None, size, backend="triton")
    assert reads[0] == 1  # the checks' read


@pytest.mark.parametrize(("checks", "expected"), [(True, 1), (False, 0)])
def test_bucketize_and_offsets_read_the_host_at_most_once(
    inputs: dict[str, torch.Tensor], checks: bool, expected: int
) -> None:
    lengths = inputs["lengths"].reshape(-1)
    set_value_checks(checks)
    try:
        with counted_reads() as reads:
            block_bucketize_sparse_features(lengths, inputs["values"], torch.full((4,), 10), 2, inputs["weights"],
                                            True, True, backend="triton")  # fmt: skip
        bucketize_reads = reads[0]
        with counted_reads() as reads:
            lengths_to_offsets(lengths, backend="triton")
    finally:
        set_value_checks(None)
    assert (bucketize_reads, reads[0]) == (expected, expected)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"permute": [0, 4]}, r"permute out of range: permute\[1\] = 4 is outside \[0, 4\)"),
        ({"permute": [-1, 0]}, r"permute out of range: permute\[0\] = -1"),
        ({"negative_at": 5}, r"lengths must be non-negative, got -1 at position 5"),
        ({"short_values": True}, r"values has \d+ rows but sum\(lengths\) = \d+"),
    ],
)
def test_the_one_read_still_names_each_bad_input(inputs: dict[str, torch.Tensor], change: dict, message: str) -> None:
    lengths, values = inputs["lengths"].clone(), inputs["values"]
    permute = torch.tensor(change.get("permute", [1, 0]), dtype=torch.int32)
    if "negative_at" in change:
        lengths.view(-1)[change["negative_at"]] = -1
    if change.get("short_values"):
        values = values[:-1]
    with pytest.raises(ValueError, match=message):
        permute_2d_sparse_data(permute, lengths, values, backend="triton")


def test_fused_backward_reads_the_host_once() -> None:
    """The backward plan of a fused rowwise-Adagrad lookup with repeated rows: one read (each table's first unique
    row and contribution, together). Its duplicate count follows from sizes the host knows, and the optimizer's
    float32 hyper-parameters are rounded without tensors."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, OptimType

    tables = [EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name=f"t{t}", feature_names=[f"f{t}"])
              for t in range(3)]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="triton")
    lengths = torch.tensor([3, 0, 2, 4, 1, 2], dtype=torch.int32)  # 12 ids over 6 rows per table: rows repeat
    ids = torch.tensor([1, 1, 5, 0, 1, 2, 2, 2, 3, 4, 4, 0])
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], ids, lengths=lengths)
    before = [p.detach().clone() for p in ebc.parameters()]
    out = ebc(kjt).values()
    with counted_reads() as reads:
        out.sum().backward()
    assert reads[0] == 1
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, ebc.parameters(), strict=True))  # it updated


def test_on_cpu_tensors_the_checks_stay_plain(inputs: dict[str, torch.Tensor], monkeypatch) -> None:
    """Real CPU tensors (reads are free): permute's plain checks, without the reductions that batch them (which
    also read the permuted size: returned only on the accelerator path). Same results, same errors."""
    from tritonrec.kernels.permute_sparse import _check_permute_values

    permute = torch.tensor([2, 0, 3, 2], dtype=torch.int32)
    expected = int(inputs["lengths"][permute.long()].sum())
    assert _check_permute_values(permute, inputs["lengths"], inputs["values"]) == expected  # accelerator path
    monkeypatch.setattr(checks, "reads_are_free", lambda t: t.device.type == "cpu")
    assert _check_permute_values(permute, inputs["lengths"], inputs["values"]) is None
    out = permute_2d_sparse_data(permute, inputs["lengths"], inputs["values"], inputs["weights"], backend="triton")
    assert torch.equal(out[0], inputs["lengths"][permute.long()]) and out[1].numel() == expected
    with pytest.raises(ValueError, match=r"permute out of range: permute\[1\] = 4"):
        permute_2d_sparse_data(torch.tensor([0, 4]), inputs["lengths"], inputs["values"], backend="triton")


def test_pooled_forward_reads_the_host_twice() -> None:
    """The forward: one read for the offsets' checks with each feature's first value, one for the id range."""
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, OptimType

    tables = [EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name=f"t{t}", feature_names=[f"f{t}"])
              for t in range(3)]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="triton")
    twin = FusedEmbeddingBagCollection(tables, OptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1}, backend="torch")
    twin.load_state_dict(ebc.state_dict())
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], torch.tensor([1, 1, 5, 0, 1, 2, 2, 2, 3, 4, 4, 0]),
                            lengths=torch.tensor([3, 0, 2, 4, 1, 2], dtype=torch.int32))  # fmt: skip
    kjt.offsets()  # the KJT's own offsets (one read of their checks), as a batch brings them
    with counted_reads() as reads:
        out = ebc(kjt).values()
    assert reads[0] == 2
    torch.testing.assert_close(out, twin(kjt).values())


@pytest.mark.parametrize(
    ("offsets", "divisors", "message"),
    [
        ([0, 3, 3, 5, 9, 8, 12], None, r"offsets must be non-decreasing, got offsets\[4\] = 9 > offsets\[5\] = 8"),
        ([1, 3, 3, 5, 9, 10, 12], None, r"offsets must start at 0, got offsets\[0\] = 1"),
        ([0, 3, 3, 5, 9, 10, 11], None, r"offsets must end at 12"),
        ([0, 3, 3, 5, 9, 10, 12], [1.0, 0.0, 2.0, 0.0, 1.0, 2.0], r"bag_divisors must be positive .*bag_divisors\[3\]"),
    ],
)
def test_the_forward_read_still_names_each_bad_offset(offsets: list, divisors: list | None, message: str) -> None:
    from tritonrec.kernels.embedding.op_checks import checked_feature_starts

    good = checked_feature_starts(torch.tensor([0, 3, 3, 5, 9, 10, 12]), None, 12, 3, 2)
    assert good == [0, 3, 9, 12]
    bag_divisors = None if divisors is None else torch.tensor(divisors)
    with pytest.raises(ValueError, match=message):
        checked_feature_starts(torch.tensor(offsets), bag_divisors, 12, 3, 2)
