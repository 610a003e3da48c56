"""``mp-bridge checkpoint inspect PATH``: a checkpoint's format version, step, saved
layout and every key with its global shape and dtype (see
:func:`mp_bridge.checkpoint.describe.describe`). Reads files only: no process group."""

from __future__ import annotations

import argparse

from mp_bridge.checkpoint.describe import describe

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    inspect = sub.add_parser("inspect", help="print a checkpoint's layout and keys")
    inspect.add_argument("path", help="the checkpoint directory (what save() was given)")
    inspect.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        print(describe(args.path))
    except FileNotFoundError as exc:  # a bad PATH argument: one line, exit code 2
        raise ValueError(str(exc)) from exc
    return 0
