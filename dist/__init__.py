"""Model parallelism on torch.distributed: collectives with awaitables and autograd, quantized comm codecs,
process-group helpers, and the sharding vocabulary (types, plans) that sharded modules, the planner and the train
pipelines build on."""

from tritonrec.dist.all_to_one import EmbeddingsAllToOne, EmbeddingsAllToOneReduce, SeqEmbeddingsAllToOne
from tritonrec.dist.awaitable import Awaitable, LazyAwaitable, LazyNoWait, NoWait
from tritonrec.dist.comm import (
    get_group_rank,
    get_local_rank,
    get_local_size,
    get_num_groups,
    intra_and_cross_node_pg,
    invoke_on_rank_and_broadcast_result,
    is_leader,
    run_on_leader,
)
from tritonrec.dist.comm_consistency import MetadataCheck
from tritonrec.dist.comm_ops import (
    all_gather_base_pooled,
    alltoall_pooled,
    alltoall_sequence,
    alltoallv,
    get_gradient_division,
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
    set_gradient_division,
    variable_batch_alltoall_pooled,
)
from tritonrec.dist.comm_request import Request
from tritonrec.dist.comm_timeout import (
    CollectiveError,
    CollectiveTimeoutError,
    collective_timeout,
    get_collective_timeout,
    set_collective_timeout,
)
from tritonrec.dist.comm_wire import WireTraffic
from tritonrec.dist.dist_data import (
    KJTAllToAll,
    KJTAllToAllSplitsAwaitable,
    KJTAllToAllTensorsAwaitable,
    KJTOneToAll,
    PooledEmbeddingsAllGather,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsAwaitable,
    PooledEmbeddingsReduceScatter,
    SequenceEmbeddingsAllToAll,
    SequenceEmbeddingsAwaitable,
    VariableBatchPooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsReduceScatter,
)
from tritonrec.dist.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from tritonrec.dist.embedding_tower_sharding import (
    EmbeddingTowerCollectionSharder,
    EmbeddingTowerSharder,
    ShardedEmbeddingTower,
    ShardedEmbeddingTowerCollection,
)
from tritonrec.dist.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from tritonrec.dist.error_feedback import ErrorFeedbackCodec
from tritonrec.dist.fp_embeddingbag import (
    FeatureProcessedEmbeddingBagCollectionSharder,
    ShardedFeatureProcessedEmbeddingBagCollection,
)
from tritonrec.dist.kjt_dist import get_recat
from tritonrec.dist.mc_embedding import (
    ManagedCollisionEmbeddingCollectionSharder,
    ShardedManagedCollisionEmbeddingCollection,
)
from tritonrec.dist.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from tritonrec.dist.mc_sharding import ShardedManagedCollisionCollection
from tritonrec.dist.model_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DistributedModelParallel,
    get_module,
    get_unwrapped_module,
)
from tritonrec.dist.qcomm_codec import CommType, TritonQuantizedCommCodec
from tritonrec.dist.qcomm_config import QCommsConfig, get_qcomm_codecs, get_qcomm_codecs_registry
from tritonrec.dist.qcomm_protocol import (
    CommOp,
    NoOpQuantizedCommCodec,
    QuantizationContext,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    RoundingMode,
)
from tritonrec.dist.quant_embedding import QuantEmbeddingCollectionSharder, ShardedQuantEmbeddingCollection
from tritonrec.dist.quant_embedding_local import ShardedQuantEmbeddingCollectionLocal
from tritonrec.dist.quant_embeddingbag import QuantEmbeddingBagCollectionSharder, ShardedQuantEmbeddingBagCollection
from tritonrec.dist.quant_embeddingbag_pg import ShardedQuantEmbeddingBagCollectionPG
from tritonrec.dist.sharding_plan import (
    calculate_shard_sizes_and_offsets,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    get_default_sharders,
    get_module_to_default_sharders,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from tritonrec.dist.types import (
    BaseEmbeddingSharder,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    FusedOptimizerModule,
    ModuleSharder,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
)

__all__ = [
    "Awaitable",
    "BaseEmbeddingSharder",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommOp",
    "CommType",
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "DistributedModelParallel",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "EmbeddingTowerCollectionSharder",
    "EmbeddingTowerSharder",
    "EmbeddingsAllToOne",
    "EmbeddingsAllToOneReduce",
    "ErrorFeedbackCodec",
    "FeatureProcessedEmbeddingBagCollectionSharder",
    "FusedOptimizerModule",
    "KJTAllToAll",
    "KJTAllToAllSplitsAwaitable",
    "KJTAllToAllTensorsAwaitable",
    "KJTOneToAll",
    "LazyAwaitable",
    "LazyNoWait",
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ManagedCollisionEmbeddingCollectionSharder",
    "MetadataCheck",
    "ModuleSharder",
    "NoOpQuantizedCommCodec",
    "NoWait",
    "ParameterSharding",
    "PooledEmbeddingsAllGather",
    "PooledEmbeddingsAllToAll",
    "PooledEmbeddingsAwaitable",
    "PooledEmbeddingsReduceScatter",
    "QCommsConfig",
    "QuantEmbeddingBagCollectionSharder",
    "QuantEmbeddingCollectionSharder",
    "QuantizationContext",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "Request",
    "RoundingMode",
    "SeqEmbeddingsAllToOne",
    "SequenceEmbeddingsAllToAll",
    "SequenceEmbeddingsAwaitable",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardedEmbeddingTower",
    "ShardedEmbeddingTowerCollection",
    "ShardedFeatureProcessedEmbeddingBagCollection",
    "ShardedManagedCollisionCollection",
    "ShardedManagedCollisionEmbeddingBagCollection",
    "ShardedManagedCollisionEmbeddingCollection",
    "ShardedModule",
    "ShardedQuantEmbeddingBagCollection",
    "ShardedQuantEmbeddingBagCollectionPG",
    "ShardedQuantEmbeddingCollection",
    "ShardedQuantEmbeddingCollectionLocal",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "TritonQuantizedCommCodec",
    "VariableBatchPooledEmbeddingsAllToAll",
    "VariableBatchPooledEmbeddingsReduceScatter",
    "WireTraffic",
    "all_gather_base_pooled",
    "alltoall_pooled",
    "alltoall_sequence",
    "alltoallv",
    "calculate_shard_sizes_and_offsets",
    "collective_timeout",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_collective_timeout",
    "get_default_sharders",
    "get_gradient_division",
    "get_group_rank",
    "get_local_rank",
    "get_local_size",
    "get_module",
    "get_module_to_default_sharders",
    "get_num_groups",
    "get_qcomm_codecs",
    "get_qcomm_codecs_registry",
    "get_recat",
    "get_unwrapped_module",
    "grid_shard",
    "intra_and_cross_node_pg",
    "invoke_on_rank_and_broadcast_result",
    "is_leader",
    "reduce_scatter_base_pooled",
    "reduce_scatter_pooled",
    "reduce_scatter_v_per_feature_pooled",
    "reduce_scatter_v_pooled",
    "row_wise",
    "run_on_leader",
    "set_collective_timeout",
    "set_gradient_division",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "variable_batch_alltoall_pooled",
]
