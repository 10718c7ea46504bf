"""The tensor-collective aliases: looked up on ``torch.distributed`` at call time, and the only way the package
calls the renamed all-gather / reduce-scatter (their old names warn on every call in torch 2.13)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from tritonrec.dist.tensor_collectives import all_gather_tensor, reduce_scatter_tensor

ROOT = Path(__file__).resolve().parents[2]


def test_aliases_call_what_torch_distributed_holds_now(monkeypatch) -> None:
    calls = []

    def recorder(name):
        def fn(output, input, group=None, async_op=False):
            calls.append((name, output.shape, input.shape, group, async_op))
            return "work"

        return fn

    out, inp = torch.zeros(4), torch.zeros(2)
    renamed = (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor"))
    for new, old in renamed:
        monkeypatch.setattr(dist, new, recorder(new), raising=False)
        monkeypatch.setattr(dist, old, recorder(old))
    assert all_gather_tensor(out, inp, group="g", async_op=True) == "work"
    assert reduce_scatter_tensor(inp, out, async_op=False) == "work"
    assert calls == [
        ("all_gather_single", out.shape, inp.shape, "g", True),
        ("reduce_scatter_single", inp.shape, out.shape, None, False),
    ]
    # a torch without the new names: the old ones
    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "reduce_scatter_single")
    calls.clear()
    all_gather_tensor(out, inp)
    reduce_scatter_tensor(inp, out)
    assert [c[0] for c in calls] == ["all_gather_into_tensor", "reduce_scatter_tensor"]


def test_package_calls_no_deprecated_collective_name_directly() -> None:
    old_names = "all_gather_into_tensor|reduce_scatter_tensor|_all_gather_base|_reduce_scatter_base"
    pattern = re.compile(rf"\b(dist|distributed|c10d)\.({old_names})\b")
    offenders = []
    for folder in ("dist", "data", "modules", "kernels", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "tensor_collectives.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "call tritonrec.dist.tensor_collectives instead:\n" + "\n".join(offenders)
