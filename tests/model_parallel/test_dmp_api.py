"""DistributedModelParallel's API on 2 ranks (rank-side code: api_cases.py): unwrapped names, DMP / DDP wrappers,
the combined fused optimizer (its param_groups reach the fused update), state_dict round trip, copy, sparse-gradient
names, building on ``meta`` (only this rank's shards materialised: peak RSS), and bad input, including the cases that
need no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.model_parallel.api_cases import MEMORY_TABLES
from tests.model_parallel.dlrm_cases import SHARDED_PATH, build_dlrm
from tests.model_parallel.spawned import suite_results
from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist import ShardingEnv, ShardingPlan, construct_module_sharding_plan, table_wise
from tritonrec.dist.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from tritonrec.modules import DataType, EmbeddingBagCollection, EmbeddingBagConfig
from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection

WORLD = 2


def _api(case: str) -> list[dict]:
    return [r[case] for r in suite_results("api", WORLD)]


@pytest.mark.dist
def test_names_are_the_unwrapped_models() -> None:
    for rank, got in enumerate(_api("names")):
        local = {f"{SHARDED_PATH}.embedding_bags.{t}.weight" for t in got["local_tables"]}
        dense = {n for n in got["reference_names"] if "embedding_bags" not in n}
        assert set(got["param_names"]) == dense | local, f"rank {rank}"
        assert set(got["fused_keys"]) == local, f"rank {rank}: fused optimizer keys {got['fused_keys']}"
        assert got["state_dict_keys"] == got["reference_keys"], f"rank {rank}: the unsharded model's keys"
        assert "inter_arch.triu_indices" in got["buffer_names"]
        assert got["get_module_is_ddp"] and got["unwrapped_is_model"]
        assert got["set_module_after_ddp"].startswith("RuntimeError: module cannot be set after init_data_parallel")
        assert got["lazy_not_ddp"] and got["lazy_then_ddp"]
    tables = [set(got["local_tables"]) for got in _api("names")]
    assert tables[0].isdisjoint(tables[1]) and tables[0] | tables[1] == {"t0", "t1", "t2", "t3"}  # table-wise


@pytest.mark.dist
def test_fused_optimizer_param_groups_reach_the_tables() -> None:
    for rank, got in enumerate(_api("fused_lr")):
        assert got == {"frozen_at_lr0": True, "moves_at_lr01": True, "groups": 1}, f"rank {rank}: {got}"


@pytest.mark.dist
def test_state_dict_round_trip() -> None:
    """An unsharded state dict (gathered on rank 0) loads back into the sharded model after training."""
    assert _api("state_dict")[0]["changed_by_training"] and _api("state_dict")[0]["restored"]
    for got in _api("state_dict"):
        assert got["missing"] == [] and got["unexpected"] == []
        assert "unexpected keys ['over_arch.extra']" in got["unexpected_strict"]
        assert got["not_a_mapping"] == "TypeError: state_dict must be a mapping, got list"


@pytest.mark.dist
def test_copy_is_independent_and_data_parallel() -> None:
    for rank, got in enumerate(_api("copy")):
        assert got["same_output"] and got["shares_nothing"] and got["fused_on_twin"], f"rank {rank}: {got}"
        assert got["original_untouched"] and got["twin_trained"], f"rank {rank}: {got}"
        assert got["twin_is_ddp"] == "DistributedDataParallel"
        assert got["bad_device"].startswith("TypeError: device must be a real torch.device")


class _QuantModel(nn.Module):
    """A sharded INT8 collection, an unsharded one (outside the plan) and a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.sharded, self.unsharded = (self._quant_ebc(prefix) for prefix in ("s", "u"))
        self.dense = nn.Linear(8, 2)

    @staticmethod
    def _quant_ebc(prefix: str) -> QuantEmbeddingBagCollection:
        configs = [EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name=f"{prefix}{t}",
                                      feature_names=[f"{prefix}f{t}"]) for t in range(2)]  # fmt: skip
        ebc = EmbeddingBagCollection(configs, backend="torch")
        return QuantEmbeddingBagCollection.from_float(ebc, DataType.INT8, backend="torch")

    def forward(self, sharded: KeyedJaggedTensor, unsharded: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sharded(sharded).values() + self.unsharded(unsharded).values())


def test_copy_calls_the_copy_of_modules_that_define_one() -> None:
    """As torchrec's DMP.copy (``CopyMixIn``): the quantized collections' ``copy(device)`` (themselves: their tables
    stay on their devices) replaces deep-copying them, the rest is deep-copied (ours deep-copied and moved the
    sharded collection's shards too)."""
    torch.manual_seed(0)
    model, sharder = _QuantModel(), QuantEmbeddingBagCollectionSharder()
    plan = {"s0": table_wise(rank=0), "s1": table_wise(rank=1)}
    plan = ShardingPlan({"sharded": construct_module_sharding_plan(model.sharded, plan, sharder, 2, 2, "cpu")})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_local(2, 0), device=torch.device("cpu"), plan=plan,
                                   sharders=[sharder], init_data_parallel=False)  # fmt: skip
    twin = dmp.copy(torch.device("cpu"))
    assert twin.module.sharded is dmp.module.sharded and twin.module.unsharded is dmp.module.unsharded
    assert twin.module.dense is not dmp.module.dense
    assert twin.module.dense.weight.data_ptr() != dmp.module.dense.weight.data_ptr()
    kjt = {
        p: KeyedJaggedTensor([f"{p}f0", f"{p}f1"], torch.tensor([0, 5, 2, 3, 1]), lengths=torch.tensor([2, 1, 0, 2]))
        for p in "su"
    }
    with torch.no_grad():
        assert torch.equal(twin(kjt["s"], kjt["u"]), dmp(kjt["s"], kjt["u"]))


def test_default_plan_of_a_quantized_collection_uses_its_quant_kernel() -> None:
    """DMP without a plan: a quantized collection has no optimizer to fuse, but its sharder offers no dense kernel
    either (its tables are not trained), so the default plan must not restrict it to the dense kernel (it raised
    "no sharding option left")."""
    torch.manual_seed(0)
    model, sharder = _QuantModel(), QuantEmbeddingBagCollectionSharder()
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_local(2, 0), device=torch.device("cpu"),
                                   sharders=[sharder], init_data_parallel=False)  # fmt: skip
    kernels = {p.compute_kernel for m in dmp.plan.plan.values() for p in m.values()}
    assert kernels == {"quant"}


@pytest.mark.dist
def test_sparse_grad_names_and_meta_build() -> None:
    for rank, got in enumerate(_api("sparse_meta")):
        assert got["sparse_names"] == ["bag.weight"], f"rank {rank}"
        # each rank drew different meta-initialised values: DDP and the replicated-table broadcast make them equal
        assert got["meta_dense_equal"] and got["meta_tables_equal"] and got["meta_on_cpu"], f"rank {rank}: {got}"
        assert 0.0 < got["meta_loss"] < 5.0


@pytest.mark.dist
def test_compressed_all_reduce_of_dense_gradients() -> None:
    for rank, got in enumerate(_api("comm_precision")):
        assert got["fp16"]["names"] and got["bf16"]["names"], f"rank {rank}"
        assert 0.0 < got["fp16"]["max_rel"] < 1e-2, f"rank {rank}: fp16 all-reduce off by {got['fp16']['max_rel']}"
        assert 0.0 < got["bf16"]["max_rel"] < 5e-2, f"rank {rank}: bf16 all-reduce off by {got['bf16']['max_rel']}"
        assert got["bf16"]["max_rel"] > got["fp16"]["max_rel"]  # bf16 keeps fewer mantissa bits


@pytest.mark.dist
def test_dropped_model_frees_its_tables() -> None:
    for rank, got in enumerate(_api("released")):
        for kind, counts in got.items():
            assert counts["buffers"] > 0 and counts["alive"] == 0, f"rank {rank}, {kind}: {counts}"


@pytest.mark.dist
def test_bad_input_on_ranks() -> None:
    got = _api("bad_input")[0]
    assert got["missing_path"] == "ValueError: the plan shards module 'sparse_arch.nope', which the model does not have"
    assert got["no_sharder"].startswith("ValueError: the plan shards module 'dense_arch' (DenseArch) but no sharder")
    assert got["bad_plan"] == "TypeError: plan must be a ShardingPlan, got dict"
    assert got["bad_sharders"] == "TypeError: sharders must hold ModuleSharder instances, got object"
    assert got["meta_device"].startswith("ValueError: device must be a real torch.device")
    assert got["bad_env"] == "TypeError: env must be a ShardingEnv, got str"


@pytest.mark.dist
def test_meta_build_materialises_only_this_ranks_shards() -> None:
    """Peak RSS growth while building: the row-wise DMP of a meta model holds half the tables per rank."""
    for rank, got in enumerate(suite_results("memory", WORLD)):
        local, whole = got["local_param_bytes"], got["model_param_bytes"]
        assert local < 0.55 * whole, f"rank {rank}: holds {local} of {whole} parameter bytes"
        dmp_mib, unsharded_mib = got["dmp_peak_growth"] >> 20, got["unsharded_peak_growth"] >> 20
        report = f"rank {rank}: DMP peak +{dmp_mib} MiB, unsharded +{unsharded_mib} MiB"
        # the shards and their optimizer state, plus a little; never the whole model
        assert got["dmp_peak_growth"] < local + 0.15 * whole, report
        assert got["unsharded_peak_growth"] > 0.95 * whole, report
        print(report, f"({MEMORY_TABLES} tables, {whole >> 20} MiB)")


def test_bad_input_without_process_group() -> None:
    with pytest.raises(TypeError, match="module must be an nn.Module, got int"):
        DistributedModelParallel(3)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="needs a process group"):
        DistributedModelParallel(build_dlrm())
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number, got bucket_cap_mb=0"):
        DefaultDataParallelWrapper(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="allreduce_comm_precision must be None, 'fp16' or 'bf16', got 'fp8'"):
        DefaultDataParallelWrapper(allreduce_comm_precision="fp8")
    with pytest.raises(TypeError, match="static_graph must be a bool, got static_graph=1"):
        DefaultDataParallelWrapper(static_graph=1)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="deterministic_allreduce must be None or a bool, got deterministic_allreduce='on'"
    ):
        DefaultDataParallelWrapper(deterministic_allreduce="on")  # type: ignore[arg-type]


@pytest.mark.dist
def test_default_plan_fuses_only_collections_with_an_optimizer() -> None:
    """No plan given: plain collections (EBC, EC, feature-processed) get the dense kernel and train with the caller's
    optimizer; fused modules and a sharder with an optimizer keep the fused kernel (the planner used to pick it for
    plain modules too, and sharding raised for want of an optimizer)."""
    for rank, result in enumerate(_api("default_plan")):
        for name in ("ebc", "ec", "fp"):
            assert result[name]["kernels"] == ["dense"], (rank, name, result[name])
        for name in ("fused_ebc", "fp_fused", "ec_sharder_optimizer"):
            assert result[name]["kernels"] == ["fused"], (rank, name, result[name])
        for name, got in result.items():
            assert got["changed"] == got["tables"] > 0, (rank, name, got)  # every local table shard trained


def test_deterministic_hook_raises_a_failed_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather that fails must fail the bucket's future, not hand DDP the never-filled receive buffer."""
    import importlib

    # by module path: tritonrec.dist.data_parallel is also the name of the sharding-type generator
    data_parallel = importlib.import_module("tritonrec.dist.data_parallel")

    class _FailedWork:
        def get_future(self) -> torch.futures.Future:
            future: torch.futures.Future = torch.futures.Future()
            future.set_exception(RuntimeError("gather timed out"))
            return future

    class _Bucket:
        def __init__(self) -> None:
            self.gradients = torch.ones(6)

        def buffer(self) -> torch.Tensor:
            return self.gradients

    monkeypatch.setattr(data_parallel, "all_gather_tensor", lambda *args, **kwargs: _FailedWork())
    monkeypatch.setattr(data_parallel.dist, "get_world_size", lambda group=None: 3)
    hook = data_parallel.deterministic_allreduce_hook()
    with pytest.raises(RuntimeError, match="gather timed out"):
        hook(None, _Bucket()).wait()


def test_embedding_sharders_share_torchrecs_base_embedding_sharder() -> None:
    """Every embedding sharder carries fused_params through BaseEmbeddingSharder and refuses a non-dict by name."""
    from tritonrec.dist import (
        BaseEmbeddingSharder,
        EmbeddingBagCollectionSharder,
        EmbeddingCollectionSharder,
        EmbeddingTowerCollectionSharder,
        EmbeddingTowerSharder,
        FeatureProcessedEmbeddingBagCollectionSharder,
        ManagedCollisionEmbeddingBagCollectionSharder,
        ManagedCollisionEmbeddingCollectionSharder,
    )

    kinds = [EmbeddingBagCollectionSharder, EmbeddingCollectionSharder, EmbeddingTowerCollectionSharder,
             EmbeddingTowerSharder, FeatureProcessedEmbeddingBagCollectionSharder,
             ManagedCollisionEmbeddingBagCollectionSharder, ManagedCollisionEmbeddingCollectionSharder]  # fmt: skip
    for kind in kinds:
        sharder = kind(fused_params={"learning_rate": 0.1})
        assert isinstance(sharder, BaseEmbeddingSharder) and sharder.fused_params == {"learning_rate": 0.1}, kind
        with pytest.raises(TypeError, match="fused_params must be a dict or None, got list"):
            kind(fused_params=[("learning_rate", 0.1)])  # type: ignore[arg-type]
    assert EmbeddingCollectionSharder(use_index_dedup=True)._use_index_dedup
