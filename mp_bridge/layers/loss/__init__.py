"""Losses over vocab-sharded logits: materialized and fused (hidden @ weight in chunks),
default and TP-invariant. The five doors parse into one ``LossOptions`` (``options``, its
checks in ``arguments``); the fused ones run an engine of ``engines`` (``"torch"``,
``"triton"``) over the shared formulas (``formulas``, ``grad``, ``blocks``, ``reduce``)."""

from .fused import fused_linear_cross_entropy, fused_linear_logprobs
from .vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)

__all__ = [
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logprobs",
    "vocab_parallel_entropy",
    "fused_linear_cross_entropy",
    "fused_linear_logprobs",
]
