"""``export_hf(checkpoint, out)``: an HF LLaVA directory from a checkpoint, in one process.

The checkpoint (any saved layout, written by plain ``mp_bridge.checkpoint.save`` of a model
loaded with ``load_hf``) records the HF config in ``mp_bridge.json`` and the untrained
tensors as ``hf_untrained.<disk key>`` (:mod:`mp_bridge.checkpoint.hf_record`). Steps, no
process group (``no_dist`` reads; fine beside an initialized world):

1. check: the checkpoint's HF config builds a :class:`MimoConfig` (:func:`config_from_hf`);
   every ``model.<ours>`` of the name map (:func:`hf_mappings`) is saved with the full
   shape the map expects, and no other ``model.*`` key is (``ValueError`` naming the key);
2. stream: for each mapping, DCP reads the one full tensor ``model.<ours>`` (unpadded,
   whatever layout wrote it), :func:`hf_tensors` cuts it into its HF tensors, and
   :func:`write_hf_directory` (``save_hf``'s writer) streams them; the untrained tensors
   follow, then ``config.json``; published by rename.

Memory: one full tensor (and its HF cuts) at a time. The name map, the cut and the writer
are ``save_hf``'s: an export and a ``save_hf`` of the same weights are the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mp_bridge.checkpoint import read_checkpoint
from mp_bridge.checkpoint.keys import HF_UNTRAINED, MODEL, model_key
from mp_bridge.checkpoint.ranks import dcp_quietly
from mp_bridge.models.hf.hf_config import config_from_hf
from mp_bridge.models.hf.hf_directory import (
    check_hf_target,
    config_with_dtype,
    hf_header,
    write_hf_directory,
)
from mp_bridge.models.hf.hf_save import hf_tensors
from mp_bridge.models.hf.name_map import HFMapping, hf_mappings

__all__ = ["export_hf"]


def _saved(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {
        k: md
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _check_keys(path: str, mappings: list[HFMapping], saved: dict) -> None:
    for m in mappings:
        md = saved.get(model_key(m.ours))
        if md is None or tuple(md.size) != m.full_shape:
            got = "nothing" if md is None else tuple(md.size)
            raise ValueError(
                f"checkpoint at {path!r} does not fit its HF config: {model_key(m.ours)} "
                f"saved {got}, the name map expects {m.full_shape}; export a checkpoint "
                "of the model load_hf filled"
            )
    known = {model_key(m.ours) for m in mappings}
    extra = sorted(k for k in saved if k.startswith(MODEL) and k not in known)
    if extra:
        raise ValueError(
            f"checkpoint at {path!r} holds {extra[0]}, which no HF tensor of its config "
            f"is made of ({len(extra)} such keys); it is not the model of its HF config"
        )


def _read(path: str, key: str, md: TensorStorageMetadata) -> torch.Tensor:
    """The one full tensor ``key`` (no process group)."""
    out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with dcp_quietly():
        dcp.load({key: out}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return out


def _tensors(path, mappings, saved, untrained) -> Iterator[tuple[str, torch.Tensor]]:
    for m in mappings:
        key = model_key(m.ours)
        yield from zip(m.hf, hf_tensors(m, _read(path, key, saved[key])))
    for name in sorted(untrained):
        yield name, _read(path, HF_UNTRAINED + name, saved[HF_UNTRAINED + name])


@torch.no_grad()
def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write the checkpoint at ``checkpoint`` as an HF LLaVA directory at ``out`` (one
    process, no collective; see the module). ``ValueError`` naming the path for a missing
    or damaged checkpoint, one without an HF config, or one of another model."""
    for name, value in (("checkpoint", checkpoint), ("out", out)):
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise TypeError(f"{name} must be a directory path (str or os.PathLike), got {value!r}")
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    try:
        info, metadata = read_checkpoint(checkpoint)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc
    if info.hf_config is None:
        raise ValueError(
            f"checkpoint at {checkpoint!r} records no HF config: it was not saved from a "
            "model loaded with load_hf; load the HF model with load_hf (or mp-bridge hf "
            "import), then save"
        )
    check_hf_target(out, "export_hf")
    cfg = config_from_hf(info.hf_config)
    mappings = hf_mappings(cfg)
    saved = _saved(metadata)
    _check_keys(checkpoint, mappings, saved)
    untrained = {
        k[len(HF_UNTRAINED) :]: md for k, md in saved.items() if k.startswith(HF_UNTRAINED)
    }
    dtypes = {m.ours: saved[model_key(m.ours)].properties.dtype for m in mappings}
    header = hf_header(
        mappings, dtypes, {k: (md.properties.dtype, tuple(md.size)) for k, md in untrained.items()}
    )
    tensors = _tensors(info.path, mappings, saved, untrained)
    write_hf_directory(out, config_with_dtype(info.hf_config, dtypes.values()), header, tensors)
