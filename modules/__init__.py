"""nn.Modules with torchrec's names: embedding configs, (fused) embedding bag / sequence collections, feature
processors, quantized inference collections and the DLRM family. Modules hold parameters and route KJTs; the lookups are
:mod:`tritonrec.kernels.embedding` ops."""

from tritonrec.kernels.embedding import OptimType
from tritonrec.modules.dlrm import DLRM, DLRM_DCN, DLRMTrain
from tritonrec.modules.dlrm_archs import (
    MLP,
    DenseArch,
    InteractionArch,
    InteractionDCNArch,
    LowRankCrossNet,
    OverArch,
    SparseArch,
)
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
    "DLRM",
    "DLRM_DCN",
    "MLP",
    "BaseEmbeddingConfig",
    "BoundsCheckMode",
    "DLRMTrain",
    "DataType",
    "DenseArch",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingFusedOptimizer",
    "FeatureProcessedEmbeddingBagCollection",
    "FusedEmbeddingBagCollection",
    "FusedEmbeddingCollection",
    "InteractionArch",
    "InteractionDCNArch",
    "LowRankCrossNet",
    "OptimType",
    "OverArch",
    "PoolingType",
    "PositionWeightedModule",
    "PositionWeightedModuleCollection",
    "QuantEmbeddingBagCollection",
    "SparseArch",
    "data_type_to_dtype",
]
