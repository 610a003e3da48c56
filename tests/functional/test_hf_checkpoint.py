"""HF -> our checkpoint at one layout -> loaded at another -> ``export_hf`` gives back
transformers' tensors bitwise, on 8 ranks.

Every rank builds the same random ``LlavaForConditionalGeneration`` (:func:`tiny_llava`,
seeded), which rank 0 saves with ``save_pretrained``. The model enters a checkpoint at
layout A (``load_hf`` into the colocated model, or ``import_hf``: one process's
``ReferenceMimo``, saved by every rank), is loaded into a colocated model built from the
config (random weights) at layout B, saved again by plain ``checkpoint.save``, and
exported by rank 0 alone (no process group). Oracle: transformers' own files, compared
bitwise (same keys, ``torch.equal``, same dtype) and through ``from_pretrained``.
Exact, no tolerance: every step moves bits (gathers, DCP reads, row cuts), none computes.
"""

from __future__ import annotations

import tempfile

import pytest
import torch.distributed as dist

pytest.importorskip("transformers")

from mp_bridge import checkpoint  # noqa: E402
from mp_bridge.grid import make_grid  # noqa: E402
from mp_bridge.models import build_colocated_mimo, destroy_colocated_mimo  # noqa: E402
from mp_bridge.models.hf import config_from_hf, export_hf, import_hf, load_hf  # noqa: E402
from mp_bridge.models.hf.tiny import tiny_llava  # noqa: E402
from mp_bridge.testing import DistributedWorld  # noqa: E402
from tests.hf_llava import assert_same_hf_dirs, tied_copies_equal  # noqa: E402

world = DistributedWorld(8)

FAN_IN_CP2 = (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), {})
LLM_PP2 = (dict(tp=2, dp=4), dict(tp=2, pp=2, dp=2), {"microbatches": 2})
TP4_SP = (dict(tp=4, dp=2), dict(tp=4, dp=2), {"sequence_parallel": True})


def _shared_dir(prefix: str) -> str:
    path = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _build(cfg, layout):
    enc, llm, options = layout
    enc_grid = make_grid(**enc, create=("tp", "dp"))
    create = ("tp", "cp", "dp", ("dp", "cp"), *(("pp",) if llm.get("pp", 1) > 1 else ()))
    grids = (enc_grid, make_grid(**llm, create=create))
    return build_colocated_mimo(cfg, *grids, **options), grids


def _round_trip(text, vision, tie, first, second, via_import, check=None):
    root = _shared_dir("hf-ckpt-")
    hf_dir, ckpt_a, ckpt_b, out = (f"{root}/{n}" for n in ("hf", "a", "b", "out"))
    if dist.get_rank() == 0:
        tiny_llava(text, vision, tie=tie).save_pretrained(hf_dir)
    dist.barrier()
    cfg = config_from_hf(hf_dir, seq_len=16)
    if via_import:  # one process's model per rank, one collective save
        import_hf(hf_dir, ckpt_a, seq_len=16)
    else:
        model, grids = _build(cfg, first)
        try:
            load_hf(hf_dir, model)
            checkpoint.save(ckpt_a, model, step=1)
        finally:
            destroy_colocated_mimo(model, *grids)
    model, grids = _build(cfg, second)  # random weights, no HF record
    try:
        checkpoint.load(ckpt_a, model)
        if check is not None:
            check(model)
        assert model.hf_config["text_config"]["model_type"] == text
        checkpoint.save(ckpt_b, model, step=2)
    finally:
        destroy_colocated_mimo(model, *grids)
    compared = None
    if dist.get_rank() == 0:  # one process, no process group
        export_hf(ckpt_b, out)
        compared = assert_same_hf_dirs(hf_dir, out)
    dist.barrier()
    return {"tensors": compared}


@world.case
def test_clip_llama_untied_cp2_to_pp2_exports_bitwise():
    return _round_trip("llama", "clip", False, FAN_IN_CP2, LLM_PP2, via_import=False)


@world.case
def test_siglip_qwen2_tied_imported_to_tp4_sp_exports_bitwise():
    return _round_trip("qwen2", "siglip", True, None, TP4_SP, via_import=True)


def _copies_loaded_equal(model) -> None:
    assert tied_copies_equal(model) in (None, 1)


@world.case
def test_siglip_qwen2_tied_pp2_to_tp4_sp_exports_bitwise():
    """A tied head at PP 2 (the embedding on the first stage, its copy on the last: one
    ``model.llm.embed.weight`` in the checkpoint) loaded at PP 1 / TP 4 / SP."""
    return _round_trip("qwen2", "siglip", True, LLM_PP2, TP4_SP, via_import=False)


@world.case
def test_siglip_qwen2_tied_imported_to_pp2_loads_both_copies():
    """One process's tied checkpoint loaded at PP 2 fills the embedding and the last
    stage's copy equal; saved at PP 2 and exported, transformers' tensors bitwise."""
    return _round_trip(
        "qwen2", "siglip", True, None, LLM_PP2, via_import=True, check=_copies_loaded_equal
    )
