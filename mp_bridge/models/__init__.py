"""Small reference models (TP encoder, projection, CP/TP LLM) and the colocated MIMO wrapper."""

from .build import build_colocated_mimo, destroy_colocated_mimo
from .config import MimoConfig
from .data import MimoBatch, TextShard, dp_shard, synthetic_batch
from .encoder import TPEncoder, TPProjection
from .groups import MimoGroups, make_mimo_groups
from .images import RaggedImages
from .llm import TPLLM
from .mimo import ColocatedMimoModel
from .oracle import ParityReport, run_parity
from .placement import place_image_embeddings, place_image_tokens
from .reference import ReferenceEncoder, ReferenceLLM, ReferenceMimo, ReferenceProjection
from .sharding import gather_full_state, load_full_state

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
    "run_parity",
]
