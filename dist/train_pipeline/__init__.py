"""Train pipelines (torchrec's ``torchrec.distributed.train_pipeline`` names and semantics): base, sparse-dist,
staged and eval pipelines that overlap the device copy and the sparse input dist of later batches with the
forward/backward of the current one, and stop or fail together on every rank."""

from tritonrec.dist.train_pipeline.agreement import PipelineStageError, StepAgreement
from tritonrec.dist.train_pipeline.gradient_accumulation import GradientAccumulationConfig, GradientAccumulationWrapper
from tritonrec.dist.train_pipeline.pipelines import (
    EvalPipelineSparseDist,
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from tritonrec.dist.train_pipeline.semi_sync import TrainPipelineSemiSync
from tritonrec.dist.train_pipeline.staged import PipelineStage, SparseDataDistUtil, StagedTrainPipeline
from tritonrec.dist.train_pipeline.tracing import TrainPipelineContext, trace_sharded_inputs
from tritonrec.dist.train_pipeline.utils import DataLoadingThread

__all__ = [
    "DataLoadingThread",
    "EvalPipelineSparseDist",
    "GradientAccumulationConfig",
    "GradientAccumulationWrapper",
    "PipelineStage",
    "PipelineStageError",
    "SparseDataDistUtil",
    "StagedTrainPipeline",
    "StepAgreement",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "trace_sharded_inputs",
]
