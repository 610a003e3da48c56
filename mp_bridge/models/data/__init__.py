"""Model inputs: the model config, synthetic batches, ragged images, packed text, the parsed
step inputs and image placement (pure torch, no collectives).
"""

from .batch import MimoBatch, TextShard, dp_shard, synthetic_batch
from .config import MimoConfig
from .images import RaggedImages
from .inputs import (
    IGNORE_INDEX,
    BatchSpec,
    StepInputs,
    check_placeholders,
    packed_tokens,
    parse_step_inputs,
)
from .long_tail import long_tail_images
from .packed import (
    check_cu_seqlens,
    document_sums,
    placeholder_counts,
    rows_per_document,
)
from .placement import place_image_embeddings, place_image_tokens, place_images

__all__ = [
    "MimoBatch",
    "TextShard",
    "dp_shard",
    "synthetic_batch",
    "MimoConfig",
    "RaggedImages",
    "long_tail_images",
    "check_cu_seqlens",
    "document_sums",
    "placeholder_counts",
    "rows_per_document",
    "IGNORE_INDEX",
    "BatchSpec",
    "StepInputs",
    "check_placeholders",
    "packed_tokens",
    "parse_step_inputs",
    "place_image_embeddings",
    "place_image_tokens",
    "place_images",
]
