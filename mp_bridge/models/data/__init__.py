"""Model inputs: the model config, synthetic batches, ragged images, packed text and image
placement.
"""

from .batch import MimoBatch, TextShard, dp_shard, synthetic_batch
from .config import MimoConfig
from .images import RaggedImages
from .packed import (
    check_cu_seqlens,
    check_packed_image_tokens,
    document_sums,
    placeholder_counts,
    rows_per_document,
)
from .placement import (
    check_image_tokens,
    check_ragged_image_tokens,
    place_image_embeddings,
    place_image_tokens,
)

__all__ = [
    "MimoBatch",
    "TextShard",
    "dp_shard",
    "synthetic_batch",
    "MimoConfig",
    "RaggedImages",
    "check_cu_seqlens",
    "check_packed_image_tokens",
    "document_sums",
    "placeholder_counts",
    "rows_per_document",
    "check_image_tokens",
    "check_ragged_image_tokens",
    "place_image_embeddings",
    "place_image_tokens",
]
