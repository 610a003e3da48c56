"""``save_hf(path, model)``: write a LLaVA ``save_pretrained`` directory from a model.

Collective over every rank: for each parameter in name-map order, its shards are
gathered into the full tensor (:func:`gather_shard`: one all-gather over its TP group,
nothing for a replicated one); a pipelined LLM's parameter that global rank 0 does not
hold is then sent to it by the lowest rank holding it (one ``send`` / ``recv`` of the
full tensor; owners and dtypes found by one ``all_gather_object`` first). Rank 0 cuts it
into its HF tensors by the same runs :func:`load_hf` reads (:mod:`.name_map`) and streams
them into ``model.safetensors`` (:func:`write_hf_directory`: header first, so no rank
holds more than one full tensor beyond its own shards). The untrained tensors
(``model.hf_untrained``) follow. ``config.json`` is the config :func:`load_hf` read
(``model.hf_config``) or the ``config=`` given, its ``dtype`` set to the trained
parameters' (:func:`config_with_dtype`). The directory is published by rename, so
``path`` holds a whole model or the old one.
``LlavaForConditionalGeneration.from_pretrained(path)`` then loads the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.layers import gather_shard, shard_spec
from mp_bridge.models.hf.hf_directory import (
    check_hf_target,
    config_with_dtype,
    hf_header,
    write_hf_directory,
)
from mp_bridge.models.hf.hf_load import model_config, model_parameters
from mp_bridge.models.hf.name_map import HFMapping, hf_mappings

__all__ = ["hf_tensors", "save_hf"]


def hf_tensors(m: HFMapping, full: torch.Tensor) -> list[torch.Tensor]:
    """Our full tensor cut back into the HF tensors of ``m`` (in ``m.hf`` order)."""
    if m.reshape is not None:
        return [full.reshape(m.hf_shapes[0])]
    out = [full.new_empty(shape) for shape in m.hf_shapes]
    for o, i, h, n in m.runs:
        out[i][h : h + n] = full[o : o + n]
    return out


def _owners(params: dict, n_mappings: int) -> dict[str, tuple[int, torch.dtype]] | None:
    """Our name -> (the lowest global rank holding it, its dtype) when some rank holds
    fewer than all ``n_mappings`` parameters (a pipelined LLM), else ``None``. Collective
    (one ``all_gather_object``) whenever a process group is initialized."""
    if not dist.is_initialized():
        return None
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, {n: p.dtype for n, p in params.items()})
    if all(len(h) == n_mappings for h in held):
        return None
    owners: dict[str, tuple[int, torch.dtype]] = {}
    for rank, names in enumerate(held):
        for name, dtype in names.items():
            owners.setdefault(name, (rank, dtype))
    return owners


def _to_writer(full, m: HFMapping, owner: tuple[int, torch.dtype], device) -> torch.Tensor | None:
    """``full`` sent by its owner rank to global rank 0 (``send`` / ``recv``); rank 0 gets
    the tensor, the others ``None``."""
    src, dtype = owner
    rank = dist.get_rank()
    if rank == src:
        dist.send(full.contiguous(), dst=0)
    if rank != 0:
        return None
    out = torch.empty(m.full_shape, dtype=dtype, device=device)
    dist.recv(out, src=src)
    return out


def _gathered(mappings, params, extra, owners, writer) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor in write order on the ``writer``, nothing elsewhere; collective
    (one gather per sharded parameter, one send per parameter rank 0 does not hold)."""
    device = next(iter(params.values())).device
    for m in mappings:
        param = params.get(m.ours)
        full = None if param is None else gather_shard(param.detach(), shard_spec(param))
        if owners is not None and owners[m.ours][0] != 0:  # another stage's: to rank 0
            full = _to_writer(full, m, owners[m.ours], device)
        if writer:
            yield from zip(m.hf, hf_tensors(m, full))
        del full
    if writer:
        yield from sorted(extra.items())


@torch.no_grad()
def save_hf(path: str, model: nn.Module, *, config: dict | None = None) -> None:
    """Write ``model`` as an HF LLaVA directory at ``path`` (collective; see the module)."""
    cfg = model_config(model)
    config = config if config is not None else getattr(model, "hf_config", None)
    if not isinstance(config, dict):
        raise ValueError(
            "save_hf needs the HF config: load the model with load_hf, or pass "
            "config= (a LlavaConfig's to_dict())"
        )
    check_hf_target(path, "save_hf")
    mappings = hf_mappings(cfg)
    params = model_parameters(model, mappings)
    owners = _owners(params, len(mappings))
    dtypes = {n: d for n, (_, d) in (owners or {}).items()}
    dtypes.update((n, p.dtype) for n, p in params.items())
    extra = dict(getattr(model, "hf_untrained", {}))
    header = hf_header(mappings, dtypes, {k: (t.dtype, tuple(t.shape)) for k, t in extra.items()})
    writer = not dist.is_initialized() or dist.get_rank() == 0
    tensors = _gathered(mappings, params, extra, owners, writer)
    if writer:
        write_hf_directory(path, config_with_dtype(config, dtypes.values()), header, tensors)
    else:
        for _ in tensors:  # the gathers, collective with the writer's
            pass
    if dist.is_initialized():
        dist.barrier()  # every rank returns once the directory is published
