"""Tensor-parallel transformer pieces built on megatron-core's parallel linears.

Layout inside blocks is sequence-first, ``[s, b, h]`` (megatron's convention: with
sequence parallelism its linears all-gather / reduce-scatter along dim 0).

- ``qkv``: ``ColumnParallelLinear(h, 3h)``, rows ``[heads, (q, k, v), d]`` split by heads;
  ``proj``: ``RowParallelLinear(h, h)``; MLP ``fc1`` column, ``fc2`` row. Megatron's *f*
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
from mp_bridge.layers import mark_sharded

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
    **megatron_kwargs,
) -> nn.Module:
    """``kinds = (plain, sequence-parallel)`` megatron class; weight split along ``shard_dim``
    (0: output rows, column-parallel; 1: input columns, row-parallel)."""
    if tp_group is None:
        layer: nn.Module = _LocalLinear(in_size, out_size, bias=False)
    else:
        # The SP subclasses run our own SP collectives: megatron's SP paths stay off.
        megatron_config = dataclasses.replace(config, sequence_parallel=False)
        layer = kinds[config.sequence_parallel](
            in_size, out_size, config=megatron_config, init_method=nn.init.zeros_, bias=False,
            tp_group=tp_group, **megatron_kwargs,
        )  # fmt: skip
    full_size = out_size if shard_dim == 0 else in_size
    mark_sharded(layer.weight, dim=shard_dim, group=tp_group, full_size=full_size)
    return layer


def column_linear(
    in_size: int, out_size: int, *, tp_group: dist.ProcessGroup | None, config: ModelParallelConfig
) -> nn.Module:
    """Output-sharded linear ``[.., in] -> [.., out/tp]``; weight rows split over TP.

    With ``config.sequence_parallel`` the input is ``[s/tp, b, in]`` and the output
    ``[s, b, out/tp]``.
    """
    return _tp_linear(
        in_size, out_size, tp_group=tp_group, config=config,
        kinds=(ColumnParallelLinear, _SPColumnParallelLinear), shard_dim=0,
        gather_output=False, disable_grad_reduce=config.sequence_parallel,
    )  # fmt: skip


class _SPRowParallelLinear(RowParallelLinear):
    """Row linear producing a sequence-parallel output: local matmul, then reduce-scatter
    along ``s`` (megatron's SP *g-bar*; backward all-gathers the output gradient)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # [s, b, in/tp] @ [in/tp, out] -> partial [s, b, out] -> summed [s/tp, b, out]
        return reduce_scatter_along(F.linear(x, self.weight), self.tp_group, dim=0), None


def row_linear(
    in_size: int, out_size: int, *, tp_group: dist.ProcessGroup | None, config: ModelParallelConfig
) -> nn.Module:
    """Input-sharded linear ``[.., in/tp] -> [.., out]`` (summed over TP); columns split.

    With ``config.sequence_parallel`` the output is reduce-scattered to ``[s/tp, b, out]``.
    """
    return _tp_linear(
        in_size, out_size, tp_group=tp_group, config=config,
        kinds=(RowParallelLinear, _SPRowParallelLinear), shard_dim=1,
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
    hidden: int, eps: float, *, device: torch.device | None = None, sequence_parallel: bool = False
) -> nn.Module:
    """LayerNorm over ``hidden``: apex ``FusedLayerNorm`` on CUDA when importable, else torch.

    Both have ``weight``/``bias`` parameters, so full-state loading is the same.
    """
    fused = _apex_layer_norm() if device is not None and device.type == "cuda" else None
    norm = (fused or nn.LayerNorm)(hidden, eps=eps)
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel
    return norm


class TPAttention(nn.Module):
    """``[s, b, h] -> [s, b, h]``: column QKV, ``core`` on local heads, row output proj."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        tp_group: dist.ProcessGroup | None,
        config: ModelParallelConfig,
        core: AttentionCore,
    ):
        super().__init__()
        self.heads_local = heads // group_size(tp_group)
        self.head_dim = hidden // heads
        self.core = core
        self.qkv = column_linear(hidden, 3 * hidden, tp_group=tp_group, config=config)
        self.proj = row_linear(hidden, hidden, tp_group=tp_group, config=config)

    def forward(self, x: torch.Tensor, **core_kwargs) -> torch.Tensor:
        qkv, _ = self.qkv(x)  # [s, b, 3h/tp] (s gathered over TP with SP)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.heads_local, 3, self.head_dim).transpose(0, 1)
        q, k, v = (qkv[:, :, :, i] for i in range(3))  # [b, s, heads/tp, d]
        out = self.core(q, k, v, **core_kwargs)  # [b, s, heads/tp, d]
        out = out.transpose(0, 1).reshape(s, b, self.heads_local * self.head_dim)
        return self.proj(out)[0]


class TPMLP(nn.Module):
    """``[.., h] -> [.., out]``: column ``fc1``, GELU, row ``fc2`` (output TP-replicated)."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        out: int | None = None,
        *,
        tp_group: dist.ProcessGroup | None,
        config: ModelParallelConfig,
    ):
        super().__init__()
        self.fc1 = column_linear(hidden, ffn, tp_group=tp_group, config=config)
        self.fc2 = row_linear(ffn, hidden if out is None else out, tp_group=tp_group, config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)[0]))[0]


class TPBlock(nn.Module):
    """Pre-norm transformer block on ``[s(/tp with SP), b, h]``; names match the reference."""

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
    ):
        super().__init__()
        sp = config.sequence_parallel
        self.ln1 = make_norm(hidden, eps, device=device, sequence_parallel=sp)
        self.attn = TPAttention(hidden, heads, tp_group=tp_group, config=config, core=core)
        self.ln2 = make_norm(hidden, eps, device=device, sequence_parallel=sp)
        self.mlp = TPMLP(hidden, ffn, tp_group=tp_group, config=config)

    def forward(self, x: torch.Tensor, **core_kwargs) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), **core_kwargs)
        return x + self.mlp(self.ln2(x))


def make_blocks(n: int, *args, **kwargs) -> nn.ModuleList:
    """``n`` :class:`TPBlock` s built with the same arguments (named like the reference's)."""
    return nn.ModuleList(TPBlock(*args, **kwargs) for _ in range(n))
