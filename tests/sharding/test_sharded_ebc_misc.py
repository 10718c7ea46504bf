"""Sharded EBC on 2 gloo ranks: bad plans and inputs raise clear errors naming the culprit; a meta-device module is
sharded without touching its weights (each shard initialised by its config's init_fn); gradient division scales
every sharding's gradient by 1/W alike; fused_params (weights precision, the Adagrad rules' initial_accumulator_value)
and a fused module's own optimizer reach the local lookups. Rank-side code: misc_cases.py."""

from __future__ import annotations

import pytest

from tests.sharding.spawned import suite_results

pytestmark = pytest.mark.dist

EXPECTED_ERRORS = {
    "fused_without_optimizer": r"ValueError: table 't0': the fused compute kernel needs an optimizer",
    "plan_missing_table": r"ValueError: tables \['t2'\] have no ParameterSharding",
    "unknown_fused_param": r"ValueError: fused_params has unknown keys \['lrr'\]",
    "bad_hyperparameter": r"ValueError: lr must be a non-negative number, got lr=-1",
    "no_process_group": r"ValueError: TwCwSharding needs a process group",
    "not_an_ebc": r"TypeError: module must be an EmbeddingBagCollection, got Linear",
    "missing_key": r"ValueError: features is missing keys \['f4'\]",
    "index_out_of_range": r"ValueError: index 12 of feature 'f1' is outside its table's \[0, 12\) rows",
    "not_a_kjt": r"TypeError: features must be a KeyedJaggedTensor, got Tensor",
    "vbe_without_inverse": r"ValueError: a variable batch per feature \(VBE\) needs the KJT's inverse_indices",
    "weighted_without_weights": r"ValueError: ShardedEmbeddingBagCollection is weighted .* but features has no weights",
    "vbe_on_twrw": r"ValueError: table_row_wise sharding does not take a variable batch per feature",
    "default_sharder": r"EmbeddingBagCollectionSharder",
    # rank 0 rejects its batch; with no input all-to-all, rank 1 learns it from the data-parallel check
    "data_parallel_rejection": r"ValueError: .*(features is missing keys \['f4'\]|rank 0 rejected its input)",
}


@pytest.mark.parametrize("case", sorted(EXPECTED_ERRORS))
def test_bad_plans_and_inputs_raise_clear_errors(case: str) -> None:
    import re

    for rank, results in enumerate(suite_results("misc", 2)):
        message = results["errors"][case]
        assert re.search(EXPECTED_ERRORS[case], message), f"rank {rank}: {message}"


def test_meta_module_is_sharded_with_init_fn() -> None:
    for rank, results in enumerate(suite_results("misc", 2)):
        meta = results["meta"]
        assert meta["devices"] == ["cpu"], f"rank {rank}: {meta['devices']}"
        assert meta["init"], f"rank {rank}: a local shard is not its table's init_fn output"
        assert meta["forward_shape"] == [[3, 5][rank], 8 * 2 + 3 + 1 + 64]
        assert all(name.startswith("embedding_bags.") for name in meta["names"]), meta["names"]


def test_gradient_division_divides_every_sharding_by_world_size() -> None:
    for rank, results in enumerate(suite_results("misc", 2)):
        assert results["division"]["grad_times_world"] <= 1e-6, f"rank {rank}: {results['division']}"


def test_fused_params_reach_the_lookups() -> None:
    for rank, results in enumerate(suite_results("misc", 2)):
        got = results["options"]
        assert got["dtypes"] == ["torch.float16"], f"rank {rank}: weights_precision FP16 gave {got['dtypes']}"
        assert got["fp16_forward"] <= 2e-3, f"rank {rank}: fp16 shards' forward differs by {got['fp16_forward']}"
        assert got["module_optimizer"] == ["ShardedEmbeddingFusedOptimizer", 0.003, [0.8, 0.9]], got["module_optimizer"]
        assert got["module_state_keys"] == ["momentum1", "momentum2", "step"], got["module_state_keys"]


def test_a_fused_modules_scheduler_keys_do_not_reach_its_lookups() -> None:
    """An LR scheduler adds ``initial_lr`` to the fused optimizer's live group (and to its saved state dicts): the
    sharded lookups take the rule's hyperparameters from it and leave the scheduler's keys (in-process, no ranks)."""
    import torch

    from tritonrec.dist.fused_params import parse_fused_params
    from tritonrec.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection

    tables = [EmbeddingBagConfig(num_embeddings=4, embedding_dim=3, name="t0", feature_names=["f0"])]
    module = FusedEmbeddingBagCollection(tables, torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-3}, backend="torch")
    scheduler = torch.optim.lr_scheduler.StepLR(module.fused_optimizer, step_size=1, gamma=0.5)
    scheduler.step()
    assert module.fused_optimizer.param_groups[0]["initial_lr"] == 0.2
    options = parse_fused_params(None, module)
    assert options.fused.hyperparams == {"lr": 0.1, "eps": 1e-3, "weight_decay": 0.0, "initial_accumulator_value": 0.0}


@pytest.mark.parametrize("optimizer", ["EXACT_ROWWISE_ADAGRAD", "EXACT_ADAGRAD"])
def test_initial_accumulator_value_starts_every_shards_state(optimizer: str) -> None:
    for rank, results in enumerate(suite_results("misc", 2)):
        got = results["initial_accumulator"][optimizer]
        assert got["weights"] <= 1e-5, f"rank {rank}: weights differ from the unsharded module by {got['weights']}"
        assert got["state"] <= 1e-5, f"rank {rank}: optimizer state differs by {got['state']}"
