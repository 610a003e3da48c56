"""One packed colocated step parses ``cu_seqlens`` once.

The one parse of cumulative lengths is :func:`mp_bridge.comm.normalize_cu_seqlens`; every
module that imports it is patched with a counting wrapper, then one packed step runs on
one process (``MimoGroups.local()``, two attention layers or more) in each flow. The door
(``parse_step_inputs``) parses the raw ``cu_seqlens`` once; ``PartitionAdapter.shard`` pads
the parsed documents, ``route`` takes ``ShardedBatch.layout``, and every attention layer
reuses that layout (and its cached mask), so nothing else parses.
"""

from __future__ import annotations

import sys

import pytest
import torch

import mp_bridge.comm.sequence.cut as cut
from mp_bridge.models import (
    ColocatedMimoModel,
    MimoConfig,
    MimoGroups,
    ReferenceMimo,
    synthetic_batch,
)

CFG = MimoConfig()


@pytest.fixture
def parses(monkeypatch):
    """A list that grows by one per ``normalize_cu_seqlens`` call, wherever it is bound."""
    calls: list[int] = []
    original = cut.normalize_cu_seqlens

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mp_bridge")
            and getattr(module, "normalize_cu_seqlens", None) is original
        ):
            monkeypatch.setattr(module, "normalize_cu_seqlens", counting)
    return calls


@pytest.mark.parametrize("flow", ["gather", "routed"])
@pytest.mark.parametrize("ragged", [False, True])
def test_one_packed_step_parses_cu_seqlens_once(parses, flow, ragged):
    assert CFG.llm_layers >= 2  # a per-layer parse would show as more than one
    torch.manual_seed(0)
    model = ColocatedMimoModel.from_groups(ReferenceMimo(CFG), MimoGroups.local(), flow=flow)
    batch = synthetic_batch(
        CFG, 4, seed=2, images_per_sample=(0, 2) if ragged else None, text_only=[1],
        doc_lengths=[9, 5, 12, 11],
    )  # fmt: skip
    assert batch.packed
    parses.clear()  # building the batch is not the step
    loss = model(
        batch.input_ids, batch.labels, batch.loss_mask, batch.images, cu_seqlens=batch.cu_seqlens
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert len(parses) == 1
