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
from tritonrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from tritonrec.modules.mc_hash_zch import (
    HashZchEvictionConfig,
    HashZchEvictionPolicyName,
    HashZchManagedCollisionModule,
)
from tritonrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionModule,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
    average_threshold_filter,
    dynamic_threshold_filter,
    probabilistic_threshold_filter,
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
    "DistanceLFU_EvictionPolicy",
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
    "HashZchEvictionConfig",
    "HashZchEvictionPolicyName",
    "HashZchManagedCollisionModule",
    "InteractionArch",
    "InteractionDCNArch",
    "InteractionProjectionArch",
    "KTRegroupAsDict",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "LowRankCrossNet",
    "LowRankMixtureCrossNet",
    "MCHEvictionPolicy",
    "MCHManagedCollisionModule",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "ManagedCollisionModule",
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
    "average_threshold_filter",
    "data_type_to_dtype",
    "dynamic_threshold_filter",
    "probabilistic_threshold_filter",
    "quantize_embeddings",
]
