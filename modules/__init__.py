"""nn.Modules with torchrec's names: embedding configs, (fused) embedding bag / sequence collections, feature
processors and quantized inference collections. Modules hold parameters and route KJTs; the lookups are
:mod:`tritonrec.kernels.embedding` ops."""

from tritonrec.kernels.embedding import OptimType
from tritonrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    BoundsCheckMode,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    data_type_to_dtype,
)
from tritonrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from tritonrec.modules.feature_processor import (
    FeatureProcessedEmbeddingBagCollection,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from tritonrec.modules.fused_embedding_modules import (
    EmbeddingFusedOptimizer,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
)
from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection

__all__ = [
    "BaseEmbeddingConfig",
    "BoundsCheckMode",
    "DataType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingFusedOptimizer",
    "FeatureProcessedEmbeddingBagCollection",
    "FusedEmbeddingBagCollection",
    "FusedEmbeddingCollection",
    "OptimType",
    "PoolingType",
    "PositionWeightedModule",
    "PositionWeightedModuleCollection",
    "QuantEmbeddingBagCollection",
    "data_type_to_dtype",
]
