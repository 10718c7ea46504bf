"""shard_by_batch_size with dynamic batching and sequence packing: caps, rounding, every item once, order restored,
equal microbatch counts per rank, and the packed tokens of packing microbatches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonrec.data.batched_data_dict import BatchedDataDict, DynamicBatchingArgs, SequencePackingArgs
from tritonrec.kernels.pack_sequences import unpack_sequences


def make_batch(lengths: list[int] | torch.Tensor, width: int | None = None) -> BatchedDataDict:
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    width = int(lengths.max()) if width is None and lengths.numel() else (width or 1)
    count = lengths.numel()
    positions = torch.arange(width)
    ids = torch.where(positions < lengths[:, None], 1000 * torch.arange(count)[:, None] + positions + 1, 0)
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths, "problem_ids": torch.arange(count)})


def dynamic_args(max_tokens: int, round_to: int) -> DynamicBatchingArgs:
    return {
        "max_tokens_per_microbatch": max_tokens,
        "sequence_length_round": round_to,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
    }


def packing_args(
    max_tokens: int, algorithm: str = "modified_first_fit_decreasing", pad: int = 1, **extra
) -> SequencePackingArgs:
    return SequencePackingArgs(
        max_tokens_per_microbatch=max_tokens,
        input_key="input_ids",
        input_lengths_key="input_lengths",
        algorithm=algorithm,
        sequence_length_pad_multiple=pad,
        **extra,
    )


def assert_restores(batch: BatchedDataDict, shards: list, sorted_indices: list[int]) -> None:
    rebuilt = BatchedDataDict.from_batches(shards)
    rebuilt.reorder_data(sorted_indices)
    for key in batch:
        assert torch.equal(rebuilt[key], batch[key]), key


def test_dynamic_batching_example() -> None:
    batch = make_batch([2, 8, 4, 16, 28, 32, 2, 32], width=128)
    shards, sorted_indices = batch.shard_by_batch_size(shards=2, dynamic_batching_args=dynamic_args(32, 4))
    assert sorted_indices == [0, 2, 3, 5, 6, 1, 4, 7]
    assert shards[0]["problem_ids"].tolist() == [0, 2, 3, 5] and shards[1]["problem_ids"].tolist() == [6, 1, 4, 7]
    for shard in shards:
        assert shard.micro_batch_indices == [[[0, 2], [2, 3], [3, 4]]]
        assert shard.micro_batch_lengths == [[8, 28, 32]]
        assert shard.get_microbatch_iterator_dynamic_shapes_len() == 3
        shapes = [tuple(mb["input_ids"].shape) for mb in shard.make_microbatch_iterator_with_dynamic_shapes()]
        assert shapes == [(2, 8), (1, 28), (1, 32)]
    assert_restores(batch, shards, sorted_indices)


@given(
    shards=st.sampled_from([1, 2, 4]),
    chunks=st.integers(1, 3),
    per_shard=st.integers(1, 6),
    round_to=st.sampled_from([1, 4, 16]),
    data=st.data(),
)
def test_dynamic_batching_invariants(shards: int, chunks: int, per_shard: int, round_to: int, data) -> None:
    batch_size = shards * per_shard
    lengths = data.draw(st.lists(st.integers(0, 60), min_size=batch_size * chunks, max_size=batch_size * chunks))
    batch = make_batch(lengths, width=64)
    max_tokens = data.draw(st.integers(64, 400))
    sharded, sorted_indices = batch.shard_by_batch_size(
        shards=shards, batch_size=batch_size, dynamic_batching_args=dynamic_args(max_tokens, round_to)
    )
    assert sorted(sorted_indices) == list(range(len(lengths)))
    assert_restores(batch, sharded, sorted_indices)
    for chunk in range(chunks):
        seen = []
        counts = set()
        for shard in sharded:
            part = shard.get_batch(chunk, batch_size=per_shard)
            counts.add(part.get_microbatch_iterator_dynamic_shapes_len())
            for mb in part.make_microbatch_iterator_with_dynamic_shapes():
                rows, padded = mb["input_ids"].shape
                assert rows * padded <= max_tokens
                assert padded % round_to == 0 or padded == 64
                assert int(mb["input_lengths"].max()) <= padded
                seen += mb["problem_ids"].tolist()
        assert len(counts) == 1  # every rank runs the same microbatches
        assert sorted(seen) == list(range(chunk * batch_size, (chunk + 1) * batch_size))


def test_dynamic_batching_errors() -> None:
    batch = make_batch([2, 8, 40, 4], width=64)
    with pytest.raises(ValueError, match="padded to 40 tokens .*exceeds max_tokens_per_microbatch=32"):
        batch.shard_by_batch_size(shards=2, dynamic_batching_args=dynamic_args(32, 4))
    with pytest.raises(ValueError, match="dynamic_batching_args is missing the key 'sequence_length_round'"):
        batch.shard_by_batch_size(shards=2, dynamic_batching_args={"max_tokens_per_microbatch": 8})  # type: ignore
    with pytest.raises(ValueError, match=r"dynamic_batching_args\['sequence_length_round'\] must be a positive int"):
        batch.shard_by_batch_size(shards=2, dynamic_batching_args=dynamic_args(64, 0))
    missing = dict(dynamic_args(64, 4), input_lengths_key="lens")
    with pytest.raises(ValueError, match="input_lengths_key='lens', which is not a key of the batch"):
        batch.shard_by_batch_size(shards=2, dynamic_batching_args=missing)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dynamic_batching_args and sequence_packing_args cannot be passed together"):
        batch.shard_by_batch_size(
            shards=2, dynamic_batching_args=dynamic_args(64, 4), sequence_packing_args=packing_args(64)
        )
    bad_lengths = BatchedDataDict({"input_ids": torch.ones(2, 4), "input_lengths": torch.tensor([1, -2])})
    with pytest.raises(ValueError, match="holds a negative length -2"):
        bad_lengths.shard_by_batch_size(shards=2, dynamic_batching_args=dynamic_args(64, 4))


def check_packed_shards(batch, shards, sorted_indices, batch_size: int, max_tokens: int, pad: int) -> list[list[int]]:
    """Every microbatch within the cap, every item once and inside its chunk, equal counts per rank, order restored.
    Returns microbatch counts per chunk and rank."""
    seen: set[int] = set()
    counts = []
    for chunk in range(batch.size // batch_size):
        per_rank = []
        for shard in shards:
            part = shard.get_batch(chunk)
            number, _ = part.get_microbatch_iterator_for_packable_sequences_len()
            per_rank.append(number)
            for mb, tokens in zip(
                part.make_microbatch_iterator_for_packable_sequences(), part.micro_batch_lengths[0], strict=True
            ):
                padded = -(-mb["input_lengths"] // pad) * pad
                assert int(padded.sum()) == tokens <= max_tokens
                ids = mb["problem_ids"].tolist()
                assert all(chunk * batch_size <= i < (chunk + 1) * batch_size for i in ids)
                assert seen.isdisjoint(ids)
                seen.update(ids)
        assert len(set(per_rank)) == 1
        counts.append(per_rank)
    assert seen == set(range(batch.size))
    assert_restores(batch, shards, sorted_indices)
    return counts


@pytest.mark.parametrize("pad, efficiency", [(1, 0.955), (32, 0.91), (64, 0.85), (256, 0.60)])
def test_packing_microbatch_boundaries(pad: int, efficiency: float) -> None:
    torch.manual_seed(123)
    lengths = torch.randint(50, 800, (1024,))
    batch = make_batch(lengths, width=1024)
    shards, sorted_indices = batch.shard_by_batch_size(
        shards=4, batch_size=256, sequence_packing_args=packing_args(1200, pad=pad)
    )
    counts = check_packed_shards(batch, shards, sorted_indices, 256, 1200, pad)
    for chunk, per_rank in enumerate(counts):
        tokens = int(lengths[chunk * 256 : (chunk + 1) * 256].sum())
        assert tokens / (sum(per_rank) * 1200) >= efficiency


@given(
    algorithm=st.sampled_from(
        [
            "concatenative",
            "first_fit_decreasing",
            "first_fit_shuffle",
            "modified_first_fit_decreasing",
            "best_two_fit",
            "karmarkar_karp",
        ]
    ),
    shards=st.sampled_from([1, 2, 3]),
    chunks=st.integers(1, 2),
    balance=st.booleans(),
    data=st.data(),
)
def test_packing_invariants(algorithm: str, shards: int, chunks: int, balance: bool, data) -> None:
    batch_size = shards * data.draw(st.integers(2, 8))
    lengths = data.draw(st.lists(st.integers(0, 40), min_size=batch_size * chunks, max_size=batch_size * chunks))
    pad = data.draw(st.sampled_from([1, 4]))
    batch = make_batch(lengths, width=40)
    args = packing_args(48, algorithm, pad, balance_ranks=balance)
    shards_out, sorted_indices = batch.shard_by_batch_size(
        shards=shards, batch_size=batch_size, sequence_packing_args=args
    )
    check_packed_shards(batch, shards_out, sorted_indices, batch_size, 48, pad)


def test_packing_uniform_and_long_sequences() -> None:
    uniform = make_batch([256] * 16)
    shards, _ = uniform.shard_by_batch_size(shards=2, sequence_packing_args=packing_args(1024))
    assert [s.micro_batch_lengths for s in shards] == [[[1024, 1024]], [[1024, 1024]]]
    long = make_batch([900, 850, 1000, 950])
    shards, _ = long.shard_by_batch_size(shards=2, sequence_packing_args=packing_args(1024))
    assert all(end - start == 1 for s in shards for start, end in s.micro_batch_indices[0])


def test_packing_largest_first_and_balanced_ranks() -> None:
    lengths = torch.tensor([46, 24, 55, 88, 11, 14, 73, 17])
    batch = make_batch(lengths, width=100)
    packer_order, _ = batch.shard_by_batch_size(
        shards=2, sequence_packing_args=packing_args(100, microbatch_order="packer")
    )
    largest, sorted_indices = batch.shard_by_batch_size(
        shards=2, sequence_packing_args=packing_args(100, microbatch_order="largest_first")
    )
    for plain, ordered in zip(packer_order, largest, strict=True):
        assert set(plain["problem_ids"].tolist()) == set(ordered["problem_ids"].tolist())
        assert ordered.micro_batch_lengths[0] == sorted(plain.micro_batch_lengths[0], reverse=True)
    assert_restores(batch, largest, sorted_indices)

    many = make_batch(torch.from_numpy(np.random.default_rng(0).integers(50, 801, 512)), width=800)
    plain, _ = many.shard_by_batch_size(shards=8, sequence_packing_args=packing_args(1200, "first_fit_decreasing"))
    balanced, _ = many.shard_by_batch_size(
        shards=8, sequence_packing_args=packing_args(1200, "first_fit_decreasing", balance_ranks=True)
    )

    def imbalance(shards: list) -> float:
        tokens = [int(s["input_lengths"].sum()) for s in shards]
        return max(tokens) / (sum(tokens) / len(tokens))

    assert imbalance(balanced) <= imbalance(plain)
    assert len({len(s.micro_batch_lengths[0]) for s in balanced}) == 1


def test_packing_errors() -> None:
    batch = make_batch([10, 20, 30, 40])
    with pytest.raises(
        ValueError,
        match="sequence 3 has 40 tokens, 64 after padding to sequence_length_pad_multiple=32, "
        "more than max_tokens_per_microbatch=48",
    ):
        batch.shard_by_batch_size(shards=2, sequence_packing_args=packing_args(48, pad=32))
    with pytest.raises(ValueError, match=r"microbatch_order'\] must be 'packer' or 'largest_first', got 'unknown'"):
        batch.shard_by_batch_size(shards=2, sequence_packing_args=packing_args(64, microbatch_order="unknown"))
    with pytest.raises(ValueError, match="Unknown packing algorithm: algorithm='nope'"):
        batch.shard_by_batch_size(shards=2, sequence_packing_args=packing_args(64, "nope"))
    with pytest.raises(ValueError, match="require 4 bins, but there are only 2 sequences"):
        make_batch([10, 20]).shard_by_batch_size(
            shards=4, allow_uneven_shards=True, sequence_packing_args=packing_args(64)
        )


@pytest.mark.parametrize("pad", [1, 4])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packable_microbatches_carry_packed_tokens(pad: int, backend: str) -> None:
    batch = make_batch([3, 0, 7, 2, 5, 6], width=8)
    shards, _ = batch.shard_by_batch_size(shards=2, sequence_packing_args=packing_args(16, pad=pad))
    assert batch.packed_sequences is None and shards[0].packed_sequences is None
    for shard in shards:
        for mb in shard.get_batch(0).make_microbatch_iterator_for_packable_sequences(padding_value=0, backend=backend):
            packed = mb.packed_sequences
            lengths = mb["input_lengths"].tolist()
            slots = [-(-n // pad) * pad for n in lengths]
            expected = torch.cat(
                [
                    torch.cat([row[:n], torch.zeros(s - n, dtype=row.dtype)])
                    for row, n, s in zip(mb["input_ids"], lengths, slots, strict=True)
                ]
            )
            assert torch.equal(packed.tokens, expected)
            assert packed.plan.cu_seqlens.tolist() == np.cumsum([0, *slots]).tolist()
            assert packed.position_ids.tolist() == [p for s in slots for p in range(s)]
            assert mb.packed_sequences is packed  # built once, then cached
            restored = unpack_sequences(packed.tokens, packed.plan, backend=backend)
            assert torch.equal(restored, mb["input_ids"])


def test_sharding_argument_errors() -> None:
    batch = make_batch([2, 8, 4, 6], width=8)
    with pytest.raises(ValueError, match="sequence_packing_args is missing the key 'algorithm'"):
        batch.shard_by_batch_size(
            shards=2, sequence_packing_args={k: v for k, v in packing_args(16).items() if k != "algorithm"}
        )  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"dynamic_batching_args\['input_key'\] must be a str \(a key of the batch\), got 3"
    ):
        batch.shard_by_batch_size(shards=2, dynamic_batching_args=dict(dynamic_args(16, 4), input_key=3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dynamic batching deals rows round-robin and needs allow_uneven_shards=False"):
        batch.shard_by_batch_size(shards=2, allow_uneven_shards=True, dynamic_batching_args=dynamic_args(16, 4))
    flat = BatchedDataDict({"input_ids": torch.ones(4), "input_lengths": torch.tensor([1, 1, 1, 1])})
    with pytest.raises(
        ValueError, match=r"dynamic_batching_args\['input_key'\]='input_ids' must name a \[B, S, \*\] tensor"
    ):
        flat.shard_by_batch_size(shards=2, dynamic_batching_args=dynamic_args(16, 4))
    floats = BatchedDataDict({"input_ids": torch.ones(2, 4), "input_lengths": torch.tensor([1.0, 2.0])})
    with pytest.raises(
        ValueError, match=r"batch\['input_lengths'\] must hold one integer length per sample, got dtype float32"
    ):
        floats.shard_by_batch_size(shards=2, sequence_packing_args=packing_args(16))
    shards, _ = batch.shard_by_batch_size(shards=2, sequence_packing_args=packing_args(16))
    with pytest.raises(ValueError, match=r"batch_idx must be in \[0, 1\), got batch_idx=1"):
        shards[0].get_batch(1)


def test_argument_types_mark_their_optional_keys() -> None:
    """NeMo-RL's TypedDicts: tritonrec's two extra packing keys are optional at runtime too (with postponed
    annotations TypedDict had counted them as required)."""
    assert SequencePackingArgs.__optional_keys__ == {"microbatch_order", "balance_ranks"}
    assert "max_tokens_per_microbatch" in SequencePackingArgs.__required_keys__
    assert not DynamicBatchingArgs.__optional_keys__
