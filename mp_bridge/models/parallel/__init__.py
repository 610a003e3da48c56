"""TP/CP building blocks of the distributed encoder and LLM, and full-state sharding."""

from .encoder import TPEncoder, TPProjection, bidirectional_attention
from .llm import TPLLM
from .sharding import (
    FullStateMixin,
    ShardSpec,
    gather_full_state,
    load_full_state,
    mark_sharded,
    shard_of,
)
from .tp_blocks import (
    TPMLP,
    AttentionCore,
    TPAttention,
    TPBlock,
    column_linear,
    make_blocks,
    make_norm,
    parallel_config,
    row_linear,
)

__all__ = [
    "TPEncoder",
    "TPProjection",
    "bidirectional_attention",
    "TPLLM",
    "FullStateMixin",
    "ShardSpec",
    "gather_full_state",
    "load_full_state",
    "mark_sharded",
    "shard_of",
    "AttentionCore",
    "TPAttention",
    "TPBlock",
    "TPMLP",
    "column_linear",
    "make_blocks",
    "make_norm",
    "parallel_config",
    "row_linear",
]
