"""What a model loaded from Hugging Face adds to its checkpoint, and gets back at load.

``load_hf`` leaves two things on the model that its parameters do not hold: the parsed
config (``model.hf_config``, a ``LlavaConfig.to_dict()``) and the tensors the LLaVA forward
never reads (``model.hf_untrained``, on-disk key -> tensor). A plain ``save`` records the
config in ``mp_bridge.json`` (``CheckpointInfo.hf_config``) and each untrained tensor as a
replicated entry ``hf_untrained.<disk key>`` (every rank holds it whole; DCP writes it
once); a whole-model ``load`` puts both back on the model, so ``save_hf`` and
``export_hf`` write the same HF directory. A model without them saves as before. No
collective.

Example: a SigLIP tower run to layer 2 of 3 saves ``hf_untrained.vision_tower.
vision_model.encoder.layers.2.mlp.fc1.weight`` among others.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mp_bridge.checkpoint.keys import HF_UNTRAINED, hf_untrained_key

__all__ = ["hf_record", "hf_targets", "restore_hf"]


def hf_record(model: nn.Module) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """``(config as JSON gives it back, {hf_untrained.<key>: tensor})`` of ``model``
    (``(None, {})`` for a model not loaded with ``load_hf``); ``ValueError``/``TypeError``
    naming a bad attribute."""
    config: Any = getattr(model, "hf_config", None)
    untrained: Any = getattr(model, "hf_untrained", None) or {}
    if config is None:
        return None, {}
    try:  # as JSON (what mp_bridge.json and config.json hold: int keys become str)
        config = (
            json.loads(json.dumps(config, allow_nan=False)) if isinstance(config, dict) else None
        )
    except (TypeError, ValueError):
        config = None
    if config is None:
        raise ValueError(
            f"model.hf_config must be a dict of JSON values (what load_hf sets: "
            f"LlavaConfig.to_dict()), got {type(model.hf_config).__name__}: "
            f"{str(model.hf_config)[:60]}; set it with load_hf or delete the attribute"
        )
    if not isinstance(untrained, dict) or not all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in untrained.items()
    ):
        raise TypeError(
            "model.hf_untrained must map on-disk keys (str) to tensors (what load_hf "
            f"sets), got {type(untrained).__name__}"
        )
    return config, {hf_untrained_key(k): t.detach() for k, t in sorted(untrained.items())}


def hf_targets(metadata: Metadata) -> dict[str, torch.Tensor]:
    """Fresh buffers (saved shape and dtype, CPU) for every saved ``hf_untrained.*`` key."""
    return {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(HF_UNTRAINED) and isinstance(md, TensorStorageMetadata)
    }


def restore_hf(model: nn.Module, config: dict | None, read: dict[str, Any]) -> None:
    """Put a checkpoint's HF config and untrained tensors (``read``'s ``hf_untrained.*``
    values) back on ``model``; nothing for a checkpoint without a config."""
    if config is None:
        return
    model.hf_config = config
    model.hf_untrained = {
        k[len(HF_UNTRAINED) :]: v for k, v in read.items() if k.startswith(HF_UNTRAINED)
    }
