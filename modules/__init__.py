"""nn.Modules with torchrec's names: embedding configs, (fused) embedding bag / sequence collections, feature
processors, quantized inference collections, the DLRM family, the cross nets, DeepFM, embedding towers, the
KeyedTensor regrouping module and SwishLayerNorm. Modules hold parameters and route KJTs; the lookups are
:mod:`tritonrec.kernels.embedding` ops."""

from tritonrec.kernels.embedding import OptimType
from tritonrec.modules.activation import SwishLayerNorm
from tritonrec.modules.crossnet import CrossNet, LowRankMixtureCrossNet, VectorCrossNet
from tritonrec.modules.deepfm import DeepFM, FactorizationMachine
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
from tritonrec.modules.dlrm_projection import DLRM_Projection, InteractionProjectionArch
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
from tritonrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection
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
from tritonrec.modules.quant_embedding_collection import QuantEmbeddingCollection
from tritonrec.modules.quant_embedding_modules import QuantEmbeddingBagCollection
from tritonrec.modules.quantize import QuantConfig, quantize_embeddings
from tritonrec.modules.regroup import KTRegroupAsDict
from tritonrec.modules.simple_deepfm import FMInteractionArch, SimpleDeepFMNN

__all__ = [
    "DLRM",
    "DLRM_DCN",
    "MLP",
    "BaseEmbeddingConfig",
    "BoundsCheckMode",
    "CrossNet",
    "DLRMTrain",
    "DLRM_Projection",
    "DataType",
    "DeepFM",
    "DenseArch",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingFusedOptimizer",
    "EmbeddingTower",
    "EmbeddingTowerCollection",
    "FMInteractionArch",
    "FactorizationMachine",
    "FeatureProcessedEmbeddingBagCollection",
    "FusedEmbeddingBagCollection",
    "FusedEmbeddingCollection",
    "InteractionArch",
    "InteractionDCNArch",
    "InteractionProjectionArch",
    "KTRegroupAsDict",
    "LowRankCrossNet",
    "LowRankMixtureCrossNet",
    "OptimType",
    "OverArch",
    "PoolingType",
    "PositionWeightedModule",
    "PositionWeightedModuleCollection",
    "QuantConfig",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "SimpleDeepFMNN",
    "SparseArch",
    "SwishLayerNorm",
    "VectorCrossNet",
    "data_type_to_dtype",
    "quantize_embeddings",
]
