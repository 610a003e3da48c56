"""Run a :class:`TPLLMStage` under ``torch.distributed.pipelining`` over M microbatches.

Schedule: ``Schedule1F1B`` (``ScheduleGPipe`` when ``M < n_stages``, which 1F1B
refuses), with ``scale_grads=False``: each microbatch's loss is already divided by the
global token count of the whole step, so the step's loss is the sum over microbatches
and DP x CP ranks, exactly the single-process masked mean. Chosen over megatron-core's
``forward_backward_pipelining_without_interleaving`` because that one allocates its
p2p buffers with ``device="cuda"`` (no CPU/gloo run) and its process-group arguments
differ between megatron-core 0.16 and 0.19; torch's runs unmodified on CPU/gloo and
NCCL, with the pipeline group passed explicitly.

Data: a stage's module sees only activations, so the microbatch index travels with
them: stage 0's pipeline input is ``arange(M)`` (chunk ``m`` is ``[m]``), every stage
passes ``(hidden [s, b, h], index [1])`` on, and each stage looks up its own per-microbatch
data by the index: ``inputs(m)`` (stage 0: the partitioned input embeddings, e.g. token
embeddings with image rows placed, leaves whose gradient arrives through the schedule's
backward), ``position_ids[m]`` / ``cu_seqlens[m]`` (every stage), ``labels[m]`` /
``loss_mask[m]`` (last stage only).

Shapes are static per stage object (the send/recv buffers are allocated once): every
microbatch must have the same ``position_ids`` shape; packed text is padded to a common
capacity first (:mod:`mp_bridge.models.parallel.pipeline_capacity`). A fresh
``PipelineStage`` is built per step, so shapes may change from one step to the next.

Collectives per step: one agreement check over ``pp_group``; last stage: one all-reduce
of the token count over ``loss_group``; the schedule's p2p sends/receives over
``pp_group``; the stages' own TP/CP collectives; then the loss is all-reduced over
``loss_group`` (last stage) and broadcast over ``pp_group``. Parameter gradients are
partial over DP x CP (and TP for SP norms), as without PP: the caller syncs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from mp_bridge.checks import agree, check_choice, check_group, check_int
from mp_bridge.comm import group_size
from mp_bridge.models.parallel.llm_stages import TPLLMStage

__all__ = ["LLMPipeline", "PipelineStepSpec"]

SCHEDULES = ("auto", "1f1b", "gpipe")


@dataclass(frozen=True)
class PipelineStepSpec:
    """What the stages of one pipeline must agree on before a step."""

    n_microbatches: int
    n_stages: int
    schedule: str
    activation_shape: tuple[int, ...]
    position_shape: tuple[int, ...]
    packed: bool
    dtype: str

    def fields(self) -> Mapping[str, object]:
        return dict(self.__dict__)


class _StageCall(nn.Module):
    """The module a ``PipelineStage`` runs: ``(index)`` or ``(hidden, index)`` ->
    ``(hidden, index)``, or on the last stage this microbatch's loss ``[1]``."""

    def __init__(self, stage: TPLLMStage, step: dict):
        super().__init__()
        self.stage, self.step = stage, step

    def forward(self, *args: torch.Tensor):
        if self.stage.is_first:
            (index,) = args
            m = int(index.reshape(-1)[0])
            x = self.step["inputs"](m).transpose(0, 1)  # [b, s, h] -> [s, b, h]
        else:
            x, index = args
            m = int(index.reshape(-1)[0])
        cu = self.step["cu_seqlens"][m]
        x = self.stage.run_blocks(x, self.step["position_ids"][m], cu_seqlens=cu)
        if not self.stage.is_last:
            return x.contiguous(), index
        labels, mask = self.step["labels"][m], self.step["loss_mask"][m]
        per_token = self.stage.token_loss(x, labels)  # [b, s_local] fp32
        mask = mask.to(torch.float32)
        # masked-out tokens contribute exactly 0, even if their loss is not finite
        picked = torch.where(mask != 0, per_token * mask, torch.zeros_like(per_token))
        return (picked.sum() / self.step["count"]).reshape(1)


class LLMPipeline:
    """One rank's stage of a pipelined LLM; :meth:`step` runs forward and backward.

    ``pp_group``: this rank's pipeline group (stage ``p`` = group rank ``p``, e.g.
    ``grid.get_pg("pp")``); ``loss_group``: the group the tokens are spread over (the
    LLM's DP x CP group, e.g. ``grid.get_pg(["dp", "cp"])``), used by the last stage for
    the global token count and the reported loss. ``schedule``: ``"auto"`` (1F1B, or
    GPipe when ``M < n_stages``), ``"1f1b"`` or ``"gpipe"``.
    """

    def __init__(
        self,
        stage: TPLLMStage,
        *,
        pp_group: dist.ProcessGroup | None,
        loss_group: dist.ProcessGroup | None = None,
        schedule: str = "auto",
    ):
        if not isinstance(stage, TPLLMStage):
            raise TypeError(f"stage must be a TPLLMStage, got {type(stage).__name__}")
        check_group("pp_group", pp_group)
        check_group("loss_group", loss_group)
        check_choice("schedule", schedule, SCHEDULES)
        n = group_size(pp_group)
        if n != stage.n_stages or (pp_group is not None and dist.get_rank(pp_group) != stage.stage):
            rank = dist.get_rank(pp_group) if pp_group is not None else 0
            raise ValueError(
                f"stage {stage.stage} of {stage.n_stages} does not match pp_group (rank "
                f"{rank} of {n}); build TPLLMStage(stage=pp rank, n_stages=pp size)"
            )
        self.stage, self.pp_group, self.loss_group = stage, pp_group, loss_group
        self.schedule = schedule

    def _schedule_cls(self, m: int):
        if self.schedule == "gpipe" or (self.schedule == "auto" and m < self.stage.n_stages):
            return ScheduleGPipe
        if m < self.stage.n_stages:
            raise ValueError(
                f"schedule='1f1b' needs n_microbatches >= {self.stage.n_stages} stages, got "
                f"{m}; use schedule='gpipe' or 'auto', or more microbatches"
            )
        return Schedule1F1B

    def step(
        self,
        n_microbatches: int,
        *,
        position_ids: Sequence[torch.Tensor],
        cu_seqlens: Sequence[torch.Tensor | None] | None = None,
        inputs: Callable[[int], torch.Tensor] | None = None,
        labels: Sequence[torch.Tensor] | None = None,
        loss_mask: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of ``n_microbatches`` microbatches; returns the step's
        loss (fp32 scalar, detached) on every rank of ``pp_group``.

        Per microbatch ``m`` (lists of ``M`` entries): ``position_ids[m]`` CP-local
        original positions ``[b, s_local]`` (packed: ``[s_local]`` with ``cu_seqlens[m]``
        the padded global bounds), on every stage; stage 0: ``inputs(m)`` the
        partitioned embeddings ``[b, s_local(/tp with SP), h]``; last stage:
        ``labels[m]``, ``loss_mask[m]`` CP-local with ``position_ids[m]``'s shape.
        """
        st = self.stage
        device = next(st.parameters()).device
        try:  # every stage's own input error reaches every stage (agree), never a hang
            spec, step = self._parse(
                n_microbatches, position_ids, cu_seqlens, inputs, labels, loss_mask
            )
            error = None
        except (TypeError, ValueError) as exc:
            spec, step, error = None, None, exc
        if self.pp_group is not None:
            rejected = PipelineStepSpec(0, st.n_stages, self.schedule, (), (), False, "")
            agree("LLMPipeline.step", self.pp_group, spec or rejected, device=device, error=error)
        if error is not None:
            raise error
        if st.is_last:
            count = sum(t.to(torch.float32).sum() for t in step["loss_mask"]).reshape(1)
            if self.loss_group is not None and group_size(self.loss_group) > 1:
                dist.all_reduce(count, group=self.loss_group)
            step["count"] = count.clamp(min=1.0)
        return self._run(step, spec, device)

    def _parse(self, n_microbatches, position_ids, cu_seqlens, inputs, labels, loss_mask):
        """``(spec, step data)``, or ``ValueError``/``TypeError`` naming the argument."""
        st = self.stage
        m = check_int("n_microbatches", n_microbatches, low=1)
        pos = list(self._check_list("position_ids", position_ids, m))
        cu = (
            [None] * m
            if cu_seqlens is None
            else list(self._check_list("cu_seqlens", cu_seqlens, m))
        )
        packed = pos[0].dim() == 1
        pos = [p.reshape(1, -1) if packed else p for p in pos]
        shapes = {tuple(p.shape) for p in pos}
        if len(shapes) > 1:
            raise ValueError(
                f"position_ids have shapes {sorted(shapes)} across microbatches; a pipeline "
                f"stage's buffers are static: pad every microbatch to one capacity "
                f"(pipeline_capacity.pad_packed_to)"
            )
        step = {"inputs": inputs, "position_ids": pos, "cu_seqlens": cu, "count": None}
        if st.is_first and not callable(inputs):
            raise ValueError(f"stage 0 needs inputs=callable(m) -> embeddings, got {inputs!r}")
        if st.is_last:
            for name, values in (("labels", labels), ("loss_mask", loss_mask)):
                values = [
                    t.reshape(1, -1) if packed else t for t in self._check_list(name, values, m)
                ]
                bad = [i for i, t in enumerate(values) if tuple(t.shape) != tuple(pos[i].shape)]
                if bad:
                    raise ValueError(
                        f"{name}[{bad[0]}] has shape {tuple(values[bad[0]].shape)} but its "
                        f"position_ids {tuple(pos[bad[0]].shape)}; pass the CP-local tensors "
                        f"of the same shard"
                    )
                step[name] = values
        b, s = pos[0].shape
        s_act = s // group_size(st.tp_group) if st.sequence_parallel else s
        spec = PipelineStepSpec(
            n_microbatches=m, n_stages=st.n_stages, schedule=self.schedule,
            activation_shape=(s_act, b, st.cfg.llm_hidden), position_shape=(b, s),
            packed=packed, dtype=str(next(st.parameters()).dtype),
        )  # fmt: skip
        return spec, step

    @staticmethod
    def _check_list(name: str, value, m: int) -> Sequence:
        if not isinstance(value, Sequence) or len(value) != m:
            got = f"{len(value)} entries" if isinstance(value, Sequence) else repr(value)
            raise ValueError(f"{name} must be a list of {m} microbatch entries, got {got}")
        return value

    def _run(self, step: dict, spec: PipelineStepSpec, device) -> torch.Tensor:
        st, m = self.stage, spec.n_microbatches
        dtype = next(st.parameters()).dtype
        index = torch.zeros(1, dtype=torch.long, device=device)
        # requires_grad in the examples: the receive buffers are made from their metadata,
        # and a buffer without it gets no gradient to send back.
        hidden = torch.zeros(spec.activation_shape, dtype=dtype, device=device)
        hidden.requires_grad_(True)
        in_args = (index,) if st.is_first else (hidden, index)
        out_args = (
            torch.zeros(1, dtype=torch.float32, device=device) if st.is_last else (hidden, index)
        )
        if self.pp_group is None:  # one stage: no pipeline, run the microbatches in turn
            return self._run_local(step, m, device)
        pipe = PipelineStage(
            _StageCall(st, step), st.stage, st.n_stages, device,
            input_args=in_args, output_args=out_args, group=self.pp_group,
        )  # fmt: skip
        schedule = self._schedule_cls(m)(
            pipe, n_microbatches=m, loss_fn=lambda out, _target: out.sum(), scale_grads=False
        )
        losses: list[torch.Tensor] = []
        arange = torch.arange(m, device=device)
        args = (arange,) if st.is_first else ()
        schedule.step(*args, target=arange if st.is_last else None, losses=losses)
        total = torch.zeros(1, dtype=torch.float32, device=device)
        if st.is_last:
            total = torch.stack([x.detach().reshape(()) for x in losses]).sum().reshape(1)
            if self.loss_group is not None and group_size(self.loss_group) > 1:
                dist.all_reduce(total, group=self.loss_group)
        last = dist.get_global_rank(self.pp_group, st.n_stages - 1)
        dist.broadcast(total, src=last, group=self.pp_group)
        return total.reshape(())

    def _run_local(self, step: dict, m: int, device) -> torch.Tensor:
        call = _StageCall(self.stage, step)
        out = torch.zeros(1, dtype=torch.float32, device=device)
        for i in range(m):
            loss = call(torch.tensor([i], device=device)).sum()
            loss.backward()
            out += loss.detach()
        if self.loss_group is not None and group_size(self.loss_group) > 1:
            dist.all_reduce(out, group=self.loss_group)
        return out.reshape(())
