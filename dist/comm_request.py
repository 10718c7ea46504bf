"""How a comm op becomes an awaitable with autograd: a :class:`CollectivePlan` and two autograd Functions.

Every comm op is four steps, written once per op as a :class:`CollectivePlan`::

    launch_forward(inputs)    -> InFlight    encode, start the collective (async_op=True)
    finish_forward(received)  -> output      after wait(): decode, lay out
    launch_backward(grads)    -> InFlight    encode gradients, start the transposed collective
    finish_backward(received) -> grads       decode, lay out as the inputs' gradients

and two generic autograd Functions run them (torchrec's Req/Wait pair, once for all ops)::

    token  = _Launch.apply(request, *inputs)    # forward: launch;  backward: wait + finish_backward
    output = _Finish.apply(request, token)      # forward: wait + finish_forward (at Request.wait());
                                                # backward: launch_backward
The zero-size ``token`` links the two nodes in the graph, so the backward collective launches as soon as the output's
gradient exists and is only waited for when autograd reaches ``_Launch``: communication overlaps compute both ways.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.comm_wire import InFlight, WireTraffic

if TYPE_CHECKING:
    from tritonrec.dist.qcomm_protocol import QuantizedCommCodec, QuantizedCommCodecs

W = TypeVar("W")


class CollectivePlan(abc.ABC):
    """One call of a comm op: its fixed metadata (splits, shapes, codecs) and its four steps."""

    #: the public op's name, used in error messages (e.g. timeouts)
    name: str = "collective"

    def __init__(self, group: dist.ProcessGroup, codecs: QuantizedCommCodecs | None, gradient_division: bool) -> None:
        self.group = group
        self.world_size = group.size()
        self.rank = group.rank()
        self.codecs = codecs
        self.gradient_division = gradient_division

    @property
    def forward_codec(self) -> QuantizedCommCodec | None:
        return None if self.codecs is None else self.codecs.forward

    @property
    def backward_codec(self) -> QuantizedCommCodec | None:
        return None if self.codecs is None else self.codecs.backward

    @property
    def backward_name(self) -> str:
        return f"{self.name} backward"

    @abc.abstractmethod
    def launch_forward(self, inputs: tuple[torch.Tensor, ...]) -> InFlight[Any]: ...

    @abc.abstractmethod
    def finish_forward(self, received: Any) -> torch.Tensor | tuple[torch.Tensor, ...]: ...

    @abc.abstractmethod
    def launch_backward(self, grads: tuple[torch.Tensor, ...]) -> InFlight[Any]: ...

    @abc.abstractmethod
    def finish_backward(self, received: Any) -> tuple[torch.Tensor, ...]:
        """One gradient per forward input."""


class _Mailbox:
    """What a request's two autograd nodes share: the plan, the collective in flight and the wire records. Not the
    request itself: it holds the output, and a node whose context reaches its own output forms a reference cycle
    through autograd's C++ edges that Python's collector cannot see - every step's graph (its inputs, the tables it
    read) would stay alive."""

    __slots__ = ("backward_traffic", "forward_traffic", "in_flight", "plan")

    def __init__(self, plan: CollectivePlan) -> None:
        self.plan = plan
        self.in_flight: InFlight[Any] | None = None
        self.forward_traffic: WireTraffic | None = None
        self.backward_traffic: WireTraffic | None = None

    def take_in_flight(self) -> InFlight[Any]:
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            raise RuntimeError(f"{self.plan.name}: no collective in flight (was backward run twice?)")
        return in_flight


class Request(Awaitable[W]):
    """The awaitable a comm op returns: launched at construction, finished by ``wait()`` (once; later waits return
    the same result). ``forward_traffic`` / ``backward_traffic`` record what went on the wire."""

    def __init__(self, plan: CollectivePlan, inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self._mailbox = _Mailbox(plan)
        self._result: Any = None
        self._token: torch.Tensor | None = _Launch.apply(self._mailbox, *inputs)

    @property
    def plan(self) -> CollectivePlan:
        return self._mailbox.plan

    @property
    def forward_traffic(self) -> WireTraffic | None:
        return self._mailbox.forward_traffic

    @property
    def backward_traffic(self) -> WireTraffic | None:
        return self._mailbox.backward_traffic

    def _wait_impl(self) -> W:
        if self._token is not None:
            result = _Finish.apply(self._mailbox, self._token)
            self._result = list(result) if isinstance(result, tuple) else result
            self._token = None
        return self._result


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, mailbox: _Mailbox, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        in_flight = mailbox.plan.launch_forward(inputs)
        mailbox.in_flight = in_flight
        mailbox.forward_traffic = in_flight.traffic
        ctx.mailbox = mailbox
        return torch.empty(0, device=inputs[0].device)

    @staticmethod
    def backward(ctx: Any, _token_grad: torch.Tensor) -> tuple[Any, ...]:
        mailbox: _Mailbox = ctx.mailbox
        plan = mailbox.plan
        grads = plan.finish_backward(mailbox.take_in_flight().wait())
        if plan.gradient_division and plan.world_size > 1:
            # torchrec's convention: gradients of model-parallel outputs are averaged over ranks, as data-parallel
            # gradients are by DDP, so one learning rate fits both.
            grads = tuple(g.div_(plan.world_size) for g in grads)
        return (None, *grads)


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, mailbox: _Mailbox, token: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.mailbox = mailbox
        ctx.token_device = token.device
        return mailbox.plan.finish_forward(mailbox.take_in_flight().wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        mailbox: _Mailbox = ctx.mailbox
        in_flight = mailbox.plan.launch_backward(tuple(g.contiguous() for g in grads))
        mailbox.in_flight = in_flight
        mailbox.backward_traffic = in_flight.traffic
        return None, torch.zeros(0, device=ctx.token_device)


__all__ = ["CollectivePlan", "Request"]
