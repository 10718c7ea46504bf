"""Resetting the rows a sharded managed-collision module handed to new ids (torchrec's
``BaseShardedManagedCollisionEmbeddingCollection._evict``).

torchrec 1.8's sharded MC-EC / MC-EBC, after the MCH remap and before the lookup, takes each table's evicted rows
(local to this rank's row shard) and

* calls FBGEMM's ``reset_embedding_weight_momentum``: for ``EXACT_ROWWISE_ADAGRAD`` it zeroes those rows' weights
  and their ``momentum1`` (for every other rule FBGEMM does nothing);
* sets the rows to the table config's ``init_fn`` applied to them (through ``.data`` with
  ``allow_in_place_embed_weight_update``).

Here the weights get the same ``init_fn`` redraw (:func:`~tritonrec.modules.mc_embedding_modules.reinit_rows`) and,
for fused tables, every per-row optimizer state of those rows returns to a fresh state's value (rowwise Adagrad's
``momentum1``, as FBGEMM; also Adagrad's per-element ``momentum1`` and Adam's two moments, which FBGEMM 1.8 leaves
with the evicted id's history). Per-table step counters are not per row and stay. Each rank touches only the rows of
its own shards; nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tritonrec.dist.embedding_lookup import GroupedEmbeddingLookup
from tritonrec.kernels.checks import host_ints, value_checks_enabled
from tritonrec.kernels.embedding import FusedOptimizerState, OptimType, TableBatchedLayout
from tritonrec.modules.mc_embedding_modules import reinit_rows


def reset_state_rows(state: FusedOptimizerState, layout: TableBatchedLayout, table: int, rows: torch.Tensor) -> None:
    """Rows ``rows [E]`` of table ``table`` of ``layout`` back to a fresh ``state``'s values: Adagrad's
    ``momentum1`` to ``initial_accumulator_value`` (0 by default, FBGEMM's reset), Adam's moments to 0."""
    with torch.no_grad():
        if state.momentum1 is not None:
            adagrad_start = float(state.hyperparams.get("initial_accumulator_value", 0.0))
            fresh = 0.0 if state.optim == OptimType.ADAM else adagrad_start
            if state.optim == OptimType.EXACT_ROWWISE_ADAGRAD:  # one value per row: [num_rows]
                state.momentum1[layout.table_row_offsets[table] + rows] = fresh
            else:  # laid out like the weights
                layout.table_view(state.momentum1, table)[rows] = fresh
        if state.momentum2 is not None:
            layout.table_view(state.momentum2, table)[rows] = 0.0


def reset_evicted_rows(
    lookups: Iterable[GroupedEmbeddingLookup],
    evictions: dict[str, torch.Tensor | None],
    bypass_autograd: bool = False,
) -> None:
    """Every local shard in ``lookups`` of a table with rows in ``evictions`` (``{table: [E] rows local to this
    rank's shard, or None}``): those rows redrawn with the table's ``init_fn`` and their fused optimizer state reset
    (module docstring). ``bypass_autograd``: write the weights through ``.data``."""
    for lookup in lookups:
        for group in lookup.groups:
            for t, (shard, module) in enumerate(zip(group.shards, group.table_group.modules, strict=True)):
                rows = evictions.get(shard.table.name)
                if rows is None or rows.numel() == 0:
                    continue
                weight = module.weight
                rows = rows.to(weight.device, torch.int64)
                if value_checks_enabled():  # one host read; an outside row would wrap into another row
                    low, high = host_ints(*torch.aminmax(rows))
                    if low < 0 or high >= shard.spec.rows:
                        bad = int(rows[(rows < 0) | (rows >= shard.spec.rows)][0])
                        raise ValueError(
                            f"evictions[{shard.table.name!r}] holds row {bad}, outside this rank's shard "
                            f"[0, {shard.spec.rows})"
                        )
                reinit_rows(weight, rows, shard.table.config.init_fn, bypass_autograd)  # type: ignore[arg-type]
                if group.state is not None:
                    reset_state_rows(group.state, group.layout, t, rows)


__all__ = ["reset_evicted_rows", "reset_state_rows"]
