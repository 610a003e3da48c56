"""Attention over CP shards and ragged images: fused kernels per block pair, merged by LSE."""
