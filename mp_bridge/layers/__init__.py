"""Vocab-parallel embedding / LM head / losses, token reductions, CP attention."""

from mp_bridge._lazy import lazy_exports

from .vocab_shards import padded_vocab_size, vocab_shard_ranges, vocab_shard_size

_EXPORTS = {
    "VocabParallelEmbedding": "embedding",
    "VocabParallelLMHead": "lm_head",
    "vocab_parallel_cross_entropy": "cross_entropy",
    "vocab_parallel_logprobs": "cross_entropy",
    "vocab_parallel_entropy": "cross_entropy",
    "fused_linear_cross_entropy": "fused_loss",
    "fused_linear_logprobs": "fused_loss",
    "masked_sum": "reductions",
    "masked_count": "reductions",
    "masked_mean": "reductions",
    "context_parallel_attention": "cp_attention",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["padded_vocab_size", "vocab_shard_ranges", "vocab_shard_size", *_EXPORTS]
