"""Load a distributed module from full (single-process) weights and gather it back.

Each sharded parameter carries a :class:`ShardSpec` (set with :func:`mark_sharded`): the
tensor dim it is split along, the group it is split over, and the full size along that
dim. Rank ``r`` of the group holds rows ``[r * n, (r + 1) * n)`` of the full tensor
(``n`` = the local size), Megatron's contiguous layout; rows past the full size are
padding (e.g. a padded vocab) and load as zeros. Unmarked parameters are replicated.

Example (TP 2, a column-parallel ``[8, 4]`` weight): rank 0 loads rows 0..3, rank 1 rows
4..7; :func:`gather_full_state` all-gathers them back into ``[8, 4]`` on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.comm import all_gather_tensor, group_rank

__all__ = [
    "FullStateMixin",
    "ShardSpec",
    "gather_full_state",
    "load_full_state",
    "mark_sharded",
    "shard_of",
]


@dataclass(frozen=True)
class ShardSpec:
    """``dim``: the split tensor dim; ``group``: the split group; ``full_size``: unpadded size."""

    dim: int
    group: dist.ProcessGroup | None
    full_size: int


def mark_sharded(
    param: torch.Tensor, *, dim: int, group: dist.ProcessGroup | None, full_size: int
) -> torch.Tensor:
    """Attach a :class:`ShardSpec` to ``param`` (returns it, for chaining)."""
    param.mp_shard = ShardSpec(dim, group, full_size)
    return param


def shard_of(full: torch.Tensor, local_shape: torch.Size, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's slice of ``full`` for a parameter of ``local_shape`` (zero-padded)."""
    if spec is None:
        return full
    n = local_shape[spec.dim]
    start = group_rank(spec.group) * n
    out = full.new_zeros(local_shape)
    take = max(0, min(n, full.shape[spec.dim] - start))
    if take:
        out.narrow(spec.dim, 0, take).copy_(full.narrow(spec.dim, start, take))
    return out


@torch.no_grad()
def load_full_state(module: nn.Module, full_state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's slice of every full tensor into ``module``'s parameters.

    ``full_state`` is a single-process ``state_dict`` with the same parameter names.
    Raises ``ValueError`` listing missing/unexpected names or a shape that does not fit.
    """
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(full_state))
    extra = sorted(set(full_state) - set(params))
    if missing or extra:
        raise ValueError(
            f"full state does not match {type(module).__name__}: missing {missing}, "
            f"unexpected {extra}; build both models from the same MimoConfig"
        )
    for name, param in params.items():
        spec = getattr(param, "mp_shard", None)
        full = full_state[name].to(device=param.device, dtype=param.dtype)
        expected = list(param.shape)
        if spec is not None:
            expected[spec.dim] = spec.full_size
        if list(full.shape) != expected:
            raise ValueError(
                f"{name}: full tensor has shape {tuple(full.shape)}, expected {tuple(expected)} "
                "for this shard layout; check the MimoConfig sizes"
            )
        param.copy_(shard_of(full, param.shape, spec))


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
        spec = getattr(param, "mp_shard", None)
        value = param.detach()
        if grads:
            value = torch.zeros_like(value) if param.grad is None else param.grad.detach()
        if spec is None:
            out[name] = value.clone()
            continue
        full = all_gather_tensor(value, spec.group, spec.dim)
        out[name] = full.narrow(spec.dim, 0, spec.full_size).clone()
    return out


class FullStateMixin:
    """``from_full`` / ``to_full`` for a sharded module whose parameter names equal those
    of a single-process reference module (``TPEncoder``, ``TPProjection``, ``TPLLM``)."""

    @classmethod
    def from_full(cls, reference: nn.Module, cfg, *, device: torch.device | None = None, **kwargs):
        """This rank's shards of ``reference``: ``cls(cfg, device=device, **kwargs)`` loaded
        with :func:`load_full_state` (no collective), then moved to ``device``."""
        model = cls(cfg, device=device, **kwargs)
        load_full_state(model, reference.state_dict())
        return model if device is None else model.to(device)

    def to_full(self) -> dict[str, torch.Tensor]:
        """Full ``state_dict``-shaped tensors (:func:`gather_full_state`; collective over TP)."""
        return gather_full_state(self)
