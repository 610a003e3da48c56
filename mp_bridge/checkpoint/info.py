"""What a checkpoint says about itself: :class:`CheckpointInfo`, kept in ``mp_bridge.json``.

The file is written last, by the coordinator, once every rank's data and DCP's
``.metadata`` are on disk: a directory without it is not a checkpoint. It holds the
format version, the step, the user's ``extra`` (JSON), the layout the checkpoint was
saved from, the Hugging Face config of a model loaded from one (``hf_config``, only
then), and the size of every file (a load refuses a file of another size: a
truncated or replaced file). :func:`read_checkpoint` also reads DCP's metadata (what
``load`` and ``inspect`` start from). No collective.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from mp_bridge.checkpoint.locate import INFO_FILE, resolve

__all__ = [
    "FORMAT_VERSION",
    "INFO_FILE",  # .locate's, named here too
    "CheckpointInfo",
    "read_checkpoint",
    "read_info",
    "write_info",
]

#: Bumped when the on-disk layout changes in a way an older reader would misread.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint's own description (what :func:`~mp_bridge.checkpoint.load` returns).

    ``step``: the ``step`` passed to ``save``; ``extra``: its ``extra`` JSON values;
    ``format_version``: :data:`FORMAT_VERSION` at save; ``world_size``: ranks that saved;
    ``group_sizes``: each sharded parameter's group size at save (single-process names);
    ``grids``: for a colocated MIMO model, ``{"encoder": {...}, "llm": {...}}`` with each
    grid's ``shape``, ``axis_names`` and ``rank_offset`` (else ``{}``); ``has_optimizer``:
    whether optimizer state was saved; ``optimizer``: its class, ``module.QualName`` (``""``
    without one, and in checkpoints saved before it was recorded); ``hf_config``: the
    ``LlavaConfig.to_dict()`` of a model loaded with ``load_hf`` (its ``model.hf_config``;
    ``None`` otherwise, and then absent from the file); ``path``: where it was read from.
    """

    step: int
    extra: Any
    format_version: int
    world_size: int
    group_sizes: dict[str, int] = field(default_factory=dict)
    grids: dict[str, dict] = field(default_factory=dict)
    has_optimizer: bool = False
    optimizer: str = ""
    hf_config: dict | None = None
    path: str = ""

    def to_json(self) -> dict:
        hf = {} if self.hf_config is None else {"hf_config": self.hf_config}
        return {
            **hf,
            "format_version": self.format_version,
            "step": self.step,
            "extra": self.extra,
            "world_size": self.world_size,
            "group_sizes": self.group_sizes,
            "grids": self.grids,
            "has_optimizer": self.has_optimizer,
            "optimizer": self.optimizer,
        }


def write_info(directory: str, info: CheckpointInfo) -> None:
    """Write ``info`` and the size of every file already in ``directory`` (fsynced)."""
    files = {
        name: os.path.getsize(os.path.join(directory, name))
        for name in sorted(os.listdir(directory))
    }
    target = os.path.join(directory, INFO_FILE)
    with open(target, "w") as f:
        json.dump({**info.to_json(), "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_info(directory: str) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of the checkpoint at ``directory``.

    ``FileNotFoundError`` / ``ValueError`` naming the path when it does not exist, is not
    a checkpoint, is of a newer format, or a file is missing or has another size.
    """
    if not os.path.exists(directory):
        raise FileNotFoundError(f"no checkpoint at {directory!r}: the directory does not exist")
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a checkpoint: it is a file, not a directory")
    target = os.path.join(directory, INFO_FILE)
    if not os.path.isfile(target):
        raise ValueError(
            f"{directory!r} is not a checkpoint: it has no {INFO_FILE} (a save that did not "
            f"finish, or another kind of directory); pass a directory written by "
            f"mp_bridge.checkpoint.save"
        )
    try:
        with open(target) as f:
            raw = json.load(f)
        version = int(raw["format_version"])
        info = CheckpointInfo(
            step=int(raw["step"]), extra=raw["extra"], format_version=version,
            world_size=int(raw["world_size"]), group_sizes=dict(raw["group_sizes"]),
            grids=dict(raw["grids"]), has_optimizer=bool(raw["has_optimizer"]),
            optimizer=str(raw.get("optimizer", "")), hf_config=raw.get("hf_config"),
            path=directory,
        )  # fmt: skip
        files = dict(raw["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"damaged checkpoint at {directory!r}: {target} is unreadable ({exc})"
        ) from exc
    if version > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint at {directory!r} has format version {version}, newer than this "
            f"mp_bridge's {FORMAT_VERSION}; load it with a newer mp_bridge"
        )
    for name, size in files.items():
        file = os.path.join(directory, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual != size:
            raise ValueError(
                f"damaged checkpoint at {directory!r}: {name} is "
                f"{'missing' if actual is None else f'{actual} bytes'}, saved as {size} bytes"
            )
    return info


def read_checkpoint(path: str) -> tuple[CheckpointInfo, Metadata]:
    """The info and DCP metadata of the checkpoint published at ``path`` (no collective);
    errors name the path (missing, not a checkpoint, damaged)."""
    directory = resolve(path)
    info = read_info(directory)
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as exc:  # a truncated or corrupt .metadata: unpickling errors of any kind
        raise ValueError(
            f"damaged checkpoint at {path!r}: its DCP metadata is unreadable ({exc})"
        ) from exc
    return info, metadata
