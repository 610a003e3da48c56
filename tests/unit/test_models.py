"""Reference models and the MIMO wiring in one process (no process group).

With every group ``None`` the distributed classes must compute exactly the reference
math; here they are checked against :class:`ReferenceMimo` on the same weights.
Tolerance: both sides run the same fp32 ops except attention (SDPA in the reference vs
the explicit einsum/softmax of ``context_parallel_attention``), whose rounding differs
by a few ulps; 1e-5 relative (absolute 1e-6 on O(1) values) is ~100 ulps of headroom.
"""

from __future__ import annotations

import pytest
import torch

from mp_bridge.comm import PartitionAdapter
from mp_bridge.layers import mark_sharded
from mp_bridge.models import (
    TPLLM,
    ColocatedMimoModel,
    MimoConfig,
    MimoGroups,
    ReferenceMimo,
    TPEncoder,
    TPProjection,
    place_image_embeddings,
    synthetic_batch,
)
from mp_bridge.models.parallel.sharding import gather_full_state, load_full_state

CFG = MimoConfig()


class _IdentityBridge:
    """A user's single-process stand-in (the deprecated constructor form)."""

    def communicate(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def destroy(self) -> None:
        pass


def _single_process(reference: ReferenceMimo, flow: str = "gather") -> ColocatedMimoModel:
    return ColocatedMimoModel(
        TPEncoder.from_full(reference.encoder, CFG),
        TPProjection.from_full(reference.projection, CFG),
        TPLLM.from_full(reference.llm, CFG),
        MimoGroups.local(),
        image_token_id=CFG.image_token_id,
        flow=flow,
    )


@pytest.mark.parametrize("flow", ["gather", "routed"])
def test_single_process_model_matches_reference_loss_and_grads(flow):
    torch.manual_seed(0)
    reference = ReferenceMimo(CFG)
    model = _single_process(reference, flow)
    batch = synthetic_batch(CFG, 4, seed=3, text_only=[1], uneven_mask=True)
    x_ref = batch.images.clone().requires_grad_(True)
    x = batch.images.clone().requires_grad_(True)
    ref = reference(batch.input_ids, batch.labels, batch.loss_mask, x_ref)
    out = model(batch.input_ids, batch.labels, batch.loss_mask, x)
    ref.backward()
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    # Sample 1 is text-only: its image never reaches the LLM.
    assert torch.count_nonzero(x.grad[1]) == 0 and torch.count_nonzero(x.grad[0]) > 0
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_text_only_step_leaves_encoder_without_grads():
    torch.manual_seed(0)
    reference = ReferenceMimo(CFG)
    model = _single_process(reference)
    batch = synthetic_batch(CFG, 2, seed=4, text_only=[0, 1])
    loss = model(batch.input_ids, batch.labels, batch.loss_mask, None)
    torch.testing.assert_close(
        loss, reference(batch.input_ids, batch.labels, batch.loss_mask, None), rtol=1e-5, atol=1e-6
    )
    loss.backward()
    assert all(p.grad is None for p in model.encoder.parameters())
    model.sync_gradients()  # no groups: nothing to do, must not fail


def test_place_image_embeddings_puts_patches_in_order():
    text = torch.zeros(2, 5, 1)
    image = torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]]])
    ids = torch.tensor([[0, 9, 9, 0, 0], [0, 0, 0, 0, 9]])
    out = place_image_embeddings(text, image, ids, image_token_id=9)
    assert out.squeeze(-1).tolist() == [[0, 1, 2, 0, 0], [0, 0, 0, 0, 3]]


def test_shard_of_and_load_pad_rows_past_the_full_size():
    full = torch.arange(10.0).view(5, 2)
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(6, 2))
    mark_sharded(module.w, dim=0, group=None, full_size=5)
    load_full_state(module, {"w": full})
    assert module.w[5].tolist() == [0.0, 0.0] and module.w[:5].tolist() == full.tolist()
    assert gather_full_state(module)["w"].tolist() == full.tolist()


def test_load_full_state_errors_name_the_problem():
    module = torch.nn.Linear(2, 3, bias=False)
    with pytest.raises(ValueError, match=r"missing \['weight'\], unexpected \['w'\]"):
        load_full_state(module, {"w": torch.zeros(3, 2)})
    with pytest.raises(
        ValueError, match=r"weight: full tensor has shape \(2, 2\), expected \(3, 2\)"
    ):
        load_full_state(module, {"weight": torch.zeros(2, 2)})


def test_config_and_input_errors():
    with pytest.raises(ValueError, match="llm_hidden=16 must be a multiple of llm_heads=5"):
        MimoConfig(llm_heads=5)
    with pytest.raises(ValueError, match="image_token_id=99 must be a vocab id"):
        MimoConfig(image_token_id=99)
    with pytest.raises(ValueError, match="llm_heads=8 is not divisible by llm tp=3"):
        CFG.check_tp(llm_tp=3)
    with pytest.raises(ValueError, match=r"q heads 2 and k/v heads 2 must each divide by 4"):
        CFG.check_cp_comm("a2a", llm_tp=4, llm_cp=4)
    CFG.check_cp_comm("ring", llm_tp=4, llm_cp=4)  # only a2a splits heads over CP
    torch.manual_seed(0)
    model = _single_process(ReferenceMimo(CFG))
    batch = synthetic_batch(CFG, 2, seed=0)
    ids = batch.input_ids.clone()
    ids[0, :5] = CFG.image_token_id  # 5 placeholders, 4 patches
    with pytest.raises(ValueError, match="sample 0 has .* image tokens"):
        model(ids, batch.labels, batch.loss_mask, batch.images)
    with pytest.raises(ValueError, match=r"labels has shape \(2, 3\)"):
        model(batch.input_ids, batch.labels[:, :3], batch.loss_mask, batch.images)
    with pytest.raises(ValueError, match="images has shape"):
        model(batch.input_ids, batch.labels, batch.loss_mask, batch.images[:, :2])
    with pytest.raises(TypeError, match="image_token_id must be an int"):
        ColocatedMimoModel(
            model.encoder, model.projection, model.llm, MimoGroups.local(), image_token_id=1.5
        )
    with pytest.raises(ValueError, match=r"image_token_id=61 must be an int >= 0 and <= 60"):
        ColocatedMimoModel(
            model.encoder, model.projection, model.llm, MimoGroups.local(), image_token_id=61
        )
    with pytest.raises(ValueError, match=r"flow='scatter' must be one of \['gather', 'routed'\]"):
        model.flow = "scatter"
    with pytest.raises(TypeError, match="input_ids has dtype torch.float32"):
        model(batch.input_ids.float(), batch.labels, batch.loss_mask, batch.images)


def test_deprecated_constructor_form_warns_and_still_works():
    torch.manual_seed(0)
    reference = ReferenceMimo(CFG)
    new = _single_process(reference)
    with pytest.warns(DeprecationWarning, match=r"make_mimo_groups\(encoder_grid"):
        old = ColocatedMimoModel(
            new.encoder, new.projection, new.llm, _IdentityBridge(), PartitionAdapter(),
            image_token_id=CFG.image_token_id,
        )  # fmt: skip
    batch = synthetic_batch(CFG, 2, seed=5)
    args = (batch.input_ids, batch.labels, batch.loss_mask, batch.images)
    assert torch.equal(old(*args), new(*args))  # same modules, same math, same bits
    groups = MimoGroups.local()
    with pytest.warns(DeprecationWarning, match=r"make_mimo_groups\(encoder_grid"):
        kw = ColocatedMimoModel(
            new.encoder, new.projection, new.llm, groups.bridge, PartitionAdapter(),
            image_token_id=CFG.image_token_id, groups=groups,
        )  # fmt: skip
    assert kw.groups is groups and torch.equal(kw(*args), new(*args))
    by_keyword = ColocatedMimoModel(
        new.encoder, new.projection, new.llm, groups=groups, image_token_id=CFG.image_token_id
    )
    assert by_keyword.groups is groups
    with pytest.raises(TypeError, match="takes no partition"):
        ColocatedMimoModel(
            new.encoder, new.projection, new.llm, MimoGroups.local(), PartitionAdapter(),
            image_token_id=CFG.image_token_id,
        )  # fmt: skip


def test_run_parity_dim_names_keywords_are_deprecated_aliases():
    from mp_bridge.grid import AXIS_NAMES
    from mp_bridge.models.oracle import _renamed

    with pytest.warns(DeprecationWarning, match=r"use run_parity\(encoder_axis_names="):
        assert _renamed("encoder_dim_names", ("dp", "tp"), AXIS_NAMES) == ("dp", "tp")
    assert _renamed("encoder_dim_names", None, ("tp", "dp")) == ("tp", "dp")
    with pytest.raises(ValueError, match="llm_axis_names= or its deprecated name llm_dim_names="):
        _renamed("llm_dim_names", ("tp", "dp"), ("dp", "tp"))
