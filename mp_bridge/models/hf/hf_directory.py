"""Writing one ``save_pretrained``-style directory: ``model.safetensors`` streamed from an
iterator of ``(key, tensor)``, then ``config.json``, published atomically.

The one write side of :func:`save_hf` (tensors gathered from the ranks' shards) and
:func:`export_hf` (tensors read from a checkpoint): the header (every key, dtype and
shape, :func:`hf_header`) is known before the first tensor, so the writer holds one
tensor at a time. The directory is written beside ``path`` and published by rename (the
checkpoint wing's :func:`publish`): ``path`` holds a whole model or the old one. No
collective.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Mapping

import torch

from mp_bridge.checkpoint.publish import publish, staging_dir
from mp_bridge.models.hf.name_map import HFMapping
from mp_bridge.models.hf.safetensors_files import SINGLE_FILE, StreamingSafetensorsWriter

__all__ = ["check_hf_target", "config_with_dtype", "hf_header", "write_hf_directory"]

Header = list[tuple[str, torch.dtype, tuple[int, ...]]]


def check_hf_target(path: str, who: str) -> None:
    """``ValueError`` (naming ``who``, the caller) when ``path`` is a file or a non-empty
    directory without ``config.json``: only an HF model directory is ever replaced."""
    if os.path.exists(path) and not (
        os.path.isdir(path)
        and (not os.listdir(path) or os.path.isfile(os.path.join(path, "config.json")))
    ):
        raise ValueError(
            f"{who} will not replace {path!r}: it is a file or a directory "
            "without config.json; pass a new path or an HF model directory"
        )


def config_with_dtype(config: dict, trained: Iterable[torch.dtype]) -> dict:
    """A copy of ``config`` whose ``dtype`` (and a transformers 4 ``torch_dtype``, when
    present) names the widest floating dtype of the ``trained`` tensors: the dtype
    ``from_pretrained`` then builds the model in (its default ``dtype="auto"`` reads it).
    Without it, a model loaded from bf16 and trained in fp32 would come back as bf16.
    The untrained tensors keep their dtype in the file; ``from_pretrained`` casts them."""
    floats = [d for d in trained if d.is_floating_point]
    if not floats:
        return dict(config)
    name = str(max(floats, key=lambda d: d.itemsize)).removeprefix("torch.")
    out = {**config, "dtype": name}
    if "torch_dtype" in out:
        out["torch_dtype"] = name
    return out


def hf_header(
    mappings: list[HFMapping],
    dtypes: Mapping[str, torch.dtype],
    untrained: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> Header:
    """Every HF tensor in write order: each mapping's (dtype ``dtypes[m.ours]``) in
    name-map order, then the ``untrained`` ones (key -> dtype, shape) sorted by key."""
    header = [(k, dtypes[m.ours], tuple(s)) for m in mappings for k, s in zip(m.hf, m.hf_shapes)]
    header += [(k, d, tuple(s)) for k, (d, s) in sorted(untrained.items())]
    return header


def write_hf_directory(
    path: str, config: dict, header: Header, tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Stream ``tensors`` (in ``header``'s order; checked) into ``path``'s
    ``model.safetensors``, write ``config`` as ``config.json``, publish. An error leaves an
    unpublished staging directory only."""
    staging = staging_dir(path, uuid.uuid4().hex)
    os.makedirs(staging)
    with StreamingSafetensorsWriter(os.path.join(staging, SINGLE_FILE), header) as stream:
        for key, tensor in tensors:
            stream.write(key, tensor)
    with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    publish(staging, path, uuid.uuid4().hex)
