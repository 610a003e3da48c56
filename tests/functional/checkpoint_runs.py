"""Harness for the checkpoint tests: train the colocated MIMO model at one layout, save,
load at another, train on, and compare with the single-process oracle of the whole run.

Data: step ``i`` uses the seeded global batch ``synthetic_batch(CFG, 8, seed=100 + i)``
plus image noise drawn from the *global* generators (torch, python ``random``, numpy) at
that step. Every rank draws the same noise (same seeds, same draws), so the global batch
stays consistent across ranks, and a resume whose RNG states were not restored draws
other noise: the bitwise resume test sees it. Every rank records the noisy batches it used
so the oracle replays exactly them.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch
import torch.distributed as dist

from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.layers import gather_shard, shard_spec
from mp_bridge.models import (
    MimoConfig,
    ReferenceMimo,
    build_colocated_mimo,
    destroy_colocated_mimo,
    synthetic_batch,
)
from mp_bridge.testing import current_device

CFG = MimoConfig(llm_layers=4)  # one block per stage at pp = 4
LR = 1e-3
# Adam divides each gradient element by its own RMS + eps: an element that is zero in exact
# math but rounding noise (~1e-9) in fp32 moves by O(lr) at eps = 1e-8, differently in
# each summation order (run_parity says the same). eps = 1e-6 keeps such an element still
# (update ~1e-3 lr) and changes nothing else the comparison looks at.
EPS = 1e-6
# The oracle tolerances of test_models_oracle*.py (same fp32 math in another summation
# order: a few ulps on O(1) values; weights after Adam steps rel <= 1e-4).
LOSS_RTOL, WEIGHT_RTOL = 1e-5, 1e-4


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def noisy_batch(step: int):
    """Step ``step``'s global batch, with noise from the three global generators."""
    batch = synthetic_batch(CFG, 8, seed=100 + step)
    scale = 0.05 * (1 + random.random()) * (1 + float(np.random.rand()))
    images = batch.images + scale * torch.randn(batch.images.shape)
    return dataclasses.replace(batch, images=images)


@dataclasses.dataclass
class Run:
    """A colocated model at one layout, its Adam optimizer and grids."""

    model: object
    optimizer: torch.optim.Optimizer
    grids: tuple
    layout: dict
    used: list  # the noisy global batches of the steps this run took

    def step(self, step: int) -> float:
        batch = noisy_batch(step).to(current_device())
        self.used.append(batch)
        enc, llm = (GridLayout.from_grid(g) for g in self.grids)
        rank = dist.get_rank()
        images = batch.encoder_shard(enc.coords(rank)["dp"], enc.axis_size("dp"))
        text = batch.llm_shard(llm.coords(rank)["dp"], llm.axis_size("dp"))
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model.train_step(
            text.input_ids, text.labels, text.loss_mask, images, cu_seqlens=text.cu_seqlens
        )
        self.model.sync_gradients()
        self.optimizer.step()
        return loss.item()

    def full(self) -> dict[str, torch.Tensor]:
        """Every weight and Adam state tensor this rank holds, gathered over TP (padding
        dropped), keyed ``name`` / ``name:exp_avg`` / ``name:step``; CPU copies."""
        out = dict(self.model.to_full())
        for name, p in self.model.named_parameters():
            for key, value in self.optimizer.state.get(p, {}).items():
                full = value.clone() if value.dim() == 0 else gather_shard(value, shard_spec(p))
                out[f"{name}:{key}"] = full
        return {k: v.cpu() for k, v in out.items()}

    def destroy(self) -> None:
        destroy_colocated_mimo(self.model, *self.grids)


def build(layout: dict, *, seed: int) -> Run:
    """A model at ``layout`` (``encoder_tp/dp``, ``llm_tp/cp/pp/dp``, ``flow``,
    ``sequence_parallel``, ``microbatches``) from the reference seeded ``seed``."""
    torch.manual_seed(seed)
    reference = ReferenceMimo(CFG).to(current_device())
    size = dict(layout)
    options = {k: size.pop(k) for k in ("flow", "sequence_parallel", "microbatches") if k in size}
    pp = size.get("llm_pp", 1)
    enc = make_grid(tp=size.get("encoder_tp", 1), dp=size.get("encoder_dp", 1),
                    create=("tp", "dp"))  # fmt: skip
    llm = make_grid(
        tp=size.get("llm_tp", 1), cp=size.get("llm_cp", 1), pp=pp, dp=size.get("llm_dp", 1),
        create=("tp", "cp", "dp", ("dp", "cp"), *(("pp",) if pp > 1 else ())),
    )  # fmt: skip
    model = build_colocated_mimo(reference, enc, llm, device=current_device(), **options)
    return Run(model, torch.optim.Adam(model.parameters(), lr=LR, eps=EPS), (enc, llm), layout, [])


def oracle(batches: list, *, seed: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process run of the same steps: ``(losses, final state)``."""
    torch.manual_seed(seed)
    reference = ReferenceMimo(CFG).to(current_device())
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = reference(*batch.text, batch.images, cu_seqlens=batch.cu_seqlens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, reference.state_dict()


def max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Worst per-tensor ``max|got - want| / max|want|`` over the names both hold."""
    worst, name = 0.0, ""
    for key in sorted(set(got) & set(want)):
        scale = float(want[key].abs().max()) or 1.0
        rel = float((got[key].cpu().float() - want[key].cpu().float()).abs().max()) / scale
        if rel >= worst:
            worst, name = rel, key
    return worst, name


def unequal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names both hold whose tensors are not bitwise equal."""
    both = sorted(set(got) & set(want))
    return [k for k in both if not torch.equal(got[k].cpu(), want[k].cpu())]


def world_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
