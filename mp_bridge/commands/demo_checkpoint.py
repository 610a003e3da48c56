"""``mp-bridge demo --save DIR [--save-every K]`` and ``--resume DIR``: the demo's checkpoints.

``--save DIR`` keeps one checkpoint per saved step, ``DIR/step-000010`` (every ``K``
steps and the last), and a ``DIR/latest`` file naming the newest; the pointer is written
after its checkpoint is published and replaced atomically (``os.replace``).
``--resume DIR`` continues from the newest complete checkpoint under ``DIR`` (the one
``latest`` names, or a newer complete ``step-*`` if a run died before moving the
pointer), at any ``--encoder`` / ``--llm`` layout (and world size): ``--steps`` is the
length of the whole run. The data and training options that shape the loss curve
(:data:`RUN_OPTIONS`) must equal the saved ones; ``--batch-size`` left out takes the
saved one. The saved losses continue the curve, so the parity table compares the whole
run with the single-process oracle.

Layout: ``DIR/step-000004/`` (a :func:`mp_bridge.checkpoint.save` checkpoint whose
``extra`` holds ``{"losses": [...], "options": {...}, "config": {...}}``), ``DIR/latest``
(one line: ``step-000004``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RUN_OPTIONS",
    "DemoCheckpoints",
    "add_checkpoint_arguments",
    "latest_checkpoint",
    "prepare_checkpoints",
]

#: The options that shape the loss curve (data and Adam): a resume must keep them.
RUN_OPTIONS = ("images", "uniform", "flow", "balance", "seed", "batch_size", "lr")
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    parser.add_argument(
        "--save", metavar="DIR", help="keep checkpoints DIR/step-NNNNNN and a DIR/latest pointer"
    )
    parser.add_argument(
        "--save-every", type=int, metavar="K", help="with --save: every K steps (default: last)"
    )
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from DIR's latest complete checkpoint, at any --encoder/--llm layout "
        "(--steps counts the whole run)",
    )


def step_dir(root: str, step: int) -> str:
    """``root/step-000004`` for ``step`` 4."""
    return os.path.join(root, f"step-{step:06d}")


def write_latest(root: str, step: int) -> None:
    """Point ``root/latest`` at ``step``'s checkpoint (atomic: a reader sees old or new)."""
    tmp = os.path.join(root, f".{LATEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(os.path.basename(step_dir(root, step)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def latest_checkpoint(root: str) -> tuple[str, Any]:
    """``(path, CheckpointInfo)`` of the newest complete checkpoint under ``root`` (no
    collective); ``ValueError`` naming ``root`` when there is none."""
    from mp_bridge.checkpoint.info import read_checkpoint

    names = set(os.listdir(root)) if os.path.isdir(root) else set()
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            names.add(f.read().strip())
    found = []
    for name in names:
        if _STEP_DIR.match(name):
            try:
                path = os.path.join(root, name)
                found.append((path, read_checkpoint(path)[0]))
            except (ValueError, OSError):  # a save that died: not a checkpoint
                continue
    if not found:
        raise ValueError(
            f"--resume {root}: no complete checkpoint there (expected {root}/{LATEST} or "
            f"{root}/step-NNNNNN written by mp-bridge demo --save {root})"
        )
    return max(found, key=lambda item: item[1].step)


#: What a Namespace built without these flags means (the parser's defaults).
_DEFAULTS = {"images": "ragged", "uniform": False, "flow": "routed", "balance": False, "seed": 0}


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name, _DEFAULTS.get(name)) for name in RUN_OPTIONS}


@dataclass(frozen=True)
class DemoCheckpoints:
    """The demo's :class:`~mp_bridge.models.TrainHooks`: save every ``save_every`` steps
    (and the last) under ``save_dir``; resume from ``resume_from``. Runs on every rank."""

    steps: int
    options: dict
    config: dict
    save_dir: str | None = None
    save_every: int | None = None
    resume_from: str | None = None

    def resume(self, model, optimizer) -> tuple[int, list[float]]:
        import torch.distributed as dist

        from mp_bridge.checkpoint import load

        if self.resume_from is None:
            return 0, []
        info = load(self.resume_from, model, optimizer)
        if dist.get_rank() == 0:
            print(
                f"resumed {self.resume_from} (saved by {info.world_size} ranks): continuing "
                f"from step {info.step}",
                flush=True,
            )
        return info.step, list(info.extra["losses"])

    def after_step(self, step: int, model, optimizer, losses: list[float]) -> None:
        import torch.distributed as dist

        from mp_bridge.checkpoint import save

        done = step + 1
        if self.save_dir is None or (done % (self.save_every or self.steps) and done != self.steps):
            return
        path = step_dir(self.save_dir, done)
        extra = {"losses": list(losses), "options": self.options, "config": self.config}
        save(path, model, optimizer, step=done, extra=extra)
        if dist.get_rank() == 0:
            write_latest(self.save_dir, done)
            print(f"saved step {done}: {path}", flush=True)


def _check_saved(args: argparse.Namespace, path: str, info: Any) -> None:
    saved = info.extra.get("options", {}) if isinstance(info.extra, dict) else {}
    if args.batch_size is None:
        args.batch_size = saved.get("batch_size")
    for name, value in _options(args).items():
        if name in saved and saved[name] != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"--resume {args.resume}: {path} was trained with {flag} {saved[name]!r} but "
                f"this run has {value!r}; the loss curve continues only with the same data "
                f"and Adam options: pass {flag} {saved[name]}"
            )
    if args.steps <= info.step:
        raise ValueError(
            f"--steps {args.steps} counts the whole run, and {path} already did "
            f"{info.step} steps; pass --steps {info.step + 1} or more"
        )


def prepare_checkpoints(args: argparse.Namespace, validate) -> tuple[Any, DemoCheckpoints | None]:
    """``(validate(args), hooks)``: the checkpoint flags and the saved run checked against
    this one, before any rank starts (``ValueError`` naming the flag and the fix); hooks
    ``None`` without ``--save`` / ``--resume``."""
    resume = None
    if getattr(args, "resume", None):
        resume, info = latest_checkpoint(args.resume)
        _check_saved(args, resume, info)
    layouts = validate(args)
    if getattr(args, "save_every", None) is not None:
        if not getattr(args, "save", None):
            raise ValueError("--save-every needs --save DIR (where the checkpoints go)")
        if args.save_every < 1:
            raise ValueError(f"--save-every {args.save_every} must be >= 1 (steps)")
    config = dataclasses.asdict(args.config)
    if resume is not None and info.extra.get("config", config) != config:
        raise ValueError(
            f"--resume {args.resume}: this layout widens the model to {config} but the "
            f"checkpoint holds {info.extra['config']}; resume at TP sizes that divide 8"
        )
    if getattr(args, "save", None):
        os.makedirs(args.save, exist_ok=True)
    hooks = None
    if resume is not None or getattr(args, "save", None):
        hooks = DemoCheckpoints(
            steps=args.steps, options=_options(args), config=config, save_dir=args.save,
            save_every=args.save_every, resume_from=resume,
        )  # fmt: skip
    return layouts, hooks
