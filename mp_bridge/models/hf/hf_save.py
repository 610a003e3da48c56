"""``save_hf(path, model)``: write a LLaVA ``save_pretrained`` directory from a model.

Collective over the model's groups: for each parameter in name-map order, its shards are
gathered into the full tensor (:func:`gather_shard`: one all-gather over its TP group,
nothing for a replicated one), cut into its HF tensors by the same runs :func:`load_hf`
reads (:mod:`.name_map`), and streamed by global rank 0 into ``model.safetensors``
(:func:`write_hf_directory`: header first, so no rank holds more than one full tensor
beyond its own shards). The untrained tensors (``model.hf_untrained``) follow.
``config.json`` is the config :func:`load_hf` read (``model.hf_config``) or the
``config=`` given. The directory is published by rename, so ``path`` holds a whole model
or the old one. ``LlavaForConditionalGeneration.from_pretrained(path)`` then loads the
same bits.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.layers import gather_shard, shard_spec
from mp_bridge.models.hf.hf_directory import check_hf_target, hf_header, write_hf_directory
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


def _gathered(mappings, params, extra) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor in write order; collective (one gather per sharded parameter)."""
    for m in mappings:
        param = params[m.ours]
        full = gather_shard(param.detach(), shard_spec(param))  # collective over TP
        yield from zip(m.hf, hf_tensors(m, full))
        del full
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
    if len(params) != len(mappings):
        raise ValueError(
            "save_hf writes from global rank 0, which must hold every parameter's shards: "
            "a pipelined LLM (pp > 1) is not supported yet; save at pp = 1 or use "
            "mp_bridge.checkpoint.save"
        )
    extra = dict(getattr(model, "hf_untrained", {}))
    header = hf_header(
        mappings,
        {n: p.dtype for n, p in params.items()},
        {k: (t.dtype, tuple(t.shape)) for k, t in extra.items()},
    )
    tensors = _gathered(mappings, params, extra)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_hf_directory(path, config, header, tensors)
    else:
        for _ in tensors:  # the gathers, collective with the writer's
            pass
    if dist.is_initialized():
        dist.barrier()  # every rank returns once the directory is published
