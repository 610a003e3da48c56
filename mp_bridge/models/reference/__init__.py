"""The single-process reference MIMO model the oracle tests compare against."""

from .model import (
    ReferenceEncoder,
    ReferenceLLM,
    ReferenceMimo,
    ReferenceProjection,
    packed_causal_mask,
    reference_masked_mean,
)

__all__ = [
    "ReferenceEncoder",
    "ReferenceLLM",
    "ReferenceMimo",
    "ReferenceProjection",
    "packed_causal_mask",
    "reference_masked_mean",
]
