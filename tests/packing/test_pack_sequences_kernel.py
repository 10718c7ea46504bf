"""Pack / unpack: the Triton kernels (interpreter on CPU) against the torch twin bit for bit, the twin against a
per-sequence loop, exact round trips, gradients, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.kernels.pack_sequences import (
    PackingPlan,
    bin_assignment,
    make_packing_plan,
    pack_sequences,
    unpack_sequences,
)


def loop_reference(values: torch.Tensor, plan: PackingPlan, padding_value: float) -> tuple:
    """The packed layout written sequence by sequence (what the vectorised twin must equal)."""
    feature = values.shape[2:] if plan.padded_len is not None else values.shape[1:]
    rows = plan.num_bins * plan.capacity if plan.capacity is not None else plan.num_slot_tokens
    tokens = torch.full((rows, *feature), padding_value, dtype=values.dtype)
    positions = torch.zeros(rows, dtype=torch.int64)
    segments = torch.full((rows,), -1, dtype=torch.int32)
    for b in range(plan.num_bins):
        cursor = b * plan.capacity if plan.capacity is not None else int(plan.cu_seqlens[plan.bin_offsets[b]])
        for segment, j in enumerate(range(int(plan.bin_offsets[b]), int(plan.bin_offsets[b + 1]))):
            seq = int(plan.sequence_order[j])
            length = int(plan.source_lengths[seq])
            slot = -(-length // plan.pad_to_multiple) * plan.pad_to_multiple
            if plan.padded_len is not None:
                tokens[cursor : cursor + length] = values[seq, :length]
            else:
                start = int(plan.source_starts[seq])
                tokens[cursor : cursor + length] = values[start : start + length]
            positions[cursor : cursor + slot] = torch.arange(slot)
            segments[cursor : cursor + slot] = segment
            cursor += slot
    if plan.capacity is not None:
        return (
            tokens.reshape(plan.num_bins, plan.capacity, *feature),
            positions.reshape(-1, plan.capacity),
            segments.reshape(-1, plan.capacity),
        )
    return tokens, positions, segments


def make_case(
    lengths: list[int],
    bins: list[list[int]],
    jagged: bool,
    feature: tuple[int, ...],
    dtype: torch.dtype,
    capacity: int | None,
    pad: int,
):
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    order, bin_offsets = bin_assignment(bins)
    gen = torch.Generator().manual_seed(sum(lengths) + len(bins))
    if jagged:
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths_t, 0)
        shape = (int(offsets[-1]) + 2, *feature)  # two trailing rows past offsets[-1] are never read
        plan = make_packing_plan(order, bin_offsets, offsets=offsets, capacity=capacity, pad_to_multiple=pad)
    else:
        width = max(lengths, default=0) + 1
        shape = (len(lengths), width, *feature)
        plan = make_packing_plan(
            order, bin_offsets, lengths=lengths_t, padded_len=width, capacity=capacity, pad_to_multiple=pad
        )
    values = (
        (torch.randint(-50, 50, shape, generator=gen)).to(dtype)
        if dtype != torch.bool
        else torch.randint(0, 2, shape, generator=gen).bool()
    )
    return values, plan


def expected_source(values: torch.Tensor, plan: PackingPlan, padding_value: float) -> torch.Tensor:
    """What unpacking the packed tokens must give back: the values, padding past each length."""
    if plan.padded_len is None:
        return values[: plan.num_source_rows]
    past = torch.arange(plan.padded_len)[None, :] >= plan.source_lengths[:, None]
    restored = values.clone()
    restored[past] = padding_value
    return restored


def check_case(values: torch.Tensor, plan: PackingPlan, padding_value: float = -3.0) -> None:
    torch_result = pack_sequences(values, plan, padding_value, backend="torch")
    triton_result = pack_sequences(values, plan, padding_value, backend="triton")
    reference = loop_reference(values, plan, padding_value)
    for got, want, expected in zip(triton_result[:3], torch_result[:3], reference, strict=True):
        assert torch.equal(got, want)
        assert torch.equal(want, expected)
    for backend in ("torch", "triton"):
        restored = unpack_sequences(torch_result.tokens, plan, padding_value, backend=backend)
        assert torch.equal(restored, expected_source(values, plan, padding_value))


LENGTHS = [3, 0, 7, 2, 5]
BINS = [[2], [0, 4, 1], [], [3]]


@pytest.mark.parametrize("jagged", [False, True], ids=["padded", "jagged"])
@pytest.mark.parametrize("capacity", [None, 12], ids=["flat", "bins"])
@pytest.mark.parametrize("pad", [1, 3])
@pytest.mark.parametrize(
    "feature, dtype",
    [((), torch.int64), ((5,), torch.float32), ((2, 3), torch.bfloat16), ((), torch.bool)],
    ids=["ids-int64", "hidden-fp32", "rank4-bf16", "mask-bool"],
)
def test_kernel_matches_twin(jagged: bool, capacity: int | None, pad: int, feature: tuple, dtype: torch.dtype) -> None:
    if capacity is not None and pad == 3:
        capacity = 15  # bin 1 needs 3 + 6 + 0 slots
    values, plan = make_case(LENGTHS, BINS, jagged, feature, dtype, capacity, pad)
    check_case(values, plan, padding_value=0 if dtype == torch.bool else -3.0)


@pytest.mark.parametrize(
    "lengths, bins",
    [([6], [[0]]), ([0, 0], [[1, 0]]), ([4, 1, 2], [[0, 1, 2]]), ([], [[]]), ([2, 3], [[1], [], [0]])],
    ids=["one-sequence", "all-empty", "one-bin", "no-sequences", "empty-bin"],
)
@pytest.mark.parametrize("capacity", [None, 8], ids=["flat", "bins"])
def test_odd_shapes(lengths: list[int], bins: list[list[int]], capacity: int | None) -> None:
    for jagged in (False, True):
        values, plan = make_case(lengths, bins, jagged, (), torch.float32, capacity, 1)
        check_case(values, plan)


def test_zero_width_features() -> None:
    values, plan = make_case([2, 3], [[1], [0]], False, (0,), torch.float32, 4, 1)
    for backend in ("torch", "triton"):
        packed = pack_sequences(values, plan, backend=backend)
        assert packed.tokens.shape == (2, 4, 0)
        assert packed.segment_ids.tolist() == [[0, 0, 0, -1], [0, 0, -1, -1]]
        assert unpack_sequences(packed.tokens, plan, backend=backend).shape == values.shape


@given(data=st.data())
def test_random_layouts(data: st.DataObject) -> None:
    lengths = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
    order = data.draw(st.permutations(range(len(lengths))))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(lengths)), max_size=3)))
    bins = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(lengths)], strict=True)]
    pad = data.draw(st.integers(1, 3))
    loads = [sum(-(-lengths[i] // pad) * pad for i in b) for b in bins]
    capacity = data.draw(st.sampled_from([None, max(loads, default=0) + data.draw(st.integers(1, 4))]))
    feature = data.draw(st.sampled_from([(), (3,)]))
    values, plan = make_case(lengths, bins, data.draw(st.booleans()), feature, torch.float32, capacity, pad)
    check_case(values, plan)


def test_hand_computed_example() -> None:
    order, offsets = bin_assignment([[1, 0], [2]])
    plan = make_packing_plan(order, offsets, lengths=torch.tensor([2, 3, 1]), padded_len=3, capacity=5)
    values = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    for backend in ("torch", "triton"):
        packed = pack_sequences(values, plan, padding_value=-1, backend=backend)
        assert packed.tokens.tolist() == [[3, 4, 5, 1, 2], [6, -1, -1, -1, -1]]
        assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 0, 0, 0, 0]]
        assert packed.segment_ids.tolist() == [[0, 0, 0, 1, 1], [0, -1, -1, -1, -1]]
    assert plan.cu_seqlens.tolist() == [0, 3, 5, 6]
    assert plan.cu_seqlens.dtype == torch.int32
    assert plan.bin_cu_seqlens(0).tolist() == [0, 3, 5] and plan.bin_cu_seqlens(1).tolist() == [0, 1]
    assert plan.cu_seqlens_per_bin().tolist() == [[0, 3, 5], [0, 1, 1]]
    assert plan.max_seqlen == 3 and plan.num_packed_rows == 10
    assert plan.to("cpu").cu_seqlens.tolist() == [0, 3, 5, 6]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_flow_both_ways(backend: str) -> None:
    values, plan = make_case(LENGTHS, BINS, False, (4,), torch.float64, 12, 3)
    values.requires_grad_(True)
    packed = pack_sequences(values, plan, backend=backend)
    weights = torch.randn_like(packed.tokens)
    (packed.tokens * weights).sum().backward()
    expected = unpack_sequences(weights, plan, 0.0, backend="torch")
    assert torch.equal(values.grad, expected)

    outputs = packed.tokens.detach().clone().requires_grad_(True)
    source_weights = torch.randn_like(values)
    (unpack_sequences(outputs, plan, backend=backend) * source_weights).sum().backward()
    expected_packed = pack_sequences(source_weights, plan, 0.0, backend="torch").tokens
    assert torch.equal(outputs.grad, expected_packed)


def test_gradcheck_jagged() -> None:
    order, offsets = bin_assignment([[1], [0, 2]])
    plan = make_packing_plan(order, offsets, offsets=torch.tensor([0, 2, 2, 5]), pad_to_multiple=2)
    values = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: pack_sequences(v, plan, backend="torch").tokens, (values,))
    packed = torch.randn(plan.num_packed_rows, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p: unpack_sequences(p, plan, backend="torch"), (packed,))


def test_plan_errors() -> None:
    order, offsets = bin_assignment([[0, 1], [2]])
    lengths = torch.tensor([2, 3, 1])
    with pytest.raises(ValueError, match="sequence_order must list every sequence exactly once; sequence 1 appears 2"):
        make_packing_plan(torch.tensor([0, 1, 1]), offsets, lengths=lengths, padded_len=4)
    with pytest.raises(ValueError, match=r"sequence_order out of range: sequence_order\[2\] = 3"):
        make_packing_plan(torch.tensor([0, 1, 3]), offsets, lengths=lengths, padded_len=4)
    with pytest.raises(ValueError, match=r"bin_offsets must end at 3 .*got bin_offsets\[-1\] = 2"):
        make_packing_plan(order, torch.tensor([0, 2]), lengths=lengths, padded_len=4)
    with pytest.raises(ValueError, match=r"lengths must be non-negative, got -1 at position 1"):
        make_packing_plan(order, offsets, lengths=torch.tensor([2, -1, 1]), padded_len=4)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 3 exceeds padded_len=2"):
        make_packing_plan(order, offsets, lengths=lengths, padded_len=2)
    with pytest.raises(ValueError, match="bin 0 holds 5 tokens, more than capacity=4"):
        make_packing_plan(order, offsets, lengths=lengths, padded_len=4, capacity=4)
    with pytest.raises(ValueError, match="bin 0 holds 6 tokens, more than capacity=5"):
        make_packing_plan(order, offsets, lengths=lengths, padded_len=4, capacity=5, pad_to_multiple=3)
    with pytest.raises(ValueError, match="pad_to_multiple must be a positive int, got pad_to_multiple=0"):
        make_packing_plan(order, offsets, lengths=lengths, padded_len=4, pad_to_multiple=0)
    with pytest.raises(ValueError, match="capacity must be None or a positive int, got capacity=0"):
        make_packing_plan(order, offsets, lengths=lengths, padded_len=4, capacity=0)
    with pytest.raises(ValueError, match="pass exactly one source layout"):
        make_packing_plan(order, offsets, lengths=lengths, offsets=torch.tensor([0, 2, 5, 6]))
    with pytest.raises(ValueError, match=r"padded_len must be an int >= 0 .*got padded_len=None \(a NoneType\)"):
        make_packing_plan(order, offsets, lengths=lengths)
    with pytest.raises(ValueError, match="padded_len only applies to padded values"):
        make_packing_plan(order, offsets, offsets=torch.tensor([0, 2, 5, 6]), padded_len=3)
    with pytest.raises(ValueError, match=r"offsets must have B \+ 1 = 4 entries, got 3"):
        make_packing_plan(order, offsets, offsets=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="lengths has 2 entries but sequence_order has 3"):
        make_packing_plan(order, offsets, lengths=torch.tensor([1, 2]), padded_len=4)
    with pytest.raises(TypeError, match="sequence_order must be int32 or int64, got dtype torch.float32"):
        make_packing_plan(order.float(), offsets, lengths=lengths, padded_len=4)
    with pytest.raises(TypeError, match="bin_offsets must be a torch.Tensor, got list"):
        make_packing_plan(order, [0, 2, 3], lengths=lengths, padded_len=4)  # type: ignore[arg-type]


def test_op_errors() -> None:
    order, offsets = bin_assignment([[0, 1], [2]])
    plan = make_packing_plan(order, offsets, lengths=torch.tensor([2, 3, 1]), padded_len=4, capacity=6)
    with pytest.raises(
        ValueError,
        match=r"values must be padded \[B, S, \*\] with \(B, S\) = \(3, 4\) as in the plan, got shape \(3, 5\)",
    ):
        pack_sequences(torch.zeros(3, 5), plan)
    with pytest.raises(
        ValueError, match=r"packed must start with the plan's packed shape \(2, 6\) .*got shape \(12,\)"
    ):
        unpack_sequences(torch.zeros(12), plan)
    with pytest.raises(TypeError, match="values must be a torch.Tensor, got list"):
        pack_sequences([1, 2], plan)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be one of"):
        pack_sequences(torch.zeros(3, 4), plan, backend="cuda")  # type: ignore[arg-type]
    jagged = make_packing_plan(order, offsets, offsets=torch.tensor([0, 2, 5, 6]))
    with pytest.raises(
        ValueError, match=r"values must be jagged \[N, \*\] with N >= offsets\[-1\] = 6, got shape \(5,\)"
    ):
        pack_sequences(torch.zeros(5), jagged)


@pytest.mark.gpu
def test_compiled_kernels_on_cuda() -> None:
    values, plan = make_case([300, 0, 1025, 7, 513], [[2], [0, 4, 1], [], [3]], False, (33,), torch.float16, 2048, 8)
    values, plan = values.cuda(), plan.to("cuda")
    for layout_plan in (plan,):
        want = pack_sequences(values, layout_plan, -1.0, backend="torch")
        got = pack_sequences(values, layout_plan, -1.0, backend="triton")
        for a, b in zip(got[:3], want[:3], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(
            unpack_sequences(want.tokens, layout_plan, -1.0, backend="triton"),
            unpack_sequences(want.tokens, layout_plan, -1.0, backend="torch"),
        )
