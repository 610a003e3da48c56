"""``import_hf(directory, checkpoint)``: a checkpoint from a LLaVA ``save_pretrained``
directory, the reverse of :func:`export_hf`.

The plain route, in one process: build the :class:`ReferenceMimo` of
``config_from_hf(directory)`` on the meta device, allocate each parameter uninitialized
in the dtype of the HF tensors it is made of, fill it with :func:`load_hf` (every key and
shape checked first) and write it with
``mp_bridge.checkpoint.save``, which records the HF config and the untrained tensors. The
checkpoint's names are the single-process ones, so it loads into a colocated model at
any layout. Memory: the whole model, once, in the HF dtype (plus ``load_hf``'s reads); no
random initialization.
Under an initialized ``torch.distributed`` world ``save`` is collective over it: every
rank calls ``import_hf`` (each holds the whole model; DCP writes each tensor once).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from mp_bridge.checkpoint import save
from mp_bridge.models.hf.hf_config import config_from_hf
from mp_bridge.models.hf.hf_load import load_hf
from mp_bridge.models.hf.name_map import hf_mappings
from mp_bridge.models.hf.safetensors_files import HFFiles
from mp_bridge.models.reference import ReferenceMimo

__all__ = ["import_hf"]


@torch.no_grad()
def import_hf(
    directory: str | os.PathLike, checkpoint: str | os.PathLike, *, seq_len: int | None = None
) -> ReferenceMimo:
    """Write the HF LLaVA at ``directory`` as a checkpoint at ``checkpoint`` (see the
    module); returns the filled model. ``seq_len``: as :func:`config_from_hf` (the
    checkpoint holds no sequence length). ``ValueError`` naming a missing directory, one
    without ``config.json`` or weights, an unsupported config, or a key that does not fit."""
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise TypeError(f"directory must be a path (str or os.PathLike), got {directory!r}")
    directory = os.fspath(directory)
    cfg = config_from_hf(directory, seq_len=seq_len)
    files = HFFiles(directory)
    with torch.device("meta"):  # no random init
        model = ReferenceMimo(cfg)
    params = dict(model.named_parameters())
    mappings = hf_mappings(cfg)
    unmapped = sorted(set(params) - {m.ours for m in mappings})
    if unmapped:  # the name map covers the reference model by construction
        raise RuntimeError(f"import_hf: no HF tensor fills {unmapped}")
    for m in mappings:  # keep the HF dtype (a bf16 model stays bf16)
        dtype = files.dtype(m.hf[0]) if m.hf[0] in files.file_of else torch.float32
        param = params[m.ours]  # a missing key is load_hf's error to name, before any fill
        # In place of the meta tensor, keeping the object (a tied head stays tied).
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty(param.shape, dtype=dtype)))
    load_hf(directory, model)
    save(checkpoint, model)
    return model
