"""Rank-side cases for sharded state: state-dict keys and types, loading an unsharded module's full state dict,
gathering the unsharded state dict on one rank, and torch.distributed.checkpoint (DCP) saving a trained module under
one plan and loading it (weights and fused optimizer state) into a module under another plan."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from tests.sharding.ebc_cases import BATCH_PER_RANK, Case, build_pair, global_batch, kjt_slice, max_diff
from tests.sharding.ebc_cases import plans_by_type as _plans


def _other_plan() -> dict[str, Any]:
    """A second plan for the same tables: every table moves (column-wise, row-wise, table-wise, grid)."""
    from tritonrec.dist import column_wise, grid_shard, row_wise, table_wise

    return {
        "t0": lambda w: column_wise(ranks=[w - 1, 0]),
        "t1": lambda w: row_wise(),
        "t2": lambda w: table_wise(rank=0),
        "t3": lambda w: grid_shard(host_indexes=[0, 0]),
    }


def _step(module: Any, rank: int, world: int, step: int) -> torch.Tensor:
    batch = BATCH_PER_RANK[world]
    total, lo = sum(batch), sum(batch[:rank])
    lengths, values, weights = global_batch(step, total, False)
    out = module(kjt_slice(lengths, values, weights, lo, lo + batch[rank])).wait().values()
    grad = torch.randn(total, out.shape[1], generator=torch.Generator().manual_seed(77 + step))
    (out * grad[lo : lo + batch[rank]]).sum().backward()
    return out.detach()


def keys_and_load_cases(rank: int, world: int, kind: str = "mixed") -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from tritonrec.dist.sharded_state import gather_unsharded_state_dict

    reference, sharded = build_pair(Case(kind, _plans()[kind]), rank, world)
    state = sharded.state_dict()
    out: dict[str, Any] = {
        "keys": sorted(state) == sorted(reference.state_dict()),
        "types": {k: type(v).__name__ for k, v in state.items()},
    }
    with torch.no_grad():  # a different unsharded module: each rank must keep its slice of it
        for p in reference.parameters():
            p.mul_(-2).add_(0.25)
    result = sharded.load_state_dict(reference.state_dict())
    out["load_result"] = [list(result.missing_keys), list(result.unexpected_keys)]
    gathered = gather_unsharded_state_dict(sharded)
    if rank == 0:
        out["gathered"] = max(max_diff(gathered[k], v) for k, v in reference.state_dict().items())
        out["gathered_keys"] = sorted(gathered) == sorted(reference.state_dict())
    out["sharded_tensor_local"] = all(
        all(s.tensor.data_ptr() for s in v.local_shards() if s.tensor.numel())
        for v in state.values()
        if isinstance(v, ShardedTensor)
    )
    return out


def dcp_case(rank: int, world: int, optimizer: str, kind: str = "mixed") -> dict[str, float]:
    """Train under the ``kind`` plan, save; load into the other plan; one more identical step on both must agree."""
    import torch.distributed.checkpoint as dcp

    from tritonrec.dist.sharded_state import (
        fused_optimizer_state_dict,
        gather_unsharded_state_dict,
        load_fused_optimizer_state_dict,
    )

    _, first = build_pair(Case("a", _plans()[kind], optimizer=optimizer), rank, world)
    torch.manual_seed(100 + rank)
    _, second = build_pair(Case("b", _other_plan(), optimizer=optimizer), rank, world)
    with torch.no_grad():  # the second module starts elsewhere: the load must overwrite everything
        for p in second.parameters():
            p.add_(1.0)
    for step in range(3):
        _step(first, rank, world, step)
    path = [tempfile.mkdtemp(prefix="tritonrec-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save({"model": first.state_dict(), "optim": fused_optimizer_state_dict(first)}, checkpoint_id=path[0])
    target = {"model": second.state_dict(), "optim": fused_optimizer_state_dict(second)}
    dcp.load(target, checkpoint_id=path[0])
    second.load_state_dict(target["model"])
    load_fused_optimizer_state_dict(second, target["optim"])
    weights_a, weights_b = gather_unsharded_state_dict(first), gather_unsharded_state_dict(second)
    out = {"weights": 0.0, "after_step": 0.0, "outputs": 0.0}
    if rank == 0:
        out["weights"] = max(max_diff(weights_b[k], v) for k, v in weights_a.items())
    out_a, out_b = _step(first, rank, world, 3), _step(second, rank, world, 3)
    out["outputs"] = max_diff(out_b, out_a)
    weights_a, weights_b = gather_unsharded_state_dict(first), gather_unsharded_state_dict(second)
    if rank == 0:
        out["after_step"] = max(max_diff(weights_b[k], v) for k, v in weights_a.items())
        shutil.rmtree(path[0], ignore_errors=True)  # every rank is past its load: the gather is collective
    return out


def run_suite(rank: int, world: int) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # DCP / ShardedTensor deprecation notices
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    return {
        "keys_and_load": keys_and_load_cases(rank, world),
        "dcp_adagrad": dcp_case(rank, world, "EXACT_ROWWISE_ADAGRAD"),
        "dcp_adam": dcp_case(rank, world, "ADAM"),
        # uneven column blocks (size_per_rank) saved, loaded into equal blocks / row-wise / table-wise / grid
        "keys_and_load_uneven": keys_and_load_cases(rank, world, "column_wise_uneven"),
        "dcp_uneven_adagrad": dcp_case(rank, world, "EXACT_ROWWISE_ADAGRAD", "column_wise_uneven"),
        # uneven row blocks (sizes_placement, a rank without rows) saved, loaded into the other plan
        "keys_and_load_uneven_rows": keys_and_load_cases(rank, world, "row_wise_uneven"),
        "dcp_uneven_rows_adam": dcp_case(rank, world, "ADAM", "row_wise_uneven"),
    }
