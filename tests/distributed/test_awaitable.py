"""Awaitable, NoWait, LazyAwaitable, LazyNoWait (in-process: no collectives involved)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from tritonrec.dist.awaitable import Awaitable, LazyAwaitable, LazyNoWait, NoWait


class _Counting(LazyAwaitable[torch.Tensor]):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value
        self.waits = 0

    def _wait_impl(self) -> torch.Tensor:
        self.waits += 1
        return self.value


class _Forgetful(LazyAwaitable[int]):
    def __init__(self) -> None:  # does not call super().__init__()
        pass

    def _wait_impl(self) -> int:
        return 1


def test_awaitable_is_abstract_and_callbacks_chain() -> None:
    with pytest.raises(TypeError):
        Awaitable()  # type: ignore[abstract]
    awaitable = NoWait(3)
    awaitable.callbacks.append(lambda x: x + 1)
    awaitable.callbacks.append(lambda x: x * 10)
    assert awaitable.wait() == 40


def test_lazy_awaitable_waits_on_torch_function_once() -> None:
    lazy = _Counting(torch.tensor([1.0, 2.0]))
    assert lazy.waits == 0
    assert torch.equal(torch.add(lazy, 1), torch.tensor([2.0, 3.0]))
    assert torch.equal(torch.cat([lazy, torch.zeros(1)]), torch.tensor([1.0, 2.0, 0.0]))  # inside a list
    assert torch.equal(torch.sum(input=lazy), torch.tensor(3.0))  # as a keyword
    assert lazy.waits == 1  # cached after the first use


def test_lazy_awaitable_operators_and_attributes() -> None:
    lazy = LazyNoWait(torch.tensor([1.0, -2.0]))
    assert torch.equal(lazy + 1, torch.tensor([2.0, -1.0]))
    assert torch.equal(2 * lazy, torch.tensor([2.0, -4.0]))  # reflected
    assert torch.equal(-lazy, torch.tensor([-1.0, 2.0]))
    flags = LazyNoWait(torch.tensor([True, True]))
    assert torch.equal(flags & LazyNoWait(torch.tensor([True, False])), torch.tensor([True, False]))  # and_
    assert lazy[1].item() == -2.0
    assert torch.equal(lazy == 1.0, torch.tensor([True, False]))
    assert lazy.shape == (2,) and lazy.sum().item() == -1.0  # attributes of the result


def test_lazy_awaitable_callbacks_run_at_first_use() -> None:
    lazy = LazyNoWait(torch.tensor([1.0]))
    lazy.callbacks.append(lambda t: t * 5)
    assert (lazy + 0).item() == 5.0


def test_lazy_awaitable_copies_and_pickles_without_waiting() -> None:
    lazy = _Counting(torch.tensor([1.0]))
    clone = copy.deepcopy(lazy)
    restored = pickle.loads(pickle.dumps(LazyNoWait(7)))
    assert lazy.waits == 0 and clone.waits == 0
    assert restored.wait() == 7


def test_lazy_awaitable_without_init_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"_Forgetful was not initialised: its __init__ must call super"):
        torch.add(_Forgetful(), 1)
