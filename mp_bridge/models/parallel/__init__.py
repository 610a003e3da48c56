"""TP/CP building blocks of the distributed encoder and LLM (whole, or in pipeline stages
run by ``LLMPipeline``), and full-state sharding."""

from .encoder import TPEncoder, TPProjection, bidirectional_attention
from .llm import TPLLM
from .llm_stages import TPLLMStage, stage_layers
from .pipeline import LLMPipeline, PipelineStepSpec
from .pipeline_capacity import agree_capacity, packed_length, pad_packed_to
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
    "TPLLMStage",
    "stage_layers",
    "LLMPipeline",
    "PipelineStepSpec",
    "agree_capacity",
    "packed_length",
    "pad_packed_to",
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
