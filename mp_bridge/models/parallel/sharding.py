"""Load a distributed module from full (single-process) weights and gather it back.

The per-parameter mechanism lives in :mod:`mp_bridge.layers.param_shards`: every sharded
parameter declares a ``ShardSpec`` where it is created (``mark_sharded``: the vocab layers
for their weights, ``tp_blocks`` for megatron's linears); unmarked parameters are
replicated. This module applies it to whole modules, by parameter name.

Example (TP 2, a column-parallel ``[8, 4]`` weight): rank 0 loads rows 0..3, rank 1 rows
4..7; :func:`gather_full_state` all-gathers them back into ``[8, 4]`` on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from mp_bridge.layers import gather_shard, load_shard_, shard_spec

# The per-parameter names (ShardSpec, mark_sharded, shard_of) have one public home,
# mp_bridge.layers; this module holds the whole-module steps only.
__all__ = ["FullStateMixin", "build_from_full", "gather_full_state", "load_full_state"]


def build_from_full(cls, reference: nn.Module, cfg, *, device=None, names=None, **kwargs):
    """``cls(cfg, device=device, **kwargs)`` loaded with this rank's slices of
    ``reference.state_dict()`` (only ``names`` when given; no collective), then moved to
    ``device``.

    Draws no random numbers: the constructor's default inits (overwritten by the load) run
    under ``torch.random.fork_rng`` on the CPU generator, where modules are built. What a
    rank builds differs by rank (a pipeline stage holds the embedding, the head, or
    neither), so without this the global generator would leave the build in a
    rank-dependent state, and data drawn from it afterwards (e.g. image noise) would
    differ between ranks that must see the same inputs (one encoder TP group spanning
    several LLM stages: its replicated parameters then diverge).
    """
    with torch.random.fork_rng(devices=[]):
        model = cls(cfg, device=device, **kwargs)
    state = reference.state_dict()
    if names is not None:
        keep = names(model)
        state = {k: v for k, v in state.items() if k in keep}
    load_full_state(model, state)
    return model if device is None else model.to(device)


@torch.no_grad()
def load_full_state(module: nn.Module, full_state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's slice of every full tensor into ``module``'s parameters.

    ``full_state`` is a single-process ``state_dict`` with the same parameter names (a
    tied parameter under each of its names, as ``state_dict`` lists it).
    Raises ``ValueError`` listing missing/unexpected names or a shape that does not fit.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(full_state))
    extra = sorted(set(full_state) - set(params))
    if missing or extra:
        raise ValueError(
            f"full state does not match {type(module).__name__}: missing {missing}, "
            f"unexpected {extra}; build both models from the same MimoConfig"
        )
    for name, param in params.items():
        load_shard_(param, full_state[name], name=name)


@torch.no_grad()
def gather_full_state(module: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter (sharded ones all-gathered, padding dropped).

    ``grads=True`` gathers the parameters' ``.grad`` instead (zeros where it is ``None``),
    e.g. to compare synced gradients with a single-process model's.
    Collective: one all-gather per sharded parameter over its group; every rank of those
    groups must call it. Returns detached copies on the parameters' device.
    """
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        value = param
        if grads:
            value = torch.zeros_like(param) if param.grad is None else param.grad
        out[name] = gather_shard(value, shard_spec(param))
    return out


class FullStateMixin:
    """``from_full`` / ``to_full`` for a sharded module whose parameter names equal those
    of a single-process reference module (``TPEncoder``, ``TPProjection``, ``TPLLM``)."""

    @classmethod
    def from_full(cls, reference: nn.Module, cfg, *, device: torch.device | None = None, **kwargs):
        """This rank's shards of ``reference``: ``cls(cfg, device=device, **kwargs)`` loaded
        with :func:`load_full_state` (no collective), then moved to ``device``; draws no
        random numbers (:func:`build_from_full`)."""
        return build_from_full(cls, reference, cfg, device=device, **kwargs)

    def to_full(self) -> dict[str, torch.Tensor]:
        """Full ``state_dict``-shaped tensors (:func:`gather_full_state`; collective over TP)."""
        return gather_full_state(self)
