"""Small reference models (TP encoder, projection, CP/TP LLM) and the colocated MIMO wrapper."""

from mp_bridge._lazy import lazy_exports

_EXPORTS = {
    "MimoConfig": "config",
    "ReferenceEncoder": "reference",
    "ReferenceProjection": "reference",
    "ReferenceLLM": "reference",
    "ReferenceMimo": "reference",
    "place_image_embeddings": "placement",
    "TPEncoder": "encoder",
    "TPProjection": "encoder",
    "TPLLM": "llm",
    "ColocatedMimoModel": "mimo",
    "build_colocated_mimo": "build",
    "destroy_colocated_mimo": "build",
    "load_full_state": "sharding",
    "gather_full_state": "sharding",
    "MimoBatch": "data",
    "synthetic_batch": "data",
    "dp_shard": "data",
    "ParityReport": "oracle",
    "run_parity": "oracle",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [*_EXPORTS]
