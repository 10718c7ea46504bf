"""Checkpoints and ``TrainPipelineSparseDist`` of tower sharding on 4 gloo ranks as 2 hosts of 2 (each tower's tables
sharded over its host's two ranks, its interaction replicated on them under DDP over the host group). Rank-side code
runs in test_tower_sharding_hosts.py's spawn (tower_sharding_host_cases.py's ``checkpoint``,
``tower_sharder_checkpoint`` and ``pipeline``): the same cases and checks as the one-rank-per-host ones
(test_tower_sharding_checkpoint.py, test_tower_sharding_pipeline.py), now with both ranks of a host saving,
loading and pipelining one tower."""

from __future__ import annotations

import pytest

from tests.model_parallel import test_tower_sharding_checkpoint as checkpoint
from tests.model_parallel.test_tower_sharding_hosts import results
from tests.model_parallel.test_tower_sharding_pipeline import check_bit_equal, check_pipelined

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("suite", checkpoint.SUITES)
def test_gather_unsharded_state_dict_sees_both_ranks_of_each_host(suite: str) -> None:
    checkpoint.check_gather(results(suite))


@pytest.mark.parametrize("suite", checkpoint.SUITES)
def test_checkpoint_read_as_plain_tensors_is_the_gathered_state(suite: str) -> None:
    checkpoint.check_unsharded_file(results(suite))


@pytest.mark.parametrize("suite", checkpoint.SUITES)
@pytest.mark.parametrize("plan", ["same_plan", "swapped_plan"])
def test_resume_continues_training_exactly(suite: str, plan: str) -> None:
    """Losses on every rank and every gathered weight and optimizer-visible entry bit-equal to the uninterrupted
    run, under the saving plan and with the towers swapped between the hosts."""
    checkpoint.check_resume(results(suite), plan)


@pytest.mark.parametrize("suite", checkpoint.SUITES)
def test_full_unsharded_state_dict_loads_into_the_tower_sharded_model(suite: str) -> None:
    checkpoint.check_load_state_dict(results(suite))


def test_the_tower_collection_is_pipelined_without_fallback() -> None:
    check_pipelined(results("pipeline"))


def test_sparse_dist_pipeline_equals_the_base_pipeline_bit_for_bit() -> None:
    check_bit_equal(results("pipeline"))
