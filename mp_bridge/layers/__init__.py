"""Vocab-parallel embedding / LM head / losses, token reductions, CP attention, RoPE."""

from mp_bridge.layers.activations import ACTIVATIONS, activation
from mp_bridge.layers.attention.cp_attention import COMM_MODES, context_parallel_attention
from mp_bridge.layers.attention.image_attention import image_attention
from mp_bridge.layers.embedding import VocabParallelEmbedding
from mp_bridge.layers.lm_head import VocabParallelLMHead
from mp_bridge.layers.loss.fused import fused_linear_cross_entropy, fused_linear_logprobs
from mp_bridge.layers.loss.vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from mp_bridge.layers.param_shards import (
    ShardPiece,
    ShardSpec,
    gather_shard,
    load_shard_,
    mark_sharded,
    shard_of,
    shard_spec,
)
from mp_bridge.layers.reductions import masked_count, masked_mean, masked_sum
from mp_bridge.layers.rotary import apply_rotary, document_positions, rotary_positions
from mp_bridge.layers.vocab_shards import (
    VocabShard,
    padded_vocab_size,
    vocab_shard_ranges,
    vocab_shard_size,
    vocab_shards,
)

__all__ = [
    "VocabShard",
    "vocab_shards",
    "padded_vocab_size",
    "vocab_shard_ranges",
    "vocab_shard_size",
    "ShardPiece",
    "ShardSpec",
    "mark_sharded",
    "shard_spec",
    "shard_of",
    "load_shard_",
    "gather_shard",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logprobs",
    "vocab_parallel_entropy",
    "fused_linear_cross_entropy",
    "fused_linear_logprobs",
    "masked_sum",
    "masked_count",
    "masked_mean",
    "context_parallel_attention",
    "COMM_MODES",
    "image_attention",
    "apply_rotary",
    "document_positions",
    "rotary_positions",
    "ACTIVATIONS",
    "activation",
]
