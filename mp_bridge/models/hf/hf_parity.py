"""Transformers' own LLaVA as the training oracle: :func:`train_transformers` and
:func:`compare_with_transformers`.

``train_transformers`` trains ``LlavaForConditionalGeneration.from_pretrained(path)``
(fp32, eager attention) in one process with Adam on the given global batches, cycled
over the steps, keeping the losses, the first step's gradients (by HF's
``named_parameters()`` name) and its ``pixel_values`` gradient. ``compare_with_transformers``
cuts our full tensors (``model.to_full()`` / ``gather_full_state``, our names) into HF
tensors by the name map and compares them with HF's, name by name.

Tolerances (the MIMO oracle tests', ``tests/functional/test_hf_llava_oracle.py``): loss
1e-5 relative; first-step gradients 1e-4 absolute (one backward: rounding only, measured
~1e-7); the pixel gradient 1e-4 relative; weights 1e-4 relative per tensor, or within
1% of one Adam step (``0.01 * lr``) absolute, as ``mp-bridge demo``'s weights (Adam turns
rounding in near-zero gradient elements into update differences). ``k_proj.bias`` is
held apart: softmax ignores a shift shared by all keys, so its true gradient is zero and
both runs hold rounding noise that Adam scales to steps of up to ``lr`` in arbitrary
directions; it is bounded by ``steps * lr``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.hf.hf_batch import hf_batch, pixel_patches
from mp_bridge.models.hf.hf_save import hf_tensors
from mp_bridge.models.hf.hf_synthetic import LlavaInputs
from mp_bridge.models.hf.name_map import disk_to_module, hf_mappings

__all__ = [
    "TransformersParity",
    "TransformersRun",
    "compare_with_transformers",
    "train_transformers",
]

LOSS_RTOL, GRAD_ATOL, INPUT_GRAD_RTOL, WEIGHT_RTOL, WEIGHT_STEP_FRACTION = (
    1e-5,
    1e-4,
    1e-4,
    1e-4,
    0.01,
)
ZERO_GRADIENT_SUFFIX = "k_proj.bias"  # true gradient zero: see the module


@dataclass
class TransformersRun:
    """What :func:`train_transformers` keeps: the trained model, its per-step losses, the
    first step's gradients by HF name, its ``pixel_values`` gradient and Adam's ``lr``."""

    model: torch.nn.Module
    losses: list[float]
    first_grads: dict[str, torch.Tensor]
    pixel_grad: torch.Tensor
    lr: float


def train_transformers(
    path: str, batches: Sequence[LlavaInputs], *, steps: int, lr: float
) -> TransformersRun:
    """``steps`` Adam steps of transformers' model from ``path`` on ``batches`` (cycled)."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    model.train()
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    losses, first, pixel_grad = [], {}, None
    for step in range(steps):
        ids, pixels, mask, labels = batches[step % len(batches)]
        pixels = pixels.clone().requires_grad_(step == 0)
        optim.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, pixel_values=pixels, attention_mask=mask, labels=labels).loss
        loss.backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            pixel_grad = pixels.grad.detach().clone()
        optim.step()
        losses.append(loss.item())
    return TransformersRun(model, losses, first, pixel_grad, lr)


@dataclass(frozen=True)
class TransformersParity:
    """Ours vs transformers: per row ``(max abs, max rel, worst HF name)``; ``rel`` is per
    tensor against its largest reference value (gradients: ``k_proj.bias`` left out of
    ``rel``, its reference is rounding noise). ``dist_losses`` / ``ref_losses`` /
    ``encoder`` / ``llm`` as :class:`~mp_bridge.models.ParityReport` (``plot_losses``)."""

    encoder: str
    llm: str
    dist_losses: list[float]
    ref_losses: list[float]
    lr: float
    loss: tuple[float, float]
    grads: tuple[float, float, str]
    input_grad: tuple[float, float]
    weights: tuple[float, float, str]
    zero_grad_weights: tuple[float, str]  # k_proj.bias: max abs, its name ("" when none)
    compared: int
    unmatched: list[str] = field(default_factory=list)  # HF gradients with no tensor of ours

    def checks(self) -> list[tuple[str, float, float, str, bool]]:
        """``(quantity, max abs, max rel, tolerance, ok)`` per row of the parity table."""
        steps, atol = len(self.ref_losses), WEIGHT_STEP_FRACTION * self.lr
        (la, lr_), (ga, gr, _), (ia, ir), (wa, wr, _) = (
            self.loss,
            self.grads,
            self.input_grad,
            self.weights,
        )
        za = self.zero_grad_weights[0]
        return [
            (f"loss ({steps} steps)", la, lr_, f"rel {LOSS_RTOL:.0e}", lr_ <= LOSS_RTOL),
            (f"param grads (step 1, {self.compared} HF tensors)", ga, gr,
             f"abs {GRAD_ATOL:.0e}", ga <= GRAD_ATOL and not self.unmatched),
            ("pixel_values grad (step 1)", ia, ir, f"rel {INPUT_GRAD_RTOL:.0e}",
             ir <= INPUT_GRAD_RTOL),
            ("weights (gathered)", wa, wr, f"rel {WEIGHT_RTOL:.0e} or abs {atol:.0e}",
             wr <= WEIGHT_RTOL or wa <= atol),
            (f"{ZERO_GRADIENT_SUFFIX} weights", za, float("nan"),
             f"abs {steps * self.lr:.0e} (steps x lr)", za <= steps * self.lr),
        ]  # fmt: skip

    def passed(self) -> bool:
        return all(row[-1] for row in self.checks())


def _as_hf(cfg: MimoConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full tensors (our names) as HF tensors by ``named_parameters()`` name."""
    out = {}
    for m in hf_mappings(cfg):
        if m.ours in ours:
            for key, t in zip(m.hf, hf_tensors(m, ours[m.ours])):
                out[disk_to_module(key)] = t
    if cfg.tie_embeddings and "model.language_model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.language_model.embed_tokens.weight"]
    return out


def _zero(name: str) -> bool:
    return name.endswith(ZERO_GRADIENT_SUFFIX)


def _worst(got: dict, want: dict, names) -> tuple[float, float, str]:
    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name in names:
        diff = float((got[name].float() - want[name].float()).abs().max())
        scale = float(want[name].abs().max())
        rel = diff / scale if scale > 0 else diff
        max_abs = max(max_abs, diff)
        if rel >= max_rel:
            max_rel, worst = rel, name
    return max_abs, max_rel, worst


def compare_with_transformers(
    cfg: MimoConfig,
    run: TransformersRun,
    *,
    losses: Sequence[float],
    first_grads: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
    input_grads: dict[int, torch.Tensor],
    first_batch: LlavaInputs,
    encoder_dp: int,
    encoder: str = "",
    llm: str = "",
) -> TransformersParity:
    """Compare our run (full first-step gradients and final weights by our names, the
    image-token gradient of each encoder DP rank at step 1) with ``run``."""
    if len(losses) != len(run.losses):
        raise ValueError(f"losses has {len(losses)} steps; transformers ran {len(run.losses)}")
    loss_abs = max(abs(a - b) for a, b in zip(losses, run.losses))
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, run.losses))
    grads = _as_hf(cfg, first_grads)
    unmatched = sorted(set(run.first_grads) - set(grads))
    both = sorted(set(run.first_grads) & set(grads))
    grad_abs = _worst(grads, run.first_grads, both)[0]  # rel: not of a zero true gradient
    _, grad_rel, worst_grad = _worst(grads, run.first_grads, [n for n in both if not _zero(n)])
    hf_params = {n: p.detach() for n, p in run.model.named_parameters()}
    mine = _as_hf(cfg, weights)
    names = sorted(set(mine) & set(hf_params))
    zero = [n for n in names if _zero(n)]
    weight_row = _worst(mine, hf_params, [n for n in names if n not in zero])
    zero_abs, _, zero_name = _worst(mine, hf_params, zero)
    ids, _, mask, labels = first_batch
    want = hf_batch(cfg, ids, run.pixel_grad, labels, mask)  # HF's gradient in our layout
    pixel_scale = float(pixel_patches(cfg, run.pixel_grad).abs().max())
    input_abs = 0.0
    for dp_rank, got in input_grads.items():
        shard = want.encoder_shard(dp_rank, encoder_dp)
        shard = shard.tokens if hasattr(shard, "tokens") else shard
        if shard.numel():
            input_abs = max(input_abs, float((got.float() - shard).abs().max()))
    input_rel = input_abs / pixel_scale if pixel_scale > 0 else input_abs
    return TransformersParity(
        encoder=encoder, llm=llm, dist_losses=list(losses), ref_losses=list(run.losses),
        lr=run.lr, loss=(loss_abs, loss_rel), grads=(grad_abs, grad_rel, worst_grad),
        input_grad=(input_abs, input_rel),
        weights=weight_row, zero_grad_weights=(zero_abs, zero_name), compared=len(both),
        unmatched=unmatched,
    )  # fmt: skip
