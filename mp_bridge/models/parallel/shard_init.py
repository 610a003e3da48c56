"""A seeded init of a sharded module's own shards, for models built from a config alone.

``init_shards_(module, prefix=..., seed=0)`` fills every parameter in place, with no
collective and no full tensor: 1-D ``*.weight`` (norm scales) 1, ``*.bias`` 0, anything
else ``N(0, 0.02)`` drawn from a generator seeded by ``(seed, full name)`` for a
replicated parameter (so every rank holding it draws the same values) and by
``(seed, full name, first full row)`` for each real piece of a sharded one
(``ShardSpec.local_pieces``); padding rows stay 0. The values depend on the layout (a
piece is drawn whole), so this init is a placeholder until :func:`load_hf` or
``checkpoint.load`` fills the model; the global RNG is not touched.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from mp_bridge.layers import shard_spec

__all__ = ["init_shards_"]

_STD = 0.02


def _normal(shape: torch.Size, key: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((zlib.crc32(key.encode()) + 1_000_003 * seed) % 2**63)
    return torch.randn(shape, generator=gen) * _STD


@torch.no_grad()
def init_shards_(module: nn.Module, *, prefix: str = "", seed: int = 0) -> nn.Module:
    """Fill ``module``'s parameters (see the module); ``prefix`` makes their names the
    full model's (e.g. ``"llm."``). Returns ``module``."""
    for name, param in module.named_parameters():
        full = prefix + name
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1 and name.endswith("weight"):
            param.fill_(1.0)
        elif (spec := shard_spec(param)) is None:
            param.copy_(_normal(param.shape, full, seed))
        else:
            param.zero_()
            for piece in spec.local_pieces(param.shape[spec.dim]):
                local = param.narrow(spec.dim, piece.local_start, piece.length)
                local.copy_(_normal(local.shape, f"{full}@{piece.full_start}", seed))
    return module
