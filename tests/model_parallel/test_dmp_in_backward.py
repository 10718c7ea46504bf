"""``apply_optimizer_in_backward`` on a plain EBC's tables chooses the sharded tables' fused optimizer, as in torchrec
(rank-side code: in_backward_cases.py): DMP training on 2 ranks equals torch's own optimizer (or the unsharded fused
module for Adam) on the global batch, for table-wise, row-wise, column-wise, data-parallel and the planner's plan; the
tables leave the dense optimizer; tables of one module with different optimizers (or learning rates) train each with
its own, with one fused param group per optimizer (an lr edit reaches exactly its tables, a DCP checkpoint restores
identical training); what one fused table cannot honour is refused by name."""

from __future__ import annotations

import pytest

from tests.model_parallel.in_backward_cases import CASES, expected_group_lrs
from tests.model_parallel.spawned import suite_results

WORLD = 2


def _results() -> list[dict]:
    return suite_results("in_backward", WORLD)


def _tables_of(case: str, lr: float) -> set[str]:
    """The tables ``case`` applies an optimizer with ``lr`` to."""
    every = {"t0", "t1", "t2", "t3"}
    return {t for _, kwargs, tables in CASES[case][1] if kwargs["lr"] == lr for t in (tables or every)}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_training_follows_the_in_backward_optimizer(case: str) -> None:
    kwargs = CASES[case][1][0][1]
    lrs = expected_group_lrs(case)
    for rank, got in enumerate(r[case] for r in _results()):
        assert got["kernels"] == ["fused"], f"rank {rank}: {got['kernels']}"
        assert got["dense_names"] == [], f"rank {rank}: tables left in the dense optimizer {got['dense_names']}"
        assert got["loss"] < 1e-5 and got["tables"] < 1e-5 and got["state"] < 1e-5, f"rank {rank}: {got}"
        assert [group["lr"] for group in got["fused_groups"]] == lrs, f"rank {rank}: {got['fused_groups']}"
        if "betas" in kwargs:
            assert tuple(got["fused_groups"][0]["betas"]) == kwargs["betas"], f"rank {rank}: {got['fused_groups']}"
        # each param group holds exactly this rank's shards of its optimizer's tables
        expected = [sorted(_tables_of(case, lr) & set(got["local_tables"])) for lr in lrs]
        assert got["group_tables"] == expected, f"rank {rank}: {got['group_tables']} != {expected}"


@pytest.mark.dist
def test_an_lr_edit_reaches_exactly_its_groups_tables() -> None:
    for rank, got in enumerate(r["lr_edit"] for r in _results()):
        assert got["lrs"] == [0.1, 0.0], f"rank {rank}: {got}"
        adagrad, sgd = f"t{rank}", f"t{rank + 2}"  # table-wise: rank r holds t_r and t_(r+2)
        assert got["moved"] == {adagrad: True, sgd: False}, f"rank {rank}: {got}"


@pytest.mark.dist
def test_a_checkpoint_of_per_table_optimizers_restores_identical_training() -> None:
    for rank, got in enumerate(r["checkpoint"] for r in _results()):
        for kind in ("tw", "rw"):
            assert got[kind]["lrs"] == [0.1, 0.3], f"rank {rank} {kind}: the saved lr edit is lost: {got[kind]}"
        tw = got["tw"]
        assert tw["keys"] and tw["loss"] == 0.0 and tw["state"] == 0.0 and tw["whole"] == 0.0, f"rank {rank}: {tw}"
        rw = got["rw"]
        assert rw["loss"] < 1e-5 and rw["whole"] < 1e-5, f"rank {rank}: {rw}"


@pytest.mark.dist
def test_rowwise_column_blocks_beside_another_optimizer_train_as_whole_tables() -> None:
    for rank, got in enumerate(r["rowwise_column"] for r in _results()):
        assert got["optims"] == ["EXACT_ROWWISE_ADAGRAD", "EXACT_SGD"], f"rank {rank}: {got}"
        assert got["loss"] < 1e-5 and got["tables"] < 1e-5, f"rank {rank}: {got}"


@pytest.mark.dist
def test_what_one_fused_table_cannot_honour_is_refused() -> None:
    for rank, got in enumerate(r["errors"] for r in _results()):
        assert got["two_optimizers"].startswith("ValueError") and "2 optimizers" in got["two_optimizers"], rank
        assert got["momentum"].startswith("ValueError") and "momentum=0.9" in got["momentum"], got["momentum"]
        assert got["dense_kernel"].startswith("ValueError") and "compute_kernel='fused'" in got["dense_kernel"], rank
        fused = got["fused_dense_kernel"]
        assert fused.startswith("ValueError") and "fused collection's own" in fused and "'t0'" in fused, fused
