"""The library itself uses no deprecated spelling: a single-process path through the public
API runs under ``warnings.simplefilter("error", DeprecationWarning)``, so any internal use
of an old name (``GridLayout.dim``, ``.dim_names``, ``cp_factor``, ...) raises here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mp_bridge.comm import (
    PartitionAdapter,
    cp_gather_order,
    cp_shard_indices_packed,
    pad_layout,
    plan_bridge,
    seq_len_divisor,
)
from mp_bridge.grid import GridLayout
from mp_bridge.models import (
    ColocatedMimoModel,
    MimoConfig,
    MimoGroups,
    ReferenceMimo,
    synthetic_batch,
)


@pytest.fixture
def strict():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        yield


def test_grid_and_sequence_paths_warn_nothing(strict):
    layout = GridLayout((2, 2, 2), ("tp", "cp", "dp"))
    assert layout.axis_size("cp") == 2 and layout.axis_size("pp") == 1
    assert layout.axis_names == ("tp", "cp", "dp")
    assert layout.groups(["cp"])[0] == [0, 2]
    assert GridLayout.from_grid(layout) == layout
    assert seq_len_divisor(2) == 4
    assert cp_shard_indices_packed([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    assert cp_gather_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert pad_layout(5, 2, cu_seqlens=[0, 3, 5]).padded_bounds == (0, 4, 8)
    shard = PartitionAdapter().shard(
        torch.randn(1, 5, 3), labels=torch.arange(5)[None], cu_seqlens=[0, 3, 5]
    )
    assert shard.layout.padded_bounds == (0, 3, 5)


def test_plan_bridge_warns_nothing(strict):
    plan = plan_bridge(GridLayout((2, 4), ("tp", "dp")), GridLayout((2, 2, 2), ("tp", "cp", "dp")))
    assert plan.scale == 2
    assert "FAN_IN" in plan.describe()


@pytest.mark.parametrize("flow", ["gather", "routed"])
def test_one_process_model_step_warns_nothing(strict, flow):
    cfg = MimoConfig()
    torch.manual_seed(0)
    model = ColocatedMimoModel.from_groups(ReferenceMimo(cfg), MimoGroups.local(), flow=flow)
    batch = synthetic_batch(cfg, 2, seed=1, doc_lengths=[9, 11])
    loss = model(
        batch.input_ids, batch.labels, batch.loss_mask, batch.images, cu_seqlens=batch.cu_seqlens
    )
    loss.backward()
    assert torch.isfinite(loss)
