"""The semi-sync pipeline's per-batch context and the pipelined ``forward`` of its sharded modules: the lookup is
launched by the pipeline ahead of the forward, which hands the dense part its output detached, so the pipeline
back-propagates into the lookup itself, after the dense backward (torchrec's ``EmbeddingTrainPipelineContext`` and
``EmbeddingPipelinedForward``, our code). Used by :mod:`.semi_sync`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tritonrec.data import JaggedTensor, KeyedTensor
from tritonrec.dist.awaitable import LazyAwaitable, LazyNoWait
from tritonrec.dist.train_pipeline.tracing import (
    _OUTSIDE,
    PipelinedForward,
    TrainPipelineContext,
    _describe,
    _features,
    _may_be_same,
)
from tritonrec.dist.train_pipeline.utils import record_stream, stream_context


@dataclass
class SemiSyncContext(TrainPipelineContext):
    """:class:`TrainPipelineContext` plus the batch's launched lookups (torchrec's ``EmbeddingTrainPipelineContext``).

    ``embedding_a2a_requests``: module name -> the lookup's output dist in flight (``LazyAwaitable``);
    ``embedding_tensors`` / ``detached_embedding_tensors``: the lookups' outputs (e.g. ``[B, sum(D)]`` pooled
    values) and the detached leaves the forward handed to the dense part; ``embedding_features``: their keys.
    """

    embedding_a2a_requests: dict[str, LazyAwaitable[Any]] = field(default_factory=dict)
    embedding_tensors: list[torch.Tensor] = field(default_factory=list)
    detached_embedding_tensors: list[torch.Tensor] = field(default_factory=list)
    embedding_features: list[list[str]] = field(default_factory=list)

    @property
    def lookup_started(self) -> bool:
        return bool(self.embedding_a2a_requests)


class EmbeddingPipelinedForward(PipelinedForward):
    """A pipelined module's ``forward`` under semi-sync: returns the lookup launched ahead for the current batch,
    with its output detached (recorded in the context for the pipeline's embedding backward)."""

    def start_lookup(self, context: SemiSyncContext) -> None:
        """Wait for the batch's input dist tensors, run the local lookup now, launch its output dist."""
        with stream_context(self.stream):
            data = context.input_dist_tensors_requests.pop(self.name).wait()
        module_context = context.module_contexts[self.name]
        if self.stream is not None:  # the lookup runs on the current stream, after the input dist's stream
            current = torch.cuda.current_stream(self.stream.device)
            current.wait_stream(self.stream)
            record_stream(data, current)
            record_stream(module_context, current)
        context.embedding_a2a_requests[self.name] = self.module.compute_and_output_dist(module_context, data)

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        context = self.context
        if not isinstance(context, SemiSyncContext) or self.name not in context.embedding_a2a_requests:
            raise RuntimeError(
                f"pipelined module {self.name!r} has no lookup launched for batch {context.index}: it is called more "
                f"than once per forward, or outside the pipeline's steps ({_OUTSIDE})"
            )
        source, given = context.input_sources.get(self.name), _features(input, kwargs)
        if not _may_be_same(source, given):
            raise RuntimeError(
                f"pipelined module {self.name!r} was called on other features than batch {context.index}'s, whose "
                f"lookup was launched ahead ({_describe(given)} vs {_describe(source)}): {_OUTSIDE}"
            )
        context.input_sources.pop(self.name, None)
        context.module_contexts.pop(self.name, None)
        request = context.embedding_a2a_requests.pop(self.name)
        if isinstance(request, tuple):  # a managed-collision module: (embeddings, remapped features), as its forward
            embeddings, remapped = request
            return LazyNoWait(_detach(embeddings.wait(), context)), remapped
        return LazyNoWait(_detach(request.wait(), context))


def wait_request(request: Any) -> None:
    """Wait for a lookup launched ahead (an awaitable, or a managed-collision module's pair of them)."""
    for part in request if isinstance(request, tuple) else (request,):
        part.wait()


def _detach(embeddings: Any, context: SemiSyncContext) -> Any:
    """``embeddings`` with its values replaced by detached leaves that require grad (a KeyedTensor, a dict of
    JaggedTensors or a tensor); originals and leaves are recorded in ``context``. Without grad: unchanged."""

    def leaf(values: torch.Tensor, keys: list[str]) -> torch.Tensor:
        if not values.requires_grad:
            return values
        detached = values.detach().requires_grad_()
        context.embedding_tensors.append(values)
        context.detached_embedding_tensors.append(detached)
        context.embedding_features.append(keys)
        return detached

    if isinstance(embeddings, KeyedTensor):
        values = leaf(embeddings.values(), embeddings.keys())
        return KeyedTensor(embeddings.keys(), embeddings.length_per_key(), values, embeddings.key_dim())
    if isinstance(embeddings, dict) and all(isinstance(jt, JaggedTensor) for jt in embeddings.values()):
        return {
            key: JaggedTensor(
                leaf(jt.values(), [key]), jt.weights_or_none(), jt.lengths_or_none(), jt.offsets_or_none()
            )
            for key, jt in embeddings.items()
        }
    if isinstance(embeddings, torch.Tensor):
        return leaf(embeddings, [])
    raise TypeError(
        "semi-sync pipelining needs a sharded module's output to be a KeyedTensor, a dict of JaggedTensors or a "
        f"tensor, got {type(embeddings).__name__}"
    )


__all__ = ["EmbeddingPipelinedForward", "SemiSyncContext", "wait_request"]
