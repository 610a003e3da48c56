"""One fused attention kernel call on one (query block, key block) pair, with its LSE.

Layout ``[b, heads, s, d]`` (views of ``[b, s, heads, d]`` tensors; no copy). Every caller
in this package goes through :func:`block_forward` / :func:`block_backward`, so the device
dispatch lives in one place:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward. Grouped
  heads (``hq % hk == 0``) are taken as they are (no repeated K/V). Masks are float
  (``0`` / ``-inf``; a bool mask raises in torch 2.13), and a query row that sees no key
  returns LSE ``0`` there, so :func:`block_forward` sets such rows to ``-inf``.
- CUDA: ``aten._scaled_dot_product_flash_attention`` for fp16 / bf16 without a mask,
  else ``aten._scaled_dot_product_efficient_attention`` (fp32, or a float mask). Grouped
  heads are repeated for these kernels (their aten entry points take equal head counts).

``causal=True`` is only ever asked of **square** pairs (``s_q == s_k``, the same first
position), where top-left and bottom-right alignment agree, so no kernel's convention of
``is_causal`` with ``s_q != s_k`` matters. The backward takes the *merged* output and LSE
of the whole attention (ring-flash-attn's trick): the block's probabilities are then the
global ones and its ``dq, dk, dv`` are exact contributions. A row whose merged LSE is
``-inf`` (it sees no key at all) is given ``+inf`` there, so its probabilities are 0.
"""

from __future__ import annotations

import torch

__all__ = ["block_backward", "block_forward"]

_LOW = (torch.float16, torch.bfloat16)


def _cuda_flash(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return mask is None and q.dtype in _LOW and q.shape[-1] <= 256


def _grouped(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``kv`` repeated to ``q``'s heads (the CUDA kernels' aten entry points need it)."""
    hq, hk = q.shape[1], kv.shape[1]
    return kv if hq == hk else kv.repeat_interleave(hq // hk, dim=1)


def _fold_heads(grad: torch.Tensor, hk: int) -> torch.Tensor:
    """Adjoint of :func:`_grouped`: sum each group's repeated-head gradients."""
    b, hq, s, d = grad.shape
    return grad if hq == hk else grad.reshape(b, hk, hq // hk, s, d).sum(2)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, hq, s_q, d] in q.dtype, lse [b, hq, s_q] fp32)`` of one block pair.

    ``mask``: float ``[pb, 1, s_q, s_k]`` (``0`` visible, ``-inf`` not) or ``None``.
    Rows with no visible key get ``lse = -inf`` and output 0.
    """
    if q.device.type == "cuda":
        if _cuda_flash(q, mask):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                q, _grouped(q, k), _grouped(q, v), 0.0, causal, False, scale=scale
            )
            out, lse = res[0], res[1]
        else:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, _grouped(q, k), _grouped(q, v), mask, True, 0.0, causal, scale=scale
            )[:2]
        lse = lse[..., : q.shape[2]].float()
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    if mask is not None:  # rows that see nothing: the CPU kernel reports lse 0
        sees = (mask == 0).any(-1)  # [pb, 1, s_q]
        lse = lse.masked_fill(~sees, float("-inf"))
    return out, lse


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block pair given the merged ``out`` (``q.dtype``) and ``lse``
    (fp32) of every key the rows see; shapes and dtypes of ``q, k, v``."""
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    if q.device.type == "cuda":
        kk, vv = _grouped(q, k), _grouped(q, v)
        if _cuda_flash(q, mask):
            s_q, s_k = q.shape[2], k.shape[2]
            cum = torch.zeros(1, dtype=torch.int32, device=q.device)
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, kk, vv, out, lse, cum, cum, s_q, s_k, 0.0, causal, zero, zero,
                scale=scale,
            )  # fmt: skip
        else:
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                grad_out, q, kk, vv, mask, out, lse.contiguous(), zero, zero, 0.0,
                [True, True, True, False], causal, scale=scale,
            )  # fmt: skip
        return dq, _fold_heads(dk, k.shape[1]), _fold_heads(dv, k.shape[1])
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )
