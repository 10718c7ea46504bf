"""Find the sharded modules a pipeline can feed ahead of time, and swap their ``forward`` for one that consumes the
prefetched input dist (torchrec's ``_rewrite_model`` / ``PipelinedForward`` semantics, our code).

The model is traced with torch.fx, sharded modules as leaves. A sharded module can be pipelined when each of its
call's arguments comes from the model's input through attribute reads and indexing only (``batch.sparse_features``,
``batch["x"][0]``), so the pipeline can compute the arguments from batch ``i+1`` and launch its ``input_dist`` while
batch ``i`` is in forward. Tracing stops at the first data-dependent Python branch; the sharded modules called
before it are still found (the partial graph has their calls), any module not reached runs its own forward, with
the reason logged. A module found before the stop is pipelined only when it is certain that the rest of the forward
does not call it again: the forward is traced once more down every way its data-dependent branches can go (up to
:data:`MAX_BRANCH_PATHS` ways), and every one must trace to its end with that one call; else the module runs its
own forward, with the reason (and where tracing stopped) logged. Wrappers (``DistributedModelParallel``,
``DistributedDataParallel``) are looked through.
"""

from __future__ import annotations

import logging
import operator
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tritonrec.data import KeyedJaggedTensor
from tritonrec.dist.awaitable import Awaitable
from tritonrec.dist.train_pipeline.utils import current_stream, record_stream, stream_context
from tritonrec.dist.types import Multistreamable, ShardedModule

logger = logging.getLogger(__name__)


@dataclass
class TrainPipelineContext:
    """One batch's in-flight input dists, per pipelined module name.

    ``input_dist_splits_requests``: launched, split sizes in flight (``Awaitable[Awaitable[dist input]]``);
    ``input_dist_tensors_requests``: splits done, tensors in flight (``Awaitable[dist input]``);
    ``module_contexts``: each module's per-batch context (made by ``create_context``);
    ``input_sources``: the features each module's input dist was started from (to tell a call on other features).
    """

    index: int
    input_dist_splits_requests: dict[str, Awaitable[Any]] = field(default_factory=dict)
    input_dist_tensors_requests: dict[str, Awaitable[Any]] = field(default_factory=dict)
    module_contexts: dict[str, Multistreamable] = field(default_factory=dict)
    input_sources: dict[str, Any] = field(default_factory=dict)

    @property
    def input_dist_started(self) -> bool:
        """Some input dist of this batch is in flight (launched, not yet consumed by the forward)."""
        return bool(self.input_dist_splits_requests or self.input_dist_tensors_requests)


# ------------------------------------------------------------------------------------------------ argument paths
@dataclass(frozen=True)
class ArgInfo:
    """How to get one argument from the batch: ``steps`` applied in order (``("attr", name)`` or ``("item", key)``)
    to the model's input, or a constant."""

    steps: tuple[tuple[str, Any], ...] = ()
    constant: Any = None
    is_constant: bool = False

    def __call__(self, batch: Any) -> Any:
        if self.is_constant:
            return self.constant
        value = batch
        for kind, key in self.steps:
            value = getattr(value, key) if kind == "attr" else value[key]
        return value


@dataclass(frozen=True)
class CallArgs:
    """The positional and keyword arguments of one sharded module call, as paths from the batch."""

    args: tuple[ArgInfo, ...]
    kwargs: tuple[tuple[str, ArgInfo], ...]

    def build(self, batch: Any) -> tuple[list[Any], dict[str, Any]]:
        return [a(batch) for a in self.args], {k: a(batch) for k, a in self.kwargs}


def _arg_info(arg: Any, placeholder: torch.fx.Node) -> ArgInfo | str:
    """The path of ``arg`` from ``placeholder``, or a reason why there is none."""
    if not isinstance(arg, torch.fx.Node):
        if isinstance(arg, (list, tuple, dict)):
            return f"a container argument {type(arg).__name__} (pass the batch's field itself)"
        return ArgInfo(constant=arg, is_constant=True)
    steps: list[tuple[str, Any]] = []
    node = arg
    while node is not placeholder:
        if node.op == "call_function" and node.target is getattr and isinstance(node.args[1], str):
            steps.append(("attr", node.args[1]))
        elif (
            node.op == "call_function"
            and node.target is operator.getitem
            and not isinstance(node.args[1], torch.fx.Node)
        ):
            steps.append(("item", node.args[1]))
        elif node.op == "placeholder":
            return f"it reads the model input {node.target!r}, not the first one (the batch)"
        else:
            return f"its input is computed inside the model ({node.op} {node.target}), not read from the batch"
        node = node.args[0]  # type: ignore[assignment]
    return ArgInfo(steps=tuple(reversed(steps)))


class _ShardedLeafTracer(torch.fx.Tracer):
    """fx tracer that records sharded modules as leaf calls instead of tracing into them."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, ShardedModule) or super().is_leaf_module(m, module_qualified_name)


MAX_BRANCH_PATHS = 32  # ways through a forward's data-dependent branches traced to prove a module is called once
MAX_BRANCHES = 64  # data-dependent branches on one way through a forward (a loop on a tensor's value is unbounded)


class _BranchPathTracer(_ShardedLeafTracer):
    """Goes on past data-dependent branches: the ``k``-th one goes the way ``decisions[k]`` says (False past its
    end); ``taken`` records the ways all of them went."""

    def __init__(self, decisions: list[bool]) -> None:
        super().__init__()
        self._decisions = decisions
        self.taken: list[bool] = []
        self.overflowed = False

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        if len(self.taken) >= MAX_BRANCHES:
            self.overflowed = True  # checked after the trace too, in case the forward catches the error
            raise RuntimeError(f"more than {MAX_BRANCHES} data-dependent branches on one way through the forward")
        k = len(self.taken)
        self.taken.append(self._decisions[k] if k < len(self._decisions) else False)
        return self.taken[-1]


def _raised_by_the_model(error: BaseException) -> bool:
    """Whether ``error`` comes from a ``raise`` or ``assert`` statement of the model's own code (a check on the data,
    e.g. ``assert labels.sum() >= 0``: a forward taking that way ends there), not from fx or torch failing to trace
    an operation (whose effect, and what the forward does after it, is unknown)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    if os.path.abspath(last.filename).startswith(_TORCH_DIR):
        return False
    return (last.line or "").lstrip().startswith(("raise", "assert"))


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _calls_on_every_branch_path(root: nn.Module, names: set[str]) -> list[dict[str, int]] | str:
    """How many times each module of ``names`` is called on every way through ``root``'s data-dependent branches
    (each traced to the end, both ways of every branch: a superset of the ways a forward can take), or why that
    cannot be known (a way does not trace to its end, or there are more than :data:`MAX_BRANCH_PATHS`)."""
    todo: list[list[bool]] = [[]]
    counts: list[dict[str, int]] = []
    while todo:
        if len(counts) == MAX_BRANCH_PATHS:
            return f"the forward has more than {MAX_BRANCH_PATHS} ways through its data-dependent branches"
        decisions = todo.pop()
        tracer = _BranchPathTracer(decisions)
        try:
            graph = tracer.trace(root)
        except Exception as error:
            if tracer.overflowed or not _raised_by_the_model(error):
                # an operation fx cannot follow: what the forward does after it is unknown
                taken = "".join("T" if t else "F" for t in tracer.taken) or "none"
                why = f"{type(error).__name__}: {error}"
                return f"a way through its branches does not trace (branches taken: {taken}; {why})"
            graph = tracer.graph  # the model's own raise or assert: this way ends here (a run taking it fails)
        if tracer.overflowed:
            return f"a way through the forward has more than {MAX_BRANCHES} data-dependent branches"
        count: dict[str, int] = dict.fromkeys(names, 0)
        for node in graph.nodes:
            if node.op == "call_module" and node.target in count:
                count[str(node.target)] += 1
        counts.append(count)
        # every way not traced yet that shares this one's forced branches: flip one later branch, the rest False
        todo.extend([*tracer.taken[:k], True] for k in range(len(decisions), len(tracer.taken)))
    return counts


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DistributedModelParallel / DistributedDataParallel wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_dmp_wrapped_module", None), nn.Module):
            model = model._dmp_wrapped_module  # type: ignore[assignment]
        else:
            return model


@dataclass
class TracedInputs:
    """Result of :func:`trace_sharded_inputs`: pipelineable modules (name -> module, call args) and, for every other
    sharded module, why not."""

    pipelineable: dict[str, tuple[ShardedModule, CallArgs]]
    reasons: dict[str, str]
    trace_error: str | None = None


def top_level_sharded_modules(model: nn.Module) -> dict[str, ShardedModule]:
    """The sharded modules of ``model`` (wrappers looked through) that no other sharded module holds, by name.

    A sharded module inside another one (the sharded EBC of a feature-processed one) gets its input from its
    parent, not from the model's forward, so it is neither pipelined nor calls an input dist of its own there."""
    found: dict[str, ShardedModule] = {}
    for name, module in unwrap_model(model).named_modules():
        nested = any(parent == "" or name.startswith(f"{parent}.") for parent in found)
        if isinstance(module, ShardedModule) and not nested:
            found[name] = module
    return found


def trace_sharded_inputs(model: nn.Module) -> TracedInputs:
    """Trace ``model`` (wrappers looked through) and find how each sharded module's inputs derive from the batch.

    The traces run the forward's Python code (once, and once per way through its branches when tracing stopped at
    one): torch's CPU random state is restored after them, so a forward drawing random numbers draws the same ones
    in training as without the pipeline."""
    with torch.random.fork_rng(devices=[]):
        return _trace_sharded_inputs(model)


def _trace_sharded_inputs(model: nn.Module) -> TracedInputs:
    root = unwrap_model(model)
    sharded = top_level_sharded_modules(root)
    tracer = _ShardedLeafTracer()
    trace_error = None
    try:
        tracer.trace(root)
    except Exception as error:  # fx raises TraceError, TypeError, ... on code it cannot follow
        trace_error = f"{type(error).__name__}: {error}"
    graph: torch.fx.Graph | None = getattr(tracer, "graph", None)
    nodes = list(graph.nodes) if graph is not None else []
    placeholders = [n for n in nodes if n.op == "placeholder"]
    pipelineable: dict[str, tuple[ShardedModule, CallArgs]] = {}
    reasons: dict[str, str] = {}
    calls: dict[str, list[torch.fx.Node]] = {}
    for node in nodes:
        if node.op == "call_module" and node.target in sharded:
            calls.setdefault(str(node.target), []).append(node)
    branch_counts: list[dict[str, int]] | str | None = None  # traced when a module found before the stop needs it
    for name, module in sharded.items():
        if name not in calls:
            where = f"tracing stopped before it is called ({trace_error})" if trace_error else "it is never called"
            reasons[name] = where
            continue
        if len(calls[name]) > 1:
            reasons[name] = f"it is called {len(calls[name])} times per forward (a pipelined module is called once)"
            continue
        if not placeholders:
            reasons[name] = "the model's forward takes no input"
            continue
        node = calls[name][0]
        infos = [_arg_info(a, placeholders[0]) for a in node.args]
        kw_infos = [(k, _arg_info(v, placeholders[0])) for k, v in node.kwargs.items()]
        bad = [i for i in [*infos, *(v for _, v in kw_infos)] if isinstance(i, str)]
        if bad:
            reasons[name] = bad[0]
            continue
        if trace_error is not None:  # the rest of the forward (not in the partial graph) may call it again
            if branch_counts is None:
                branch_counts = _calls_on_every_branch_path(root, {str(n) for n in calls})
            if isinstance(branch_counts, str):
                reasons[name] = (
                    f"tracing stopped after its call ({trace_error}), and whether the rest of the forward calls it "
                    f"again cannot be proven: {branch_counts}"
                )
                continue
            other = [count[name] for count in branch_counts if count[name] != 1]
            if other:
                reasons[name] = (
                    f"tracing stopped after its call ({trace_error}), and a way through the forward's "
                    f"data-dependent branches calls it {other[0]} times (a pipelined module is called once)"
                )
                continue
        pipelineable[name] = (module, CallArgs(tuple(infos), tuple(kw_infos)))  # type: ignore[arg-type]
    return TracedInputs(pipelineable, reasons, trace_error)


# ------------------------------------------------------------------------------------------- the swapped forward
_OUTSIDE = (
    "to run the model outside the pipeline (an evaluation between steps), call pipeline.detach() (or the "
    "SparseDataDistUtil's detach()) before and attach() after"
)


def _features(args: Any, kwargs: Any) -> Any:
    """The first KeyedJaggedTensor among a call's arguments (None without one)."""
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, KeyedJaggedTensor)), None)


def _may_be_same(source: Any, given: Any) -> bool:
    """Whether ``given`` may be the features ``source`` prefetched: the same object, or (a batch type that builds
    its features on each access) the same keys, stride and number of ids. Only a difference is certain."""
    if source is None or given is None or given is source:
        return True
    return (
        list(given.keys()) == list(source.keys())
        and given.stride() == source.stride()
        and given.values().numel() == source.values().numel()
    )


def _describe(features: Any) -> str:
    return f"{len(features.keys())} keys, stride {features.stride()}, {features.values().numel()} ids"


class PipelinedForward:
    """Replaces a sharded module's ``forward``: ignores its arguments (their input dist is already in flight) and
    runs ``compute_and_output_dist`` on the prefetched input of the current context."""

    def __init__(
        self,
        name: str,
        call_args: CallArgs,
        module: ShardedModule,
        context: TrainPipelineContext,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.name = name
        self.call_args = call_args
        self.module = module
        self.context = context
        self.stream = stream

    def set_context(self, context: TrainPipelineContext) -> None:
        self.context = context

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        requests = self.context.input_dist_tensors_requests
        if self.name not in requests:
            raise RuntimeError(
                f"pipelined module {self.name!r} has no input dist for batch {self.context.index}: it is called "
                f"more than once per forward, or outside the pipeline's steps ({_OUTSIDE})"
            )
        source, given = self.context.input_sources.get(self.name), _features(input, kwargs)
        if not _may_be_same(source, given):
            raise RuntimeError(
                f"pipelined module {self.name!r} was called on other features than batch {self.context.index}'s, "
                f"whose input dist is prefetched ({_describe(given)} vs {_describe(source)}): {_OUTSIDE}"
            )
        self.context.input_sources.pop(self.name, None)
        request = requests.pop(self.name)
        with stream_context(self.stream):
            data = request.wait()
        module_context = self.context.module_contexts.pop(self.name)
        if self.stream is not None:
            stream = current_stream(self.stream.device)
            assert stream is not None
            stream.wait_stream(self.stream)
            record_stream(data, stream)
            record_stream(module_context, stream)
        return self.module.compute_and_output_dist(module_context, data)


@dataclass
class PipelinedModules:
    """The modules whose forward was swapped, with their original forwards (restored by :meth:`detach`), and the
    model's other top-level sharded modules (``unpipelined``: they run their own input dist inside the forward)."""

    forwards: dict[str, PipelinedForward]
    originals: dict[str, Callable[..., Any] | None]
    unpipelined: list[str] = field(default_factory=list)

    def set_context(self, context: TrainPipelineContext) -> None:
        for forward in self.forwards.values():
            forward.set_context(context)

    @property
    def input_dists_on_own_groups(self) -> bool:
        """Every pipelined module's input dists run on a group of their own (``input_dist_on_own_group``)."""
        return bool(self.forwards) and all(f.module.input_dist_on_own_group for f in self.forwards.values())

    @property
    def can_defer_agreement(self) -> bool:
        """Whether the ranks may agree on a step during its forward: true only when no collective of the forward
        can use the groups an input dist launched ahead (and missing on a failed rank) leaves unpaired.

        The pipelined modules' input dists must run on groups of their own, and no other sharded module may run
        an input dist in the forward: every sharding of a process group shares that group's one input-dist side
        group (:mod:`tritonrec.dist.side_groups`), so an unpipelined module's input dist would pair with the
        launch ahead that the failed rank lacks (gloo aborts on the size mismatch, or the other rank hangs)."""
        return self.input_dists_on_own_groups and not self.unpipelined

    def start_input_dist(self, batch: Any, context: TrainPipelineContext, stream: torch.cuda.Stream | None) -> None:
        """Launch every pipelined module's input dist for ``batch`` (first round: split sizes)."""
        with stream_context(stream):
            for name, forward in self.forwards.items():
                args, kwargs = forward.call_args.build(batch)
                module_context = forward.module.create_context()
                context.module_contexts[name] = module_context
                context.input_sources[name] = _features(args, kwargs)
                context.input_dist_splits_requests[name] = forward.module.input_dist(module_context, *args, **kwargs)

    def wait_splits(self, context: TrainPipelineContext, stream: torch.cuda.Stream | None) -> None:
        """Finish the split-size rounds of ``context``'s input dists, which launches their tensor rounds."""
        with stream_context(stream):
            for name, request in context.input_dist_splits_requests.items():
                context.input_dist_tensors_requests[name] = request.wait()
        context.input_dist_splits_requests.clear()

    def detach(self) -> None:
        for name, forward in self.forwards.items():
            module = forward.module
            original = self.originals[name]
            if original is None:
                del module.forward
            else:
                module.forward = original  # type: ignore[method-assign]
            module.is_pipelined = False


def rewrite_model(
    model: nn.Module, context: TrainPipelineContext, stream: torch.cuda.Stream | None
) -> tuple[PipelinedModules, str | None]:
    """Swap the forward of every pipelineable sharded module of ``model``; returns them and, when none could be,
    the reason (logged) the pipeline falls back to the model's own forward."""
    traced = trace_sharded_inputs(model)
    for name, reason in traced.reasons.items():
        logger.warning("train pipeline: sharded module %r runs unpipelined: %s", name, reason)
    forwards: dict[str, PipelinedForward] = {}
    originals: dict[str, Callable[..., Any] | None] = {}
    for name, (module, call_args) in traced.pipelineable.items():
        originals[name] = module.__dict__.get("forward")
        forward = PipelinedForward(name, call_args, module, context, stream)
        module.forward = forward  # type: ignore[method-assign]
        module.is_pipelined = True
        forwards[name] = forward
    unpipelined = list(traced.reasons)  # every other top-level sharded module
    fallback = None
    if not forwards:
        if traced.reasons:
            fallback = "no sharded module can be pipelined: " + "; ".join(
                f"{n}: {r}" for n, r in traced.reasons.items()
            )
        else:
            fallback = "the model has no sharded module"
        logger.warning("train pipeline falls back to the model's own forward: %s", fallback)
    return PipelinedModules(forwards, originals, unpipelined), fallback


__all__ = [
    "MAX_BRANCH_PATHS",
    "ArgInfo",
    "CallArgs",
    "PipelinedForward",
    "PipelinedModules",
    "TracedInputs",
    "TrainPipelineContext",
    "rewrite_model",
    "top_level_sharded_modules",
    "trace_sharded_inputs",
    "unwrap_model",
]
