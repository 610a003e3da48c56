"""Staging buffers for asynchronous saves: one CPU copy of a model's checkpoint tensors,
allocated once per model and reused by every later save of it.

:func:`stage` copies each tensor into its buffer (same key, shape and dtype: reused;
otherwise made anew). A CUDA tensor's buffer is pinned and the copy is non-blocking: the
caller only enqueues the copies and gets a CUDA event the writer waits on before it
reads (the caller's later kernels run on the same stream after the copies, so training
may go on); a CPU tensor is copied in the caller. A buffer is reused only after the save
that read it is published (saves queue: :func:`.background.finish_pending`).

Memory: one staging copy per model (the size of its parameters and optimizer state on
this rank), held until :func:`drop_all` (``mp_bridge.checkpoint.close()``) or the model
is garbage-collected. No collective.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["drop_all", "stage"]

_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: buffer}


def _buffer(old: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
    if old is not None and old.shape == src.shape and old.dtype == src.dtype:
        return old
    return torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)


def stage(
    owner: object, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """CPU copies of ``tensors`` in ``owner``'s reused buffers, and the CUDA event that
    marks them ready (``None``: every copy is done already)."""
    old = _BUFFERS.get(owner, {})
    staged = {key: _buffer(old.get(key), t) for key, t in tensors.items()}
    on_cuda = False
    with torch.no_grad():
        for key, t in tensors.items():
            staged[key].copy_(t.detach(), non_blocking=t.is_cuda)
            on_cuda |= t.is_cuda
    _BUFFERS[owner] = staged
    if not on_cuda:
        return staged, None
    ready = torch.cuda.Event()
    ready.record()
    return staged, ready


def drop_all() -> None:
    """Free every model's staging buffers."""
    _BUFFERS.clear()
