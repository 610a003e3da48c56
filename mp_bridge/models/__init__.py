"""Small reference models (TP encoder, projection, CP/TP LLM) and the colocated MIMO wrapper."""

from mp_bridge.comm import LocalBridge
from mp_bridge.models.colocated.build import build_colocated_mimo, destroy_colocated_mimo
from mp_bridge.models.colocated.gather import GatherFlow
from mp_bridge.models.colocated.mimo import ColocatedMimoModel
from mp_bridge.models.colocated.mimo_groups import MimoGroups, make_mimo_groups
from mp_bridge.models.colocated.mimo_options import FLOWS, parse_flow
from mp_bridge.models.colocated.parts import MimoFlow
from mp_bridge.models.colocated.routed import RoutedFlow
from mp_bridge.models.data.batch import MimoBatch, TextShard, dp_shard, synthetic_batch
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.placement import place_image_embeddings, place_image_tokens
from mp_bridge.models.oracle import ParityReport, TrainHooks, run_parity
from mp_bridge.models.parallel.encoder import TPEncoder, TPProjection
from mp_bridge.models.parallel.llm import TPLLM
from mp_bridge.models.parallel.sharding import gather_full_state, load_full_state
from mp_bridge.models.reference.model import (
    ReferenceEncoder,
    ReferenceLLM,
    ReferenceMimo,
    ReferenceProjection,
)

__all__ = [
    "MimoConfig",
    "ReferenceEncoder",
    "ReferenceProjection",
    "ReferenceLLM",
    "ReferenceMimo",
    "place_image_embeddings",
    "place_image_tokens",
    "TPEncoder",
    "TPProjection",
    "TPLLM",
    "ColocatedMimoModel",
    "MimoFlow",
    "GatherFlow",
    "RoutedFlow",
    "FLOWS",
    "parse_flow",
    "LocalBridge",
    "MimoGroups",
    "make_mimo_groups",
    "build_colocated_mimo",
    "destroy_colocated_mimo",
    "load_full_state",
    "gather_full_state",
    "MimoBatch",
    "TextShard",
    "RaggedImages",
    "synthetic_batch",
    "dp_shard",
    "ParityReport",
    "TrainHooks",
    "run_parity",
]
