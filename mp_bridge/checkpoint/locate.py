"""Where a checkpoint lives on disk: its info file, the directories beside it, and which
directory holds the checkpoint published at a path.

A save writes into ``<parent>/.<name>.partial-<token>`` beside ``path`` and publishes it
by renames (:mod:`.publish`); between its two renames the whole checkpoint is
``<parent>/.<name>.old-<token>``. A directory is a checkpoint once it holds
:data:`INFO_FILE` (written last). No collective.

Example: ``staging_dir("ckpt/run", "3f2a")`` is ``<abs>/ckpt/.run.partial-3f2a``.
"""

from __future__ import annotations

import glob
import os

__all__ = ["INFO_FILE", "is_complete", "leftovers", "resolve", "sibling", "staging_dir"]

INFO_FILE = "mp_bridge.json"


def sibling(path: str, kind: str, token: str) -> str:
    """``<parent>/.<name>.<kind>-<token>`` beside ``path`` (``token`` ``*``: a glob)."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{kind}-{token}")


def staging_dir(path: str, token: str) -> str:
    """Where the save with ``token`` writes before it is published."""
    return sibling(path, "partial", token)


def leftovers(path: str) -> list[str]:
    """The partial writes and old copies beside ``path``."""
    return glob.glob(sibling(path, "partial", "*")) + glob.glob(sibling(path, "old", "*"))


def is_complete(directory: str) -> bool:
    """Whether ``directory`` holds a whole checkpoint (its :data:`INFO_FILE`)."""
    return os.path.isfile(os.path.join(directory, INFO_FILE))


def resolve(path: str) -> str:
    """The directory holding the checkpoint published at ``path``: ``path`` itself, or,
    when a publication was cut between its two renames, the whole one beside it (the
    newest). ``path`` when there is none (the reader then names ``path`` in its error)."""
    if os.path.exists(path):
        return path
    whole = [d for d in leftovers(path) if is_complete(d)]
    return max(whole, key=lambda d: os.path.getmtime(os.path.join(d, INFO_FILE)), default=path)
