"""Atomic publication of a checkpoint directory, and the leftovers of saves that died.

A save writes into ``<parent>/.<name>.partial-<token>`` beside ``path``; once every rank
has finished and ``mp_bridge.json`` is written, the coordinator publishes it:

1. an existing checkpoint at ``path`` is renamed aside to ``.<name>.old-<token>``;
2. the new directory is renamed to ``path``; 3. the old one is deleted.

Each rename is atomic, so at every moment one whole checkpoint exists: at ``path``, or,
only between steps 1 and 2, beside it (:func:`.locate.resolve` finds it there and the next save
puts it back). A save that dies leaves a ``.partial-`` directory without
``mp_bridge.json``: a load never reads it and the next save deletes it. No collective.

Example: ``save("ckpt/run", ...)`` writes ``ckpt/.run.partial-3f2a...`` then renames it
to ``ckpt/run``.
"""

from __future__ import annotations

import os
import shutil

from mp_bridge.checkpoint.locate import (
    INFO_FILE,
    is_complete,
    leftovers,
    resolve,
    sibling,
    staging_dir,
)

# resolve and staging_dir are .locate's, named here too (where they were first written).
__all__ = ["check_target", "clean_leftovers", "publish", "resolve", "staging_dir"]


def check_target(path: str) -> None:
    """``ValueError`` naming ``path`` when a save may not write there: it (or a folder
    above it) is a file, or it is a directory that is neither a checkpoint nor empty
    (publishing would delete what it holds)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"cannot save a checkpoint at {path!r}: {parent!r} is a file")
    if os.path.exists(path) and not (
        os.path.isdir(path) and (is_complete(path) or not os.listdir(path))
    ):
        kind = "a directory that is not a checkpoint" if os.path.isdir(path) else "a file"
        raise ValueError(
            f"cannot save a checkpoint at {path!r}: it is {kind} (no {INFO_FILE}), and a "
            f"save replaces what is at its path; pass a new path or an earlier checkpoint's"
        )


def clean_leftovers(path: str) -> None:
    """Before a save: put back a checkpoint a cut publication left beside ``path``, then
    delete every other leftover (partial writes of dead saves, old copies)."""
    found = resolve(path)
    if found != path:
        os.rename(found, path)
    for leftover in leftovers(path):
        shutil.rmtree(leftover, ignore_errors=True)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: str, path: str, token: str) -> None:
    """Make the finished ``staging`` directory the checkpoint at ``path`` (see the module)."""
    old = None
    if os.path.exists(path):
        old = sibling(path, "old", token)
        os.rename(path, old)
    os.rename(staging, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
