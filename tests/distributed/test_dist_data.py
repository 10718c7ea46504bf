"""dist_data on real gloo ranks: torchrec's documented examples exactly, the sparse all-to-all against a
single-process reference (weighted, variable batch per rank, per key (VBE), zero splits, empty bags, stagger), the
sequence-embedding round trip (forward and gradients), the pooled modules; the single-process modules in-process.
Rank-side code: data_cases.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.distributed.data_cases import KJTCase, kjt_cases, sequence_cases
from tests.distributed.spawned import suite_results
from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.dist_data import (
    EmbeddingsAllToOne,
    EmbeddingsAllToOneReduce,
    KJTOneToAll,
    SeqEmbeddingsAllToOne,
    rank_device,
)
from tritonrec.dist.kjt_dist import expand_into_jagged_permute, get_recat, invert_permute

pytestmark = pytest.mark.dist


def _case_names(cases_of: Callable[[int], list[KJTCase]]) -> list[tuple[str, int]]:
    return [(case.name, world) for world in (2, 4) for case in cases_of(world)]


def test_documented_examples_reproduce_exactly() -> None:
    for rank, results in enumerate(suite_results("data", 2)):
        examples = results["documented_examples"]
        assert all(examples.values()), f"rank {rank}: {examples}"


@pytest.mark.parametrize(("case_name", "world"), _case_names(kjt_cases))
def test_kjt_all_to_all_matches_reference(case_name: str, world: int) -> None:
    for rank, results in enumerate(suite_results("data", world)):
        checks = results[case_name]
        assert all(checks.values()), f"rank {rank}: {checks}"


@pytest.mark.parametrize(("case_name", "world"), _case_names(sequence_cases))
def test_sequence_embeddings_round_trip(case_name: str, world: int) -> None:
    for rank, results in enumerate(suite_results("data", world)):
        checks = results[case_name]
        assert checks["forward"], f"rank {rank}: forward differs from the looked-up rows"
        assert checks["grad"], f"rank {rank}: gradient differs from the reference's autograd gradient"


@pytest.mark.parametrize("world", [2, 4])
def test_pooled_modules_route_to_their_ops(world: int) -> None:
    for rank, results in enumerate(suite_results("data", world)):
        checks = results["modules"]
        assert all(checks.values()), f"rank {rank}: {checks}"


# ------------------------------------------------------------------------------------- recat helpers (in-process)
def test_get_recat_matches_torchrec_examples() -> None:
    assert get_recat(2, 4).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert get_recat(2, 4, stagger=2).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert get_recat(0, 4) is None
    # variable batch per rank: bag-level permutation; 2 keys, ranks with 1 and 2 bags: (rank, key) segments
    # r0k0=[0], r0k1=[1], r1k0=[2, 3], r1k1=[4, 5] -> key-major: k0 from r0, r1, then k1 from r0, r1
    assert get_recat(2, 2, batch_size_per_rank=[1, 2]).tolist() == [0, 2, 3, 1, 4, 5]


def test_expand_and_invert_permute() -> None:
    permute = torch.tensor([2, 0, 1])
    input_offsets = torch.tensor([0, 1, 3, 6])
    output_offsets = torch.tensor([0, 3, 4, 6])
    assert expand_into_jagged_permute(permute, input_offsets, output_offsets, 6).tolist() == [3, 4, 5, 0, 1, 2]
    inverse = invert_permute(permute)
    assert inverse.tolist() == [1, 2, 0]
    assert torch.equal(permute[inverse], torch.arange(3))


# ---------------------------------------------------------------------------- single-process modules (in-process)
def test_all_to_one_modules_on_cpu() -> None:
    parts = [torch.arange(6.0).view(2, 3), torch.arange(6.0, 10.0).view(2, 2)]
    merged = EmbeddingsAllToOne(torch.device("cpu"), world_size=2, cat_dim=1)(parts)
    assert torch.equal(merged, torch.cat(parts, dim=1))
    same = [torch.ones(2, 3), torch.full((2, 3), 2.0)]
    assert torch.equal(EmbeddingsAllToOneReduce(torch.device("cpu"), 2)(same), torch.full((2, 3), 3.0))
    copies = SeqEmbeddingsAllToOne(torch.device("cpu"), 2)(same)
    assert len(copies) == 2 and all(torch.equal(c, s) for c, s in zip(copies, same, strict=True))


def test_kjt_one_to_all_splits_keys() -> None:
    kjt = KeyedJaggedTensor(["a", "b", "c"], torch.arange(4), lengths=torch.tensor([1, 0, 2, 1, 0, 0]))
    parts = KJTOneToAll([2, 1], world_size=2)(kjt)
    assert [p.keys() for p in parts] == [["a", "b"], ["c"]]
    assert parts[0].values().tolist() == [0, 1, 2, 3] and parts[1].values().numel() == 0
    assert rank_device("cuda", 3) == torch.device("cuda", 3) and rank_device("cpu", 3) == torch.device("cpu")


@pytest.mark.parametrize(
    ("make", "error", "fragments"),
    [
        (lambda: EmbeddingsAllToOne("cpu", 2, 1), TypeError, ("device must be a torch.device", "'cpu'")),
        (
            lambda: EmbeddingsAllToOne(torch.device("cpu"), 0, 1),
            ValueError,
            ("world_size must be a positive int", "world_size=0"),
        ),
        (lambda: EmbeddingsAllToOne(torch.device("cpu"), 2, 2), ValueError, ("cat_dim must be 0", "cat_dim=2")),
        (
            lambda: EmbeddingsAllToOne(torch.device("cpu"), 2, 1)([torch.ones(1)] * 3),
            ValueError,
            ("1 to 2 tensors", "got 3"),
        ),
        (
            lambda: EmbeddingsAllToOneReduce(torch.device("cpu"), 2)([torch.ones(1)]),
            ValueError,
            ("exactly 2 tensors", "got 1"),
        ),
        (
            lambda: EmbeddingsAllToOneReduce(torch.device("cpu"), 2)([torch.ones(1), torch.ones(2)]),
            ValueError,
            ("tensors[1] is (2,)", "tensors[0] is (1,)"),
        ),
        (
            lambda: SeqEmbeddingsAllToOne(torch.device("cpu"), 2)("ab"),
            TypeError,
            ("tensors must be a list of tensors", "str"),
        ),
        (lambda: KJTOneToAll([1, 1], world_size=3), ValueError, ("splits must have one entry per rank (3)", "got 2")),
        (
            lambda: KJTOneToAll([1, 1], world_size=2, device="cpu"),
            TypeError,
            ("device must be a torch.device", "'cpu'"),
        ),
        (
            lambda: KJTOneToAll([1, 1], world_size=2)(torch.ones(2)),
            TypeError,
            ("kjt must be a KeyedJaggedTensor", "Tensor"),
        ),
    ],
)
def test_single_process_modules_reject_bad_input(make: object, error: type, fragments: tuple[str, ...]) -> None:
    with pytest.raises(error) as raised:
        make()  # type: ignore[operator]
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))
