"""Small reference models (TP encoder, projection, CP/TP LLM) and the colocated MIMO wrapper."""

__all__: list[str] = []
