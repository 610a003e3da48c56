"""TP/CP building blocks of the distributed encoder and LLM (whole, or in pipeline stages
run by ``LLMPipeline``), and full-state sharding (the per-parameter shard names,
``ShardSpec``, ``mark_sharded``, ``shard_of``, live in :mod:`mp_bridge.layers`)."""

from .encoder import TPEncoder, TPProjection, bidirectional_attention
from .llm import TPLLM
from .llm_stages import TPLLMStage, stage_layers
from .pipeline import LLMPipeline, PipelineStepSpec
from .pipeline_capacity import agree_capacity, packed_length, pad_packed_to
from .sharding import FullStateMixin, gather_full_state, load_full_state
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
    "gather_full_state",
    "load_full_state",
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
