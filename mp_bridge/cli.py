"""``mp-bridge`` command line: ``plan`` (rank tables), ``demo`` (train + oracle parity) and
``checkpoint inspect`` (a checkpoint's layout and keys), ``checkpoint export-hf`` (a
checkpoint as an HF LLaVA directory), ``hf tiny`` (a small random LLaVA written by
transformers) and ``hf import`` (an HF LLaVA directory as a checkpoint)."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    from mp_bridge.commands import checkpoint, demo, hf, plan

    parser = argparse.ArgumentParser(prog="mp-bridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan.add_arguments(sub.add_parser("plan", help="print every rank's coordinates and groups"))
    demo.add_arguments(sub.add_parser("demo", help="train the tiny MIMO model + oracle parity"))
    checkpoint.add_arguments(sub.add_parser("checkpoint", help="inspect or export-hf a checkpoint"))
    hf.add_arguments(sub.add_parser("hf", help="Hugging Face LLaVA models (tiny, import)"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (0 ok, 2 bad arguments, 1 failure)."""
    # megatron-core warns at import that TE/apex/absl are absent; on CPU that is expected.
    warnings.filterwarnings(
        "ignore", message=".*(Transformer Engine|absl|Apex|CUDA_DEVICE_MAX_CONNECTIONS).*"
    )
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:  # bad specs: one line with the fix, no traceback
        print(f"mp-bridge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
