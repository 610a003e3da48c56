"""The checks ``save`` and ``load`` run on their arguments, before any collective."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mp_bridge.checks import check_bool, check_int

__all__ = ["check_common", "check_extra", "check_prefix"]


def check_common(path: Any, model: Any, optimizer: Any, stateful: Any) -> str:
    """``path`` as a string; ``TypeError`` naming a bad ``path``/``model``/``optimizer``/
    ``stateful`` (a mapping of names to objects with ``state_dict``/``load_state_dict``)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"path must be a directory path (str or os.PathLike), got {path!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if stateful is not None:
        if not isinstance(stateful, Mapping):
            raise TypeError(
                f"stateful must be a mapping of names to objects with state_dict() and "
                f"load_state_dict() (e.g. {{'scheduler': scheduler}}), got "
                f"{type(stateful).__name__}"
            )
        for key, obj in stateful.items():
            if not isinstance(key, str) or not all(
                callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")
            ):
                raise TypeError(
                    f"stateful[{key!r}] must be keyed by a str and have state_dict() and "
                    f"load_state_dict(), got {type(obj).__name__}"
                )
    return os.fspath(path)


def check_extra(step: Any, extra: Any, async_save: Any) -> None:
    """``step`` an int >= 0, ``async_save`` a bool, ``extra`` JSON values: ``ValueError``
    unless it comes back from JSON as it is (no NaN, no tuple, only ``str`` keys)."""
    check_int("step", step, low=0, fix="the training step this checkpoint follows")
    check_bool("async_save", async_save)
    try:
        same = json.loads(json.dumps(extra, allow_nan=False, sort_keys=True)) == extra
        problem = "" if same else "JSON gives back another value (a tuple? a non-str key?)"
    except (TypeError, ValueError) as exc:
        problem = str(exc)
    if problem:
        raise ValueError(
            f"extra must hold JSON values (dict with str keys, list, str, int, float, bool, "
            f"None), got {extra!r}: {problem}"
        )


def check_prefix(prefix: Any) -> str:
    """``prefix`` (``None`` -> ``""``); a non-empty one must end with ``.``, e.g. ``"llm."``."""
    if prefix is None:
        return ""
    if not isinstance(prefix, str) or not prefix.endswith(".") or prefix == ".":
        raise ValueError(
            f"prefix={prefix!r}: pass the name of a part of the saved model followed by a "
            f"dot, e.g. prefix='llm.', or None for the whole model"
        )
    return prefix
