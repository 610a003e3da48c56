"""``make_mimo_groups``: the one step that builds a colocated model's groups, on 4 ranks.

Expected members are hand-written from the grid formula ``rank = tp + TP * (cp + CP *
dp)`` (``make_grid``'s default order ``tp, cp, pp, dp``), not computed by the library.
Group counts use torch's registry of this rank's live groups, so "creates nothing" and
"destroy mirrors creation" are checked on the process-group objects themselves.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter
from mp_bridge.grid import GridLayout, destroy_grid, make_grid
from mp_bridge.models import (
    TPLLM,
    ColocatedMimoModel,
    MimoConfig,
    MimoGroups,
    ReferenceMimo,
    TPEncoder,
    TPProjection,
    make_mimo_groups,
)
from mp_bridge.testing import DistributedWorld, current_device

world = DistributedWorld(4, timeout_s=120)
CFG = MimoConfig()
FIELDS = ("encoder_tp", "encoder_dp", "llm_tp", "llm_cp", "llm_dp_cp")


def _live_groups() -> int:
    return len(c10d._world.pg_map)


def _members(groups: MimoGroups) -> dict[str, list[int]]:
    rank = dist.get_rank()
    out = {}
    for name in FIELDS:
        pg = getattr(groups, name)
        out[name] = [rank] if pg is None else sorted(dist.get_process_group_ranks(pg))
    return out


# encoder tp=2 x dp=2 (rank = tp + 2 dp); LLM tp=2 x cp=2 (rank = tp + 2 cp).
TP2_DP2__TP2_CP2 = {
    0: dict(encoder_tp=[0, 1], encoder_dp=[0, 2], llm_tp=[0, 1], llm_cp=[0, 2], llm_dp_cp=[0, 2]),
    1: dict(encoder_tp=[0, 1], encoder_dp=[1, 3], llm_tp=[0, 1], llm_cp=[1, 3], llm_dp_cp=[1, 3]),
    2: dict(encoder_tp=[2, 3], encoder_dp=[0, 2], llm_tp=[2, 3], llm_cp=[0, 2], llm_dp_cp=[0, 2]),
    3: dict(encoder_tp=[2, 3], encoder_dp=[1, 3], llm_tp=[2, 3], llm_cp=[1, 3], llm_dp_cp=[1, 3]),
}
# encoder dp=4; LLM cp=2 x dp=2 (rank = cp + 2 dp).
ALL = [0, 1, 2, 3]
DP4__CP2_DP2 = {
    r: dict(encoder_tp=[r], encoder_dp=ALL, llm_tp=[r], llm_cp=cp, llm_dp_cp=ALL)
    for r, cp in ((0, [0, 1]), (1, [0, 1]), (2, [2, 3]), (3, [2, 3]))
}


#: The deprecated constructor form's warning (its row of mp_bridge.deprecations).
LEGACY_FORM = r"ColocatedMimoModel\(encoder, projection, llm, bridge, partition\) is deprecated"


@world.case
def test_groups_created_on_bare_grids_hold_the_hand_written_ranks_and_destroy_frees_all():
    before = _live_groups()
    enc, llm = make_grid(dp=4, create=()), make_grid(cp=2, dp=2, create=())
    groups = make_mimo_groups(enc, llm)
    assert _members(groups) == DP4__CP2_DP2[dist.get_rank()]
    # The bridge took the grid's CP group instead of building its own.
    assert groups.bridge.cp_group is groups.llm_cp is llm.get_pg("cp")
    # 5 axis groups (tp, dp on the encoder; tp, cp, dp-cp on the LLM) + 1 gather group
    # (FAN_IN 4 -> 2: this rank's pair).
    assert _live_groups() == before + 6
    groups.destroy()
    assert _live_groups() == before
    with pytest.raises(KeyError):
        llm.get_pg("cp")
    groups.destroy()  # idempotent


@world.case
def test_groups_the_grids_hold_are_reused():
    enc = make_grid(tp=2, dp=2, create=("tp", "dp"))
    llm = make_grid(tp=2, cp=2, create=("tp", "cp", ("dp", "cp")))
    before = _live_groups()
    groups = make_mimo_groups(enc, llm)
    assert _members(groups) == TP2_DP2__TP2_CP2[dist.get_rank()]
    assert groups.encoder_dp is enc.get_pg("dp") and groups.llm_dp_cp is llm.get_pg(["dp", "cp"])
    # only the bridge's gather group (FAN_IN 2 -> 1): the route group is made on the first
    # route (the routed flow's first step), so a gather-flow model never pays for it
    assert _live_groups() == before + 1
    groups.bridge.prepare_route()  # the route group (the LLM replica), once
    groups.bridge.prepare_route()
    assert _live_groups() == before + 2
    groups.destroy()


@world.case
def test_bridge_puts_a_missing_cp_group_on_the_grid():
    enc, llm = make_grid(dp=4, create=()), make_grid(cp=2, dp=2, create=("dp",))
    bridge = ColocatedBridgeCommunicator(enc, llm)
    # cp=2, dp=2 on 4 ranks, cp fastest: CP groups [0, 1] and [2, 3]
    want = [0, 1] if dist.get_rank() < 2 else [2, 3]
    assert dist.get_process_group_ranks(llm.get_pg("cp")) == want
    before = _live_groups()
    bridge.destroy()  # frees its gather group only; the CP group stays the grid's
    assert _live_groups() == before - 1
    assert dist.get_process_group_ranks(llm.get_pg("cp")) == want
    destroy_grid(llm)


@world.case
def test_plain_model_creates_no_group_and_names_a_missing_one():
    torch.manual_seed(0)
    dev = current_device()
    reference = ReferenceMimo(CFG).to(dev)
    enc = make_grid(dp=4, create=("tp", "dp"))
    llm = make_grid(cp=2, dp=2, create=("tp", "cp"))  # no ("dp", "cp") group
    bridge = ColocatedBridgeCommunicator(enc, llm)
    enc_tp, llm_tp, llm_cp = enc.get_pg("tp"), llm.get_pg("tp"), llm.get_pg("cp")
    parts = (
        TPEncoder.from_full(reference.encoder, CFG, tp_group=enc_tp, device=dev),
        TPProjection.from_full(reference.projection, CFG, tp_group=enc_tp, device=dev),
        TPLLM.from_full(reference.llm, CFG, tp_group=llm_tp, cp_group=llm_cp, device=dev),
        bridge,
        PartitionAdapter(cp_group=llm_cp, tp_group=llm_tp),
    )
    before = _live_groups()
    # The deprecated form (bridge, partition) still works for one release, with a warning.
    with (
        pytest.warns(DeprecationWarning, match=LEGACY_FORM),
        pytest.raises(
            ValueError, match=r"llm_dp_cp_group was not given and grid .* no \['dp', 'cp'\]"
        ),
    ):
        ColocatedMimoModel(*parts, image_token_id=CFG.image_token_id)
    dp_cp = llm.create_pg(["dp", "cp"])  # collective: every rank, as the grid contract says
    before = _live_groups()
    with pytest.warns(DeprecationWarning, match=LEGACY_FORM):
        model = ColocatedMimoModel(*parts, image_token_id=CFG.image_token_id)
    assert _live_groups() == before
    assert model.llm_dp_cp_group is dp_cp and model.encoder_dp_group is enc.get_pg("dp")
    bridge.destroy()
    destroy_grid(enc)
    destroy_grid(llm)


@world.case
def test_make_mimo_groups_refuses_a_layout_before_any_group():
    before = _live_groups()
    with pytest.raises(TypeError, match=r"llm_grid must be a megatron HyperCommGrid .* GridLayout"):
        make_mimo_groups(
            make_grid(dp=4, create=()), GridLayout((1, 2, 1, 2), ("tp", "cp", "pp", "dp"))
        )
    with pytest.raises(ValueError, match=r"do not nest"):
        make_mimo_groups(
            make_grid(tp=2, dp=2, axis_names=("dp", "tp", "cp", "pp"), create=()),
            make_grid(tp=2, dp=2, create=()),
        )
    assert _live_groups() == before


@world.parametrize("pp", [2, 4])
def test_the_embedding_group_holds_each_pipelines_first_and_last_stage(pp):
    """Megatron's embedding group (a tied head's gradient sum): pp 2 reuses the pp group;
    pp 4 (one pipeline, ranks 0..3) makes ``[0, 3]``, middle stages get ``None``, and
    ``destroy`` frees it with the rest. pp 2 x dp 2 (rank = pp + 2 dp): ``[0, 1]``, ``[2, 3]``."""
    enc, llm = make_grid(dp=4, create=()), make_grid(pp=pp, dp=4 // pp, create=())
    before = _live_groups()
    groups = make_mimo_groups(enc, llm)
    rank, got = dist.get_rank(), groups.llm_embed
    want = {2: {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}, 4: {0: [0, 3], 3: [0, 3]}}[pp]
    assert (None if got is None else dist.get_process_group_ranks(got)) == want.get(rank), rank
    assert (got is groups.llm_pp) == (pp == 2)
    assert len(groups.owned) == (pp == 4 and rank in (0, 3))
    groups.destroy()
    assert _live_groups() == before and groups.owned == []
    groups.destroy()  # idempotent
