"""``mp-bridge hf tiny DIR --text llama|qwen2|mistral --vision clip|siglip [--tie]``: write a
small random LLaVA with transformers' own ``save_pretrained``, offline (no download), then
print the :class:`MimoConfig` that :func:`config_from_hf` reads back from it.

``mp-bridge hf import DIR CKPT``: a checkpoint (``mp_bridge.checkpoint``) of the LLaVA at
``DIR``, loadable at any layout (:func:`mp_bridge.models.hf.import_hf`; one process, the
whole model in memory). ``mp-bridge checkpoint export-hf`` is the way back."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run_import", "run_tiny"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    tiny = sub.add_parser("tiny", help="write a small random LLaVA (transformers, offline)")
    tiny.add_argument("path", help="the directory to write (save_pretrained)")
    tiny.add_argument("--text", choices=("llama", "qwen2", "mistral"), default="llama")
    tiny.add_argument("--vision", choices=("clip", "siglip"), default="clip")
    tiny.add_argument("--tie", action="store_true", help="tie the head to the embedding")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=run_tiny)
    imp = sub.add_parser("import", help="write an HF LLaVA directory as a checkpoint")
    imp.add_argument("path", help="the save_pretrained directory (config.json, safetensors)")
    imp.add_argument("checkpoint", help="the checkpoint directory to write")
    imp.set_defaults(run=run_import)


def run_tiny(args: argparse.Namespace) -> int:
    from mp_bridge.models.hf import config_from_hf
    from mp_bridge.models.hf.tiny import tiny_llava

    tiny_llava(args.text, args.vision, tie=args.tie, seed=args.seed).save_pretrained(args.path)
    cfg = config_from_hf(args.path, seq_len=16)
    print(f"wrote {args.text} + {args.vision} LLaVA to {args.path}: {cfg}")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from mp_bridge.models.hf import import_hf

    import_hf(args.path, args.checkpoint)  # a bad directory: ValueError, one line, exit 2
    print(f"wrote the checkpoint {args.checkpoint} from {args.path}")
    return 0
