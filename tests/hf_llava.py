"""Shared by the HF tests: a transformers LLaVA batch and the comparison of our
gradients with transformers' by its ``named_parameters()`` names."""

from __future__ import annotations

import torch

from mp_bridge.models.hf import disk_to_module, hf_mappings
from mp_bridge.models.hf.hf_save import hf_tensors
from mp_bridge.models.hf.hf_synthetic import llava_inputs as hf_llava_inputs


def tied_copies_equal(model) -> int | None:
    """On the first and last stage of a tied pipeline: whether this rank's embedding shard
    and its copy on the other end stage are bitwise equal (one all-gather over
    ``model.groups.llm_embed``), as 1 / 0; ``None`` on other ranks (no collective)."""
    import torch.distributed as dist

    tied = model.llm.tied_parameters()
    if not tied:
        return None
    local = tied[0].detach()
    both = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(both, local.contiguous(), group=model.groups.llm_embed)
    return int(torch.equal(both[0], both[1]))


def llava_inputs(cfg, images_per_sample=(1, 2, 0), seq=16, pad=(0, 0, 4), seed=0):
    """HF's ``input_ids [B, S]``, ``pixel_values``, ``attention_mask`` right-padded by
    ``pad[i]`` and ``labels`` (:func:`mp_bridge.models.hf.hf_synthetic.llava_inputs`)."""
    pad = tuple(pad)[: len(images_per_sample)]
    return hf_llava_inputs(cfg, images_per_sample, seq_len=seq, pad=pad, seed=seed)


def grad_errors(ours: torch.nn.Module, hf: torch.nn.Module, cfg, full_grads=None) -> dict:
    """``{hf name: max |ours - hf|}`` for every HF parameter whose gradient is not None;
    ours are cut into HF tensors by the name map. ``full_grads``: our full gradients by
    our name (default: ``ours``' own ``.grad``); a pipeline stage's holds only its part of
    ``llm.*``, and HF names of the other stages are skipped. ``KeyError`` if any other HF
    gradient has no counterpart of ours."""
    hf_params = dict(hf.named_parameters())
    if full_grads is None:
        full_grads = {n: p.grad for n, p in ours.named_parameters()}
    mapped, elsewhere = {}, set()
    for m in hf_mappings(cfg):
        if m.ours not in full_grads and m.ours.startswith("llm."):
            elsewhere.update(disk_to_module(k) for k in m.hf)
            continue
        g = full_grads[m.ours]
        for key, t in zip(m.hf, hf_tensors(m, g)):
            mapped[disk_to_module(key)] = t
    if cfg.tie_embeddings and "model.language_model.embed_tokens.weight" in mapped:
        mapped["lm_head.weight"] = mapped["model.language_model.embed_tokens.weight"]
    out = {}
    for name, p in hf_params.items():
        if p.grad is not None and name not in elsewhere:
            out[name] = (mapped[name] - p.grad).abs().max().item()
    return out


def assert_same_hf_dirs(want_dir: str, got_dir: str) -> int:
    """``got_dir``'s safetensors hold exactly ``want_dir``'s keys, each bitwise equal (same
    dtype), and ``LlavaForConditionalGeneration.from_pretrained`` gives every parameter
    bitwise back; returns the number of tensors compared."""
    import os

    from safetensors.torch import load_file
    from transformers import LlavaForConditionalGeneration

    want = load_file(os.path.join(want_dir, "model.safetensors"))
    got = load_file(os.path.join(got_dir, "model.safetensors"))
    assert sorted(want) == sorted(got), sorted(set(want) ^ set(got))
    bad = [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]
    assert not bad, bad[:5]
    a = LlavaForConditionalGeneration.from_pretrained(want_dir).state_dict()
    b = LlavaForConditionalGeneration.from_pretrained(got_dir).state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    return len(want)
