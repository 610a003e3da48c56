"""A checkpoint in words: what ``mp-bridge checkpoint inspect PATH`` prints (no collective,
no model: it reads ``mp_bridge.json`` and DCP's metadata only).

Example::

    checkpoint ckpt/run: format version 1, step 2, saved by 8 ranks
    extra: {"pair": "A"}
    encoder grid: tp=2, dp=4   llm grid: tp=2, cp=2, pp=1, dp=2
    hf: llava (llama + clip_vision_model); mp-bridge checkpoint export-hf writes it as ...
    key                        global shape  dtype          group
    -------------------------  ------------  -------------  -----
    model.llm.embed.weight     (61, 16)      torch.float32  2
"""

from __future__ import annotations

import json

from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mp_bridge.checkpoint.info import read_checkpoint
from mp_bridge.checkpoint.keys import MODEL, OPTIM, model_key, optim_param
from mp_bridge.table import format_table

__all__ = ["describe"]


def _grid(grid: dict) -> str:
    return ", ".join(f"{a}={s}" for a, s in zip(grid["axis_names"], grid["shape"]))


def _group(key: str, sizes: dict[str, int], shapes: dict) -> str:
    """The group size a key was sharded over at save (``-``: replicated, e.g. a step)."""
    if key.startswith(MODEL):
        return str(sizes.get(key[len(MODEL) :], "-"))
    if key.startswith(OPTIM):  # sharded like its parameter when it has its shape
        name = optim_param(key)
        if shapes.get(model_key(name)) == shapes[key]:
            return str(sizes.get(name, "-"))
    return "-"


def describe(path: str) -> str:
    """Format version, step, saved layout and every key with its global shape and dtype.

    Errors (``FileNotFoundError`` / ``ValueError``) name ``path`` as :func:`load`'s do.
    """
    info, metadata = read_checkpoint(path)
    lines = [
        f"checkpoint {path}: format version {info.format_version}, step {info.step}, "
        f"saved by {info.world_size} rank{'s' * (info.world_size != 1)}"
        + (", with optimizer state" if info.has_optimizer else ""),
        f"extra: {json.dumps(info.extra, sort_keys=True)}",
    ]
    if info.grids:
        lines.append("   ".join(f"{part} grid: {_grid(g)}" for part, g in info.grids.items()))
    if info.hf_config is not None:  # saved from a model loaded with load_hf
        parts = [info.hf_config.get(p, {}) for p in ("text_config", "vision_config")]
        kinds = " + ".join(str(c.get("model_type")) for c in parts if isinstance(c, dict))
        lines.append(
            f"hf: {info.hf_config.get('model_type')} ({kinds}); "
            f"mp-bridge checkpoint export-hf writes it as an HF directory"
        )
    shapes = {k: getattr(md, "size", None) for k, md in metadata.state_dict_metadata.items()}
    rows = [("key", "global shape", "dtype", "group")]
    for key in sorted(metadata.state_dict_metadata):
        md = metadata.state_dict_metadata[key]
        if isinstance(md, BytesStorageMetadata):
            rows.append((key, "-", "object", "-"))
        else:
            shape = f"({', '.join(str(s) for s in md.size)}{',' * (len(md.size) == 1)})"
            rows.append(
                (key, shape, str(md.properties.dtype), _group(key, info.group_sizes, shapes))
            )
    lines.append(format_table(rows))
    return "\n".join(lines)
