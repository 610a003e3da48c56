"""Tensor-parallel transformer pieces built on megatron-core's parallel linears.

Layout inside blocks is sequence-first, ``[s, b, h]`` (megatron's convention: with
sequence parallelism its linears all-gather / reduce-scatter along dim 0).

- ``qkv``: ``ColumnParallelLinear(h, (hq + 2hk)·d)``, rows ``[hk, (g·q, k, v), d]`` split
  by K/V groups; ``proj``: ``RowParallelLinear(h, h)``; MLP ``fc1`` column (SwiGLU:
  ``[gate; up]``, ``parts=2``), ``fc2`` row. Biases per :class:`BlockOptions`. Megatron's *f*
  (identity fwd / all-reduce bwd) sits before each column linear and *g* (all-reduce fwd)
  after each row linear; with SP these become all-gather / reduce-scatter along ``s``.
- Norms are replicated over TP. With SP each TP rank normalizes its own sequence slice,
  so their gradients are partial and carry ``param.sequence_parallel = True`` (summed over
  TP by the model's gradient sync).
- ``tp_group=None`` means a single process: plain ``nn.Linear`` stands in (megatron's
  linears would read its global parallel state instead).
- The SP collectives are ours (``gather_along`` before a column linear, backward
  reduce-scatter; ``reduce_scatter_along`` after a row linear, backward all-gather):
  megatron's SP paths take a buffer from ``parallel_state``'s global memory buffer (never
  initialized here) and allocate on ``torch.cuda.current_device()``, so they fail on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from mp_bridge.comm import gather_along, group_size, reduce_scatter_along
from mp_bridge.layers import activation, apply_rotary, mark_sharded
from mp_bridge.models.parallel.block_options import BlockOptions

__all__ = [
    "AttentionCore",
    "TPAttention",
    "TPBlock",
    "TPMLP",
    "column_linear",
    "make_blocks",
    "make_norm",
    "parallel_config",
    "row_linear",
]

#: ``(q, k, v) -> out`` on ``[b, s, heads_local, d]`` tensors; may communicate (CP).
AttentionCore = Callable[..., torch.Tensor]


def parallel_config(
    tp_group: dist.ProcessGroup | None, *, sequence_parallel: bool = False
) -> ModelParallelConfig:
    """A megatron ``ModelParallelConfig`` for CPU-initialized fp32 layers we load ourselves."""
    tp = group_size(tp_group)
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights always come from a full model (from_full)
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
    )


class _LocalLinear(nn.Linear):
    """Single-process stand-in returning megatron's ``(output, bias)`` pair."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


class _SPColumnParallelLinear(ColumnParallelLinear):
    """Column linear on a sequence-parallel input ``[s/tp, b, in]``: all-gather ``s`` first.

    Built with ``disable_grad_reduce=True`` so megatron adds no *f* of its own: the
    backward reduce-scatter of ``gather_along`` already sums the per-shard input grads.
    """

    def forward(self, x: torch.Tensor, *args, **kwargs):  # type: ignore[override]
        return super().forward(gather_along(x, self.tp_group, dim=0), *args, **kwargs)


def _tp_linear(
    in_size: int,
    out_size: int,
    *,
    tp_group: dist.ProcessGroup | None,
    config: ModelParallelConfig,
    kinds: tuple[type[nn.Module], type[nn.Module]],
    shard_dim: int,
    bias: bool = False,
    parts: int = 1,
    **megatron_kwargs,
) -> nn.Module:
    """``kinds = (plain, sequence-parallel)`` megatron class; weight split along ``shard_dim``
    (0: output rows, column-parallel; 1: input columns, row-parallel). A column bias is
    split like the rows; a row bias is replicated and added once, after the TP reduce
    (megatron's ``RowParallelLinear``; after the reduce-scatter under SP, where each rank
    adds it to its own slice, so its gradient is partial over TP: ``sequence_parallel``)."""
    if tp_group is None:
        layer: nn.Module = _LocalLinear(in_size, out_size, bias=bias)
    else:
        # The SP subclasses run our own SP collectives: megatron's SP paths stay off.
        megatron_config = dataclasses.replace(config, sequence_parallel=False)
        layer = kinds[config.sequence_parallel](
            in_size, out_size, config=megatron_config, init_method=nn.init.zeros_, bias=bias,
            tp_group=tp_group, **megatron_kwargs,
        )  # fmt: skip
    full_size = out_size if shard_dim == 0 else in_size
    mark_sharded(layer.weight, dim=shard_dim, group=tp_group, full_size=full_size, parts=parts)
    if bias and shard_dim == 0:
        mark_sharded(layer.bias, dim=0, group=tp_group, full_size=out_size, parts=parts)
    elif bias:
        layer.bias.sequence_parallel = config.sequence_parallel
    return layer


def column_linear(
    in_size: int,
    out_size: int,
    *,
    tp_group: dist.ProcessGroup | None,
    config: ModelParallelConfig,
    bias: bool = False,
    parts: int = 1,
) -> nn.Module:
    """Output-sharded linear ``[.., in] -> [.., out/tp]``; weight rows split over TP
    (``parts=k``: ``k`` fused parts, each split, e.g. SwiGLU's ``[gate; up]``).

    With ``config.sequence_parallel`` the input is ``[s/tp, b, in]`` and the output
    ``[s, b, out/tp]``.
    """
    return _tp_linear(
        in_size, out_size, tp_group=tp_group, config=config,
        kinds=(ColumnParallelLinear, _SPColumnParallelLinear), shard_dim=0, bias=bias,
        parts=parts, gather_output=False, disable_grad_reduce=config.sequence_parallel,
    )  # fmt: skip


class _SPRowParallelLinear(RowParallelLinear):
    """Row linear producing a sequence-parallel output: local matmul, then reduce-scatter
    along ``s`` (megatron's SP *g-bar*; backward all-gathers the output gradient)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # [s, b, in/tp] @ [in/tp, out] -> partial [s, b, out] -> summed [s/tp, b, out]
        out = reduce_scatter_along(F.linear(x, self.weight), self.tp_group, dim=0)
        return (out if self.bias is None else out + self.bias), None


def row_linear(
    in_size: int,
    out_size: int,
    *,
    tp_group: dist.ProcessGroup | None,
    config: ModelParallelConfig,
    bias: bool = False,
) -> nn.Module:
    """Input-sharded linear ``[.., in/tp] -> [.., out]`` (summed over TP, then the bias);
    columns split. With ``config.sequence_parallel`` the output is reduce-scattered to
    ``[s/tp, b, out]``.
    """
    return _tp_linear(
        in_size, out_size, tp_group=tp_group, config=config,
        kinds=(RowParallelLinear, _SPRowParallelLinear), shard_dim=1, bias=bias,
        input_is_parallel=True, skip_bias_add=False,
    )  # fmt: skip


def _apex_layer_norm() -> type[nn.Module] | None:
    # Only the real NVIDIA apex (the PyPI project named "apex" is unrelated).
    try:
        from apex.normalization import FusedLayerNorm
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return FusedLayerNorm


def make_norm(
    hidden: int,
    eps: float,
    *,
    device: torch.device | None = None,
    sequence_parallel: bool = False,
    kind: str = "layernorm",
) -> nn.Module:
    """LayerNorm over ``hidden``: apex ``FusedLayerNorm`` on CUDA when importable, else torch
    (both have ``weight``/``bias``, so full-state loading is the same); ``kind="rmsnorm"``:
    ``nn.RMSNorm`` (``weight`` only)."""
    if kind == "rmsnorm":
        norm: nn.Module = nn.RMSNorm(hidden, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm
    fused = _apex_layer_norm() if device is not None and device.type == "cuda" else None
    norm = (fused or nn.LayerNorm)(hidden, eps=eps)
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel
    return norm


class TPAttention(nn.Module):
    """``[s, b, h] -> [s, b, h]``: column QKV, RoPE on q and k, ``core`` on local heads,
    row output proj.

    QKV rows are megatron's per-K/V-group interleave ``[hk, (g·q, k, v), d]``
    (``g = heads / kv_heads``), so the TP split holds whole groups (``hk`` divides by TP):
    ``q [b, s, heads/tp, d]`` and ``k, v [b, s, kv_heads/tp, d]`` go to ``core`` as they
    are (it takes grouped heads; nothing repeats K/V). With ``rope_theta`` q and k are
    rotated by ``core_kwargs["rotary_positions"]`` first (default ``position_ids``, the
    tokens' original positions; the LLM gives packed tokens their positions within their
    document, :func:`~mp_bridge.layers.document_positions`, computed once per forward).
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        tp_group: dist.ProcessGroup | None,
        config: ModelParallelConfig,
        core: AttentionCore,
        kv_heads: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        rope_theta: float | None = None,
    ):
        super().__init__()
        tp = group_size(tp_group)
        kv_heads = heads if kv_heads is None else kv_heads
        if kv_heads % tp or heads % kv_heads:
            raise ValueError(
                f"kv_heads={kv_heads} must divide heads={heads} and be divisible by tp={tp} "
                f"(each TP rank holds whole K/V groups); pick a TP size dividing {kv_heads}"
            )
        self.heads_local, self.kv_local = heads // tp, kv_heads // tp
        self.head_dim, self.rope_theta = hidden // heads, rope_theta
        self.core = core
        rows = (heads + 2 * kv_heads) * self.head_dim
        self.qkv = column_linear(hidden, rows, tp_group=tp_group, config=config, bias=qkv_bias)
        self.proj = row_linear(hidden, hidden, tp_group=tp_group, config=config, bias=out_bias)

    def forward(self, x: torch.Tensor, **core_kwargs) -> torch.Tensor:
        qkv, _ = self.qkv(x)  # [s, b, (hq + 2 hk) d / tp] (s gathered over TP with SP)
        s, b = qkv.shape[:2]
        g, d = self.heads_local // self.kv_local, self.head_dim
        qkv = qkv.view(s, b, self.kv_local, g + 2, d).transpose(0, 1)
        q = qkv[:, :, :, :g].reshape(b, s, self.heads_local, d)
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [b, s, hk/tp, d]
        rotary = core_kwargs.pop("rotary_positions", None)  # the core takes no such key
        if self.rope_theta is not None:
            positions = core_kwargs["position_ids"] if rotary is None else rotary
            q = apply_rotary(q, positions, self.rope_theta)
            k = apply_rotary(k, positions, self.rope_theta)
        out = self.core(q, k, v, **core_kwargs)  # [b, s, heads/tp, d]
        out = out.transpose(0, 1).reshape(s, b, self.heads_local * self.head_dim)
        return self.proj(out)[0]


class TPMLP(nn.Module):
    """``[.., h] -> [.., out]``: column ``fc1``, activation, row ``fc2`` (output
    TP-replicated). ``gated``: SwiGLU, ``fc1`` the fused ``[gate; up]`` declared
    ``parts=2`` (a rank holds ``[gate_r; up_r]``), ``fc2(silu(gate_r)·up_r)``."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        out: int | None = None,
        *,
        tp_group: dist.ProcessGroup | None,
        config: ModelParallelConfig,
        act: str = "gelu",
        gated: bool = False,
        bias: bool = False,
    ):
        super().__init__()
        self.act, self.gated = activation("silu" if gated else act), gated
        self.fc1 = column_linear(
            hidden, 2 * ffn if gated else ffn, tp_group=tp_group, config=config, bias=bias,
            parts=2 if gated else 1,
        )  # fmt: skip
        out = hidden if out is None else out
        self.fc2 = row_linear(ffn, out, tp_group=tp_group, config=config, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)[0]
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.fc2(self.act(gate) * up)[0]
        return self.fc2(self.act(h))[0]


class TPBlock(nn.Module):
    """Pre-norm transformer block on ``[s(/tp with SP), b, h]``; names match the reference.
    ``options`` picks the block (:class:`BlockOptions`; default: the tiny model's)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn: int,
        *,
        eps: float,
        tp_group: dist.ProcessGroup | None,
        config: ModelParallelConfig,
        core: AttentionCore,
        device: torch.device | None = None,
        options: BlockOptions | None = None,
    ):
        super().__init__()
        sp, o = config.sequence_parallel, options or BlockOptions()
        norm = dict(device=device, sequence_parallel=sp, kind=o.norm)
        self.ln1 = make_norm(hidden, eps, **norm)
        self.attn = TPAttention(
            hidden, heads, tp_group=tp_group, config=config, core=core, kv_heads=o.kv_heads,
            qkv_bias=o.qkv_bias, out_bias=o.out_bias, rope_theta=o.rope_theta,
        )  # fmt: skip
        self.ln2 = make_norm(hidden, eps, **norm)
        self.mlp = TPMLP(hidden, ffn, tp_group=tp_group, config=config, act=o.act,
                         gated=o.gated, bias=o.mlp_bias)  # fmt: skip

    def forward(self, x: torch.Tensor, **core_kwargs) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), **core_kwargs)
        return x + self.mlp(self.ln2(x))


def make_blocks(n: int, *args, **kwargs) -> nn.ModuleList:
    """``n`` :class:`TPBlock` s built with the same arguments (named like the reference's)."""
    return nn.ModuleList(TPBlock(*args, **kwargs) for _ in range(n))
