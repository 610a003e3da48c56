"""``load_hf(path, model)``: fill a model's parameters from a LLaVA ``save_pretrained``
directory, each rank reading only the rows it holds.

Steps (every rank alone, no collective): parse ``config.json`` (:func:`config_from_hf`)
and check it builds the model's :class:`MimoConfig`; list the on-disk keys and check them
against the name map (:func:`hf_mappings`): a missing, unexpected or mis-shaped key is a
``ValueError`` naming the key and both shapes, raised on every rank (the same files give
the same verdict) before any parameter changes. Then, for each parameter, the rows of
its shard (``ShardSpec.local_pieces``: contiguous rows, one piece per fused part) are
read as slices of the HF tensors that hold them (the mapping's runs, safetensors
``get_slice``); vocab padding rows are zero. With a tied head the absent
``lm_head.weight`` is not missing (a present one is ignored: the embedding is the head).
Tensors the LLaVA forward never reads are kept on ``model.hf_untrained`` (key -> tensor),
and the parsed config on ``model.hf_config``, for :func:`save_hf`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mp_bridge.layers import shard_spec
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.hf.hf_config import config_from_hf, llava_config
from mp_bridge.models.hf.name_map import HFMapping, hf_mappings, untrained
from mp_bridge.models.hf.safetensors_files import HFFiles

__all__ = ["load_hf", "model_config", "model_parameters"]

_HEAD = "language_model.lm_head.weight"


def model_config(model: nn.Module) -> MimoConfig:
    """The :class:`MimoConfig` a model was built from (``model.cfg``, or its LLM's for a
    :class:`ColocatedMimoModel`)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        cfg = getattr(getattr(model, "llm", None), "cfg", None)
    if not isinstance(cfg, MimoConfig):
        raise TypeError(
            f"{type(model).__name__} has no MimoConfig at .cfg or .llm.cfg; pass a "
            "ReferenceMimo or a ColocatedMimoModel"
        )
    return cfg


def model_parameters(model: nn.Module, mappings: list[HFMapping]) -> dict[str, nn.Parameter]:
    """Our full name -> this rank's parameter, for every mapping this rank holds: all of
    them, except that a pipeline stage holds its own part of ``llm.*`` (``ValueError``
    listing the names that do not match: a model of another config)."""
    params = dict(model.named_parameters())
    want = {m.ours for m in mappings}
    staged = getattr(getattr(model, "llm", None), "n_stages", 1) > 1
    if staged:
        want = {n for n in want if n in params or not n.startswith("llm.")}
    if set(params) != want:
        raise ValueError(
            f"{type(model).__name__}'s parameters do not match the HF name map: missing "
            f"{sorted(want - set(params))[:5]}, unexpected {sorted(set(params) - want)[:5]}; "
            "build the model from config_from_hf(path)"
        )
    return params


def _check_config(path: str, cfg: MimoConfig) -> None:
    disk = dataclasses.replace(config_from_hf(path, seq_len=cfg.seq_len))
    diff = [
        f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(disk, f.name)
    ]
    if diff:
        shown = ", ".join(
            f"{n}: model {getattr(cfg, n)!r} vs {path!r} {getattr(disk, n)!r}" for n in diff[:4]
        )
        raise ValueError(
            f"the model's MimoConfig is not {path!r}'s ({shown}); build it "
            "from config_from_hf(path)"
        )


def check_keys(files: HFFiles, mappings: list[HFMapping], cfg: MimoConfig, path: str) -> None:
    """``ValueError`` naming the first missing, mis-shaped or unexpected key."""
    on_disk = set(files.keys())
    for m in mappings:
        for key, shape in zip(m.hf, m.hf_shapes):
            if key not in on_disk:
                raise ValueError(
                    f"{path!r} is missing {key} (expected shape {shape}), which "
                    f"our {m.ours} is made of"
                )
            if files.shape(key) != tuple(shape):
                raise ValueError(
                    f"{path!r}: {key} has shape {files.shape(key)} but the config "
                    f"gives {tuple(shape)} (our {m.ours})"
                )
    known = {k for m in mappings for k in m.hf}
    if cfg.tie_embeddings:
        known.add(_HEAD)
    extra = sorted(k for k in on_disk - known if not untrained(k, cfg))
    if extra:
        raise ValueError(
            f"{path!r} holds {extra[0]} (shape {files.shape(extra[0])}) that no "
            f"parameter of this config reads ({len(extra)} unexpected keys)"
        )


def read_full_rows(files: HFFiles, m: HFMapping, dim: int, start: int, stop: int):
    """Our full tensor's rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)``, read
    as slices of the HF tensors that hold them."""
    if m.reshape is not None:
        return files.read(m.hf[0]).reshape(m.reshape).narrow(dim, start, stop - start)
    if dim == 1:
        return files.read(m.hf[0], 1, start, stop)  # direct mappings only shard columns
    parts = [files.read(m.hf[i], 0, h, h + n) for _, i, h, n in m.runs_in(start, stop)]
    return torch.cat(parts, dim=0)


def _fill(files: HFFiles, m: HFMapping, param: torch.Tensor) -> None:
    """Copy this rank's rows of ``m`` into ``param``, one piece (one slice read) at a time,
    so the only transient is the piece itself; vocab padding rows are zero."""
    spec = shard_spec(param)
    if spec is None:
        param.copy_(read_full_rows(files, m, 0, 0, m.full_shape[0]))
        return
    pieces = spec.local_pieces(param.shape[spec.dim])
    if sum(piece.length for piece in pieces) < param.shape[spec.dim]:
        param.zero_()  # padding rows (the vocab's)
    for piece in pieces:
        rows = read_full_rows(files, m, spec.dim, piece.full_start, piece.full_start + piece.length)
        param.narrow(spec.dim, piece.local_start, piece.length).copy_(rows)


@torch.no_grad()
def load_hf(path: str, model: nn.Module) -> None:
    """Fill ``model`` (a :class:`ReferenceMimo`, or a sharded model whose parameters carry
    their ``ShardSpec``) from the LLaVA checkpoint at ``path``; see the module. No
    collective: each rank reads its own slices."""
    cfg = model_config(model)
    _check_config(path, cfg)
    files = HFFiles(path)
    mappings = hf_mappings(cfg)
    params = model_parameters(model, mappings)
    check_keys(files, mappings, cfg, path)
    for m in mappings:  # every key and shape checked: parameters change one at a time
        param = params.get(m.ours)
        if param is None:  # another pipeline stage's
            continue
        _fill(files, m, param)
    model.hf_untrained = {k: files.read(k) for k in files.keys() if untrained(k, cfg)}
    model.hf_config = llava_config(path).to_dict()
