"""Train the colocated MIMO model and its single-process reference on the same data; compare.

:func:`run_parity` runs on every rank of an initialized world (collective). It seeds one
:class:`ReferenceMimo`, shards its weights into a :class:`ColocatedMimoModel` on the two
requested grids, trains both with Adam on the same global batch, and reports:

- the global loss of every step (distributed vs single-process),
- the encoder input gradient (this rank's DP shard vs the reference's rows; max over ranks),
- every parameter's synced gradient of the first step, gathered to full (Adam's update
  is nearly blind to a gradient's scale, so a gradient summed twice shows only here),
- every parameter after the last step, gathered to full.

Both runs compute in fp32 on ``device``. The reference is run on every rank (it is tiny),
so every rank returns the same report.

Conditioning of the weight comparison (``rel`` per tensor, against its largest value): a
tensor that starts at zero (norm biases) holds only ~``steps * lr`` after a few steps,
and an element whose gradient is near Adam's ``eps`` (small batches) turns rounding into
an update difference of ~1e-2 ``lr``, so tiny batches at ``lr=1e-3`` can exceed 1e-4
there with correct code; the first-step gradient comparison stays sharp in that case.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from mp_bridge.checks import check_int
from mp_bridge.deprecations import warn_deprecated
from mp_bridge.grid import AXIS_NAMES, GridLayout, make_grid
from mp_bridge.models.colocated.build import build_colocated_mimo, destroy_colocated_mimo
from mp_bridge.models.colocated.parts import MimoFlow
from mp_bridge.models.data.batch import MimoBatch, synthetic_batch
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.parallel.sharding import gather_full_state
from mp_bridge.models.reference.model import ReferenceMimo

__all__ = ["ParityReport", "TrainHooks", "run_parity"]

StepHook = Callable[[int, float, float], None]  # (step, loss, seconds)


class TrainHooks(Protocol):
    """What :func:`run_parity` calls around its distributed loop (e.g. checkpoints).

    ``resume(model, optimizer) -> (k, losses)``: before the first step (collective);
    ``k`` steps are already done (their ``losses``), the loop runs steps ``k..steps-1``.
    ``after_step(step, model, optimizer, losses)``: after each step (collective), with
    the losses of steps ``0..step``.
    """

    def resume(self, model, optimizer) -> tuple[int, list[float]]: ...

    def after_step(self, step: int, model, optimizer, losses: list[float]) -> None: ...


@dataclass(frozen=True)
class ParityReport:
    """Distributed-vs-reference differences (``rel`` = ``abs / max|reference|``)."""

    encoder: str
    llm: str
    dist_losses: list[float]
    ref_losses: list[float]
    loss_max_abs: float
    loss_max_rel: float
    input_grad_max_abs: float
    input_grad_max_rel: float
    weight_max_abs: float
    weight_max_rel: float
    worst_weight: str
    param_grad_max_abs: float
    param_grad_max_rel: float
    worst_param_grad: str
    step_seconds: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    first_step: int = 0  # the step (0-based) whose parameter gradients were compared

    def passed(
        self,
        *,
        loss_rtol: float = 1e-5,
        weight_rtol: float = 1e-4,
        grad_rtol: float = 1e-5,
        weight_atol: float = 0.0,
    ) -> bool:
        """Every difference within its tolerance.

        ``grad_rtol`` bounds the first step's parameter gradients (one backward: rounding
        only). The encoder input gradient is compared at every step, after the weights
        have moved, so it shares ``weight_rtol``. Weights pass within ``weight_rtol`` or
        ``weight_atol``: Adam divides each gradient element by its own RMS, so a
        rounding-level difference in a near-zero gradient element can move that one weight
        by up to ~lr per step, which over many steps can exceed a relative bound while
        the losses and first-step gradients (which a wiring error moves) still agree.
        """
        weights_ok = self.weight_max_rel <= weight_rtol or self.weight_max_abs <= weight_atol
        return (
            self.loss_max_rel <= loss_rtol
            and weights_ok
            and self.input_grad_max_rel <= weight_rtol
            and self.param_grad_max_rel <= self.grad_tolerance(grad_rtol, weight_rtol)
        )

    def grad_tolerance(self, grad_rtol: float, weight_rtol: float) -> float:
        """``grad_rtol`` for step 1's gradients; ``weight_rtol`` for a resumed run's first
        step (after ``first_step`` Adam steps the weights differ by rounding already)."""
        return grad_rtol if self.first_step == 0 else weight_rtol


def _layout_str(**sizes: int) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "single"


def _rel(diff: float, scale: float) -> float:
    return diff / scale if scale > 0 else diff


def _compare_state(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> tuple[float, float, str]:
    """``(max abs, max per-tensor rel, name of the worst tensor)`` over ``want``'s names
    (a pipelined LLM's rank holds its own stage's LLM names only: those of ``got``)."""
    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name, ref in want.items():
        if name.startswith("llm.") and name not in got:
            continue
        diff = float((got[name] - ref).abs().max())
        rel = _rel(diff, float(ref.abs().max()))
        max_abs = max(max_abs, diff)
        if rel >= max_rel:
            max_rel, worst = rel, name
    return max_abs, max_rel, worst


def _with_grad(images):
    """``(x, images)``: a ``requires_grad`` copy of the image tokens, and images over it."""
    if isinstance(images, RaggedImages):
        x = images.tokens.clone().requires_grad_(True)
        return x, images.with_tokens(x)
    x = images.clone().requires_grad_(True)
    return x, x


def _encoder_rows(batch: MimoBatch, dp_rank: int, dp_size: int) -> slice:
    """Rows of the global image input held by encoder DP rank ``dp_rank``."""
    if batch.ragged:
        return batch.images.token_slice(dp_rank, dp_size)
    n = batch.batch_size // dp_size
    return slice(dp_rank * n, (dp_rank + 1) * n)


def _renamed(old: str, value: Sequence[str] | None, new_value: Sequence[str]):
    """``new_value``, or ``value`` given under the deprecated keyword ``old`` (warns)."""
    if value is None:
        return new_value
    new = old.replace("dim_names", "axis_names")
    if tuple(new_value) != AXIS_NAMES:
        raise ValueError(f"pass either {new}= or its deprecated name {old}=, not both")
    warn_deprecated(f"mp_bridge.models.run_parity({old}=...)", stacklevel=4)
    return value


def run_parity(
    cfg: MimoConfig,
    *,
    encoder_tp: int,
    encoder_dp: int,
    llm_tp: int = 1,
    llm_cp: int = 1,
    llm_dp: int = 1,
    llm_pp: int = 1,
    microbatches: int = 1,
    encoder_axis_names: Sequence[str] = AXIS_NAMES,
    llm_axis_names: Sequence[str] = AXIS_NAMES,
    sequence_parallel: bool = False,
    fused_loss: bool = False,
    batch: MimoBatch | Sequence[MimoBatch] | None = None,
    batch_size: int = 8,
    steps: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    device: torch.device | None = None,
    on_step: StepHook | None = None,
    flow: str | MimoFlow = "gather",
    balance: bool = False,
    cp_comm: str = "all_gather",
    encoder_dim_names: Sequence[str] | None = None,
    llm_dim_names: Sequence[str] | None = None,
    hooks: TrainHooks | None = None,
) -> ParityReport:
    """Train both models for ``steps`` Adam steps and compare (collective on every rank).

    ``batch``: one global batch used at every step, or a list cycled over the steps
    (default: one seeded :func:`synthetic_batch` of ``batch_size`` samples); uniform or
    ragged (:class:`RaggedImages`: the encoder input gradient is then per token), plain
    or packed (``synthetic_batch(..., doc_lengths=...)``: each LLM DP rank gets its
    documents by :meth:`MimoBatch.llm_shard` and both models get ``cu_seqlens``). Grids are
    built and destroyed here (``make_grid`` with ``encoder_axis_names`` / ``llm_axis_names``,
    default ``tp, cp, pp, dp``; the two orders must nest, see ``plan_bridge``) and
    each must cover the whole world, so many layouts can run one after another in one
    world. ``on_step(step, loss, seconds)`` is called after every distributed step (e.g.
    for progress lines). ``flow``: the colocated model's step, ``"gather"`` or
    ``"routed"``; ``balance``: balanced encoders (see :class:`ColocatedMimoModel`);
    ``cp_comm``: the LLM attention's K/V movement over CP (``context_parallel_attention``).
    ``llm_pp > 1``: the LLM runs in pipeline stages over ``microbatches`` (``train_step``);
    each rank compares its own stage's LLM weights and gradients, the worst over the world
    is reported. ``hooks``: a :class:`TrainHooks` (a run resumed at step ``k`` compares the
    whole curve, its first gradients at step ``k``, and the encoder input gradients from ``k``).
    """
    check_int("steps", steps, low=1)
    encoder_axis_names = _renamed("encoder_dim_names", encoder_dim_names, encoder_axis_names)
    llm_axis_names = _renamed("llm_dim_names", llm_dim_names, llm_axis_names)
    world = dist.get_world_size()
    for side, sizes in (
        ("encoder", (encoder_tp, encoder_dp)),
        ("llm", (llm_tp, llm_cp, llm_pp, llm_dp)),
    ):
        if math.prod(sizes) != world:
            raise ValueError(
                f"run_parity lays each model over the whole world: {side} sizes {sizes} "
                f"cover {math.prod(sizes)} ranks but the world has {world}; make them "
                f"multiply to {world}"
            )
    device = device or torch.device("cpu")
    torch.manual_seed(seed)
    reference = ReferenceMimo(cfg).to(device)
    if batch is None:
        batch = synthetic_batch(cfg, batch_size, seed=seed + 1)
    pool = [b.to(device) for b in ([batch] if isinstance(batch, MimoBatch) else batch)]
    if not pool:
        raise ValueError("batch is an empty sequence; pass at least one MimoBatch")
    init_state = {k: v.clone() for k, v in reference.state_dict().items()}

    enc_grid = make_grid(
        tp=encoder_tp, dp=encoder_dp, axis_names=encoder_axis_names, create=("tp", "dp")
    )
    llm_grid = make_grid(
        tp=llm_tp, cp=llm_cp, pp=llm_pp, dp=llm_dp, axis_names=llm_axis_names,
        create=("tp", "cp", "dp", ("dp", "cp"), *(("pp",) if llm_pp > 1 else ())),
    )  # fmt: skip
    model = build_colocated_mimo(
        reference, enc_grid, llm_grid, sequence_parallel=sequence_parallel,
        fused_loss=fused_loss, device=device, flow=flow, microbatches=microbatches,
        balance=balance, cp_comm=cp_comm,
    )  # fmt: skip
    try:
        rank = dist.get_rank()
        enc_dp_rank = GridLayout.from_grid(enc_grid).coords(rank)["dp"]
        llm_dp_rank = GridLayout.from_grid(llm_grid).coords(rank)["dp"]
        local = [
            (b.encoder_shard(enc_dp_rank, encoder_dp), b.llm_shard(llm_dp_rank, llm_dp))
            for b in pool
        ]
        optim = torch.optim.Adam(model.parameters(), lr=lr)
        first, dist_losses = hooks.resume(model, optim) if hooks else (0, [])
        if not 0 <= first < steps or len(dist_losses) != first:
            raise ValueError(
                f"hooks.resume gave step {first} with {len(dist_losses)} losses; a run of "
                f"steps={steps} resumes at a step in [0, {steps}) with one loss per step done"
            )
        dist_losses, dist_grads, seconds = list(dist_losses), [], []
        for step in range(first, steps):
            start = time.perf_counter()
            optim.zero_grad(set_to_none=True)
            images, text = local[step % len(local)]
            x, images = _with_grad(images)
            loss = model.train_step(
                text.input_ids, text.labels, text.loss_mask, images, cu_seqlens=text.cu_seqlens
            )
            model.sync_gradients()
            optim.step()
            seconds.append(time.perf_counter() - start)
            dist_losses.append(loss.item())
            dist_grads.append(x.grad.detach().clone())
            if step == first:  # synced gradients, before Adam's normalization hides their scale
                first_grads = gather_full_state(model, grads=True)
            if on_step is not None:
                on_step(step, dist_losses[-1], seconds[-1])
            if hooks is not None:
                hooks.after_step(step, model, optim, dist_losses)
        full = model.to_full()
    finally:
        destroy_colocated_mimo(model, enc_grid, llm_grid)

    reference.load_state_dict(init_state)
    ref_optim = torch.optim.Adam(reference.parameters(), lr=lr)
    ref_losses, grad_abs, grad_scale = [], 0.0, 0.0
    for step in range(steps):
        batch = pool[step % len(pool)]
        ref_optim.zero_grad(set_to_none=True)
        x, images = _with_grad(batch.images)
        loss = reference(*batch.text, images, cu_seqlens=batch.cu_seqlens)
        loss.backward()
        if step == first:
            ref_grads = {
                k: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                for k, p in reference.named_parameters()
            }
        ref_optim.step()
        ref_losses.append(loss.item())
        if step < first:  # before the resume: this run has no input gradient for it
            continue
        mine = x.grad[_encoder_rows(batch, enc_dp_rank, encoder_dp)]
        diff = (dist_grads[step - first] - mine).abs()
        grad_abs = max(grad_abs, float(diff.max()) if diff.numel() else 0.0)  # ragged: T may be 0
        grad_scale = max(grad_scale, float(x.grad.abs().max()))
    # The input-gradient difference is per rank: take the worst over the world.
    worst = torch.tensor([grad_abs], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    grad_abs = float(worst)

    loss_abs = max(abs(a - b) for a, b in zip(dist_losses, ref_losses))
    loss_rel = max(_rel(abs(a - b), abs(b)) for a, b in zip(dist_losses, ref_losses))
    weight_abs, weight_rel, worst_name = _compare_state(full, reference.state_dict())
    pgrad_abs, pgrad_rel, worst_pgrad = _compare_state(first_grads, ref_grads)
    if llm_pp > 1:  # each rank compared its own stage: the worst over the world
        worst = torch.tensor(
            [weight_abs, weight_rel, pgrad_abs, pgrad_rel], dtype=torch.float64, device=device
        )
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        weight_abs, weight_rel, pgrad_abs, pgrad_rel = worst.tolist()
    return ParityReport(
        encoder=_layout_str(tp=encoder_tp, dp=encoder_dp),
        llm=_layout_str(tp=llm_tp, cp=llm_cp, pp=llm_pp, dp=llm_dp)
        + (f",M={microbatches}" if microbatches > 1 else "")
        + (",sp" if sequence_parallel else "")
        + (",fused" if fused_loss else ""),
        dist_losses=dist_losses,
        ref_losses=ref_losses,
        loss_max_abs=loss_abs,
        loss_max_rel=loss_rel,
        input_grad_max_abs=grad_abs,
        input_grad_max_rel=_rel(grad_abs, grad_scale),
        weight_max_abs=weight_abs,
        weight_max_rel=weight_rel,
        worst_weight=worst_name,
        param_grad_max_abs=pgrad_abs,
        param_grad_max_rel=pgrad_rel,
        worst_param_grad=worst_pgrad,
        step_seconds=seconds,
        tokens_per_step=pool[0].input_ids.numel(),
        first_step=first,
    )
