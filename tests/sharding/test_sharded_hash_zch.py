"""Sharded managed-collision EBC with ``HashZchManagedCollisionModule`` tables (torchrec's MPZCH sharding, row-wise)
on 2 gloo ranks against the unsharded module fed the same global batches: returned remapped rows, pooled outputs,
table shards after fused SGD and the identities / metadata of each rank's rows, with and without TTL eviction,
``input_hash_size`` 0 (ids routed by ``id % total_num_buckets``) and > 0 (by range); a hash ZCH table beside an MCH
one in a sharding; DistributedModelParallel with an explicit row-wise plan; the state dict (torchrec's keys and
``ShardedTensor`` layout) through DCP and ``load_state_dict``; the refusals; the MC-EC's training stream. Rank-side
code: hash_zch_cases.py and hash_zch_ec_cases.py (one spawn for the module)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.dist_utils import run_ranks
from tests.sharding.hash_zch_cases import run_suite

pytestmark = pytest.mark.dist

MC = "_managed_collision_collection._managed_collision_modules"


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_ranks(run_suite, 2, timeout=300.0)


@pytest.mark.parametrize("case", ["ttl=False", "ttl=True", "t0_ranged", "lru", "per_feature", "opt_in"])
def test_training_stream_matches_the_unsharded_module(case: str) -> None:
    for rank, results in enumerate(_results()):
        got = results[case]
        assert got["rows"] == 0, f"rank {rank}: {got['rows']} returned remapped KJT mismatches"
        assert got["forward"] <= 1e-6, f"rank {rank}: pooled output differs by {got['forward']}"
        assert got["weights"] <= 1e-6, f"rank {rank}: table shard differs by {got['weights']} after fused SGD"
        assert got["state"] == 0, f"rank {rank}: {got['state']} identity / metadata mismatches"
        if case != "ttl=False":
            assert got["evicted"] > 0, f"rank {rank}: no id evicted an expired one"


def test_ec_training_stream_matches_the_unsharded_module() -> None:
    for rank, results in enumerate(_results()):
        got = results["ec"]
        assert got["rows"] == 0, f"rank {rank}: {got['rows']} returned remapped KJT mismatches"
        assert got["lengths"] == 0, f"rank {rank}: {got['lengths']} sequence-length mismatches"
        assert got["forward"] <= 1e-6, f"rank {rank}: sequence embeddings differ by {got['forward']}"
        assert got["weights"] <= 1e-6, f"rank {rank}: table shard differs by {got['weights']} after fused SGD"
        assert got["state"] == 0, f"rank {rank}: {got['state']} identity / metadata mismatches"


def test_without_return_remapped_features_the_embeddings_are_the_same() -> None:
    for rank, results in enumerate(_results()):
        got, with_rows = results["not_remapped"], results["ttl=True"]
        assert got["forward"] <= 1e-6 and got["weights"] <= 1e-6 and got["state"] == 0, f"rank {rank}: {got}"
        assert len(got["outputs"]) == len(with_rows["outputs"]) > 0
        assert all(a.equal(b) for a, b in zip(got["outputs"], with_rows["outputs"], strict=True)), f"rank {rank}"


def test_hash_zch_and_mch_tables_share_a_sharding() -> None:
    for rank, results in enumerate(_results()):
        got = results["mixed"]
        assert got["rows"] == 0, f"rank {rank}: {got['rows']} remapped-row mismatches"
        assert got["t0"] <= 1e-6 and got["t1"] <= 1e-6, f"rank {rank}: {got}"


def test_state_dict_keys_layout_and_checkpoint_round_trip() -> None:
    for rank, results in enumerate(_results()):
        got = results["state"]
        buffers = ("_hash_zch_identities", "_hash_zch_metadata")
        sharded = [f"_embedding_module.embedding_bags.{t}.weight" for t in ("t0", "t1")]
        sharded += [f"{MC}.{t}.{b}" for t in ("t0", "t1") for b in buffers]
        assert got["sharded_keys"] == sorted(sharded), f"rank {rank}: {got['sharded_keys']}"
        assert got["keys"] == sorted(sharded + [f"{MC}.{t}._hash_zch_bucket" for t in ("t0", "t1")])
        for b in buffers:
            assert got["sizes"][f"{MC}.t0.{b}"] == [16, 1] and got["sizes"][f"{MC}.t1.{b}"] == [12, 1]
            assert got["offsets"][f"{MC}.t0.{b}"] == 8 * rank and got["offsets"][f"{MC}.t1.{b}"] == 6 * rank
        assert got["dcp_same"], f"rank {rank}: state differs after a DCP save and load"
        assert got["load_same"], f"rank {rank}: state differs through load_state_dict"
        assert got["after_load"] == 0.0, f"rank {rank}: loaded modules' embeddings differ by {got['after_load']}"


def test_distributed_model_parallel_with_a_row_wise_plan() -> None:
    for rank, results in enumerate(_results()):
        got = results["dmp"]
        assert got["kinds"] == ["row_wise"], f"rank {rank}: {got['kinds']}"
        assert got["loss"] <= 1e-6, f"rank {rank}: DMP's loss differs from the hand-sharded module's by {got['loss']}"


@pytest.mark.parametrize(
    ("case", "error", "words"),
    [
        ("table_wise", "ValueError", "row-wise only"),
        ("few_buckets", "ValueError", "total_num_buckets=1 is less than the world size 2"),
        ("uneven_buckets", "NotImplementedError", "total_num_buckets=3 does not divide evenly over 2 ranks"),
        ("misaligned", "ValueError", "rank 0 holds rows [0, 8), but"),
        ("disable_fallback", "NotImplementedError", "disable_fallback=True is not built"),
    ],
)
def test_refusals_name_the_table(case: str, error: str, words: str) -> None:
    for results in _results():
        message = results["refusals"][case]
        assert message.startswith(f"{error}: ") and "'t0'" in message and words in message, message


def test_other_managed_collision_module_types_are_refused_by_name() -> None:
    """Only MCH and hash ZCH tables shard: another ``ManagedCollisionModule`` is refused, naming table and type."""
    import torch

    from tritonrec.dist.mc_sharding import ShardedManagedCollisionCollection
    from tritonrec.modules import EmbeddingBagConfig
    from tritonrec.modules.mc_base import ManagedCollisionModule
    from tritonrec.modules.mc_collection import ManagedCollisionCollection

    custom = type("CustomMC", (ManagedCollisionModule,), {"output_size": lambda self: 16})
    custom.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
    configs = [EmbeddingBagConfig(name="t0", num_embeddings=16, embedding_dim=3, feature_names=["f0"])]
    mcc = ManagedCollisionCollection({"t0": custom("cpu", [0, 16])}, configs)
    with pytest.raises(NotImplementedError, match="table 't0': sharding a CustomMC is not built"):
        ShardedManagedCollisionCollection(mcc, [], None, torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize("world", [2, 4])
def test_bucket_routing_matches_fbgemm_two_level_bucketize(world: int) -> None:
    """The input dist's bucketing of hash ZCH features equals FBGEMM's ``block_bucketize_sparse_features`` as torchrec
    calls it (``block_sizes = ceil(H / B)``, ``total_num_blocks = B``, ``keep_orig_idx``, sequence): lengths, ids and
    the unbucketize permutation, for ``input_hash_size`` 0 and > 0, weighted."""
    import torch

    pytest.importorskip("fbgemm_gpu")
    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.dist.mc_hash_zch_sharding import HashZchRoute, bucketize_by_rank, destinations

    g = torch.Generator().manual_seed(world)
    sizes, buckets = [0, 1000, 37, 0], [4, 4, 8, 8]  # per feature: input_hash_size, total_num_buckets
    lengths = torch.randint(0, 6, (len(sizes) * 5,), generator=g)
    counts = lengths.view(len(sizes), -1).sum(1).tolist()
    values = torch.cat([torch.randint(0, h or 10**12, (n,), generator=g) for h, n in zip(sizes, counts, strict=True)])
    weights = torch.rand(values.numel(), generator=g)
    kjt = KeyedJaggedTensor(keys=["a", "b", "c", "d"], values=values, lengths=lengths, weights=weights)
    routes = [
        HashZchRoute(b // world, modulo=b) if h == 0 else HashZchRoute(-(-h // b) * (b // world))
        for h, b in zip(sizes, buckets, strict=True)
    ]
    ranks, sent = destinations(kjt, routes)
    got, permute = bucketize_by_rank(kjt, ranks, sent, world)
    blocks = torch.tensor([-(-h // b) for h, b in zip(sizes, buckets, strict=True)])
    want = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, values, False, True, blocks, world, weights, None, -1, None, True, torch.tensor(buckets)
    )
    assert torch.equal(got.lengths(), want[0]) and torch.equal(got.values(), want[1])
    assert torch.equal(got.weights(), want[2]) and torch.equal(permute, want[4])


def test_int32_ids_route_like_int64_past_int32_divisors() -> None:
    """A divisor (``ceil(H/B)*B/W``) or MCH block past int32's range must not wrap on int32 ids: ranks and ids sent
    equal the int64 ones (an int32 division by 2**40 wrapped to a division by zero)."""
    import torch

    from tritonrec.data import KeyedJaggedTensor
    from tritonrec.dist.mc_hash_zch_sharding import HashZchRoute, destinations

    ids = torch.tensor([0, 5, 2**31 - 1, 123456789, 7, 2**30])
    routes = [HashZchRoute(2**40), HashZchRoute(4_294_967_316), HashZchRoute(2**33, shift=2**33)]
    lengths = torch.tensor([2, 2, 2])
    for dtype in (torch.int64, torch.int32):
        kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=ids.to(dtype), lengths=lengths)
        ranks, sent = destinations(kjt, routes)
        assert ranks.tolist() == [0] * 6 and sent.dtype == dtype and sent.tolist() == ids.tolist()


def test_negative_ids_are_refused_without_an_input_hash_size() -> None:
    """With ``input_hash_size`` 0 any id >= 0 is taken; -1 (the free-row marker of ``_hash_zch_identities``) and
    every other negative id is refused by position, unsharded as in the sharded preprocess."""
    import torch

    from tritonrec.data import JaggedTensor
    from tritonrec.modules import HashZchManagedCollisionModule

    module = HashZchManagedCollisionModule(zch_size=8, device="cpu", total_num_buckets=2, max_probe=2)
    for dtype in (torch.int64, torch.int32):
        ids = torch.tensor([3, 9, -1, 4], dtype=dtype)
        with pytest.raises(ValueError, match=r"values\(\)\[2\] = -1 is negative \(ids must be >= 0\)"):
            module({"t": JaggedTensor(values=ids, lengths=torch.tensor([4]))})
    assert (module._hash_zch_identities == -1).all()  # refused before any insert
