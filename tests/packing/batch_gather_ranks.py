"""Per-rank bodies for test_batched_data_dict_gather.py. They live outside the test module so spawned ranks can
import them by a stable name (``packing.batch_gather_ranks``, through the ``tests`` entry pytest puts on sys.path)
however pytest itself was started."""

from __future__ import annotations

from typing import Any

import torch

from tritonrec.data.batched_data_dict import BatchedDataDict


def _error_of(batch: BatchedDataDict) -> str | None:
    try:
        batch.all_gather()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def gather_cases(rank: int, world_size: int) -> dict[str, Any]:
    rows = rank + 1  # ranks hold 1, 2, 3 rows
    batch = BatchedDataDict(
        {
            "ids": torch.arange(rows) + 10 * rank,
            "hidden": torch.full((rows, 2, 3), float(rank)),
            "tags": [f"r{rank}.{i}" for i in range(rows)],
        }
    )
    gathered = batch.all_gather()
    return {
        "type": type(gathered).__name__,
        "ids": gathered["ids"].tolist(),
        "hidden": gathered["hidden"][:, 0, 0].tolist(),
        "hidden_shape": tuple(gathered["hidden"].shape),
        "tags": gathered["tags"],
        "shape_error": _error_of(BatchedDataDict({"x": torch.zeros(1, 2 + rank)})),
        "key_error": _error_of(BatchedDataDict({f"key{rank}": torch.zeros(1)})),
        "kind_error": _error_of(BatchedDataDict({"x": torch.zeros(1) if rank else [0]})),
    }
