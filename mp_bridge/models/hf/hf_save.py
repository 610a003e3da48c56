"""``save_hf(path, model)``: write a LLaVA ``save_pretrained`` directory from a model.

Collective over the model's groups: for each parameter in name-map order, its shards are
gathered into the full tensor (:func:`gather_shard`: one all-gather over its TP group,
nothing for a replicated one), cut into its HF tensors by the same runs :func:`load_hf`
reads (:mod:`.name_map`), and streamed by global rank 0 into ``model.safetensors``
(header first: every name, dtype and shape is known up front), so no rank holds more
than one full tensor beyond its own shards. The untrained tensors (``model.hf_untrained``)
follow. ``config.json`` is the config :func:`load_hf` read (``model.hf_config``) or the
``config=`` given. The directory is written beside ``path`` and published by rename
(the checkpoint wing's :func:`publish`), so ``path`` holds a whole model or the old one.
``LlavaForConditionalGeneration.from_pretrained(path)`` then loads the same bits.
"""

from __future__ import annotations

import json
import os
import uuid

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.checkpoint.publish import publish, staging_dir
from mp_bridge.layers import gather_shard, shard_spec
from mp_bridge.models.hf.hf_load import model_config, model_parameters
from mp_bridge.models.hf.name_map import HFMapping, hf_mappings
from mp_bridge.models.hf.safetensors_files import SINGLE_FILE, StreamingSafetensorsWriter

__all__ = ["hf_tensors", "save_hf"]


def hf_tensors(m: HFMapping, full: torch.Tensor) -> list[torch.Tensor]:
    """Our full tensor cut back into the HF tensors of ``m`` (in ``m.hf`` order)."""
    if m.reshape is not None:
        return [full.reshape(m.hf_shapes[0])]
    out = [full.new_empty(shape) for shape in m.hf_shapes]
    for o, i, h, n in m.runs:
        out[i][h : h + n] = full[o : o + n]
    return out


def _writer_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _check_target(path: str) -> None:
    if os.path.exists(path) and not (
        os.path.isdir(path)
        and (not os.listdir(path) or os.path.isfile(os.path.join(path, "config.json")))
    ):
        raise ValueError(
            f"save_hf will not replace {path!r}: it is a file or a directory "
            "without config.json; pass a new path or an HF model directory"
        )


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
    _check_target(path)
    mappings = hf_mappings(cfg)
    params = model_parameters(model, mappings)
    if len(params) != len(mappings):
        raise ValueError(
            "save_hf writes from global rank 0, which must hold every parameter's shards: "
            "a pipelined LLM (pp > 1) is not supported yet; save at pp = 1 or use "
            "mp_bridge.checkpoint.save"
        )
    extra = dict(sorted(getattr(model, "hf_untrained", {}).items()))
    entries = [(k, params[m.ours].dtype, s) for m in mappings for k, s in zip(m.hf, m.hf_shapes)]
    entries += [(k, t.dtype, tuple(t.shape)) for k, t in extra.items()]
    writer = _writer_rank()
    staging = staging_dir(path, uuid.uuid4().hex) if writer else None
    if writer:
        os.makedirs(staging)
        stream = StreamingSafetensorsWriter(os.path.join(staging, SINGLE_FILE), entries)
    for m in mappings:
        param = params[m.ours]
        full = gather_shard(param.detach(), shard_spec(param))  # collective over TP
        if writer:
            for key, tensor in zip(m.hf, hf_tensors(m, full)):
                stream.write(key, tensor)
        del full
    if writer:
        with stream:  # an error above leaves an unpublished staging directory only
            for key, tensor in extra.items():
                stream.write(key, tensor)
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        publish(staging, path, uuid.uuid4().hex)
    if dist.is_initialized():
        dist.barrier()  # every rank returns once the directory is published
