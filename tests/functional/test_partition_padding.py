"""PartitionAdapter with lengths that do not divide the cut: 8 ranks, CP 1/2/4 × SP at TP 2,
plain ``S = 11`` and packed odd documents ``(5, 9, 3)``.

The expected local tokens come from ``route_oracle.ref_local_tokens``, an independent
padded cut (each document padded at its end to ``2·cp``; plain rows to ``2·cp·tp`` with
SP; with SP a padding-only document completes a packed total). Values and gradients only
move, so they compare exactly; causal attention over the padded shards must equal
full-sequence attention on the unpadded documents (tolerance as ``test_cp_attention``:
1e-5, fp32 softmax over a different summation order).
"""

from __future__ import annotations

import torch

from mp_bridge.comm import PartitionAdapter
from mp_bridge.layers import context_parallel_attention
from mp_bridge.testing import DistributedWorld
from tests.functional.route_oracle import ref_local_tokens
from tests.oracles import cu_of, rand, reference_attention, tp_cp_groups

world = DistributedWorld(8)
TOL = dict(rtol=1e-5, atol=1e-5)
LENGTHS = (5, 9, 3)


def _configs():
    for cp in (1, 2, 4):
        for sp in (False, True):
            for packed in (False, True):
                yield cp, sp, packed


def _expected(full, tokens, starts, fill):
    """``full`` ``[b, S, ...]`` (packed: b = 1) at ``tokens`` ((doc, pos) or None) per row."""
    rows = []
    for b in range(full.shape[0] if starts is None else 1):
        vals = []
        for tok in tokens[b]:
            if tok is None:
                vals.append(torch.full_like(full[0, 0], fill))
            else:
                doc, pos = tok
                vals.append(full[b, pos] if starts is None else full[0, starts[doc] + pos])
        rows.append(torch.stack(vals) if vals else full[0, :0])
    return torch.stack(rows)


def _cut(packed, s, cp, c, pieces, t):
    """Per row: the (doc, pos) list of CP rank ``c``, SP piece ``t`` of ``pieces``."""
    if packed:
        return [ref_local_tokens(LENGTHS, True, cp, c, pieces, t)]
    return [[tok and (0, tok[1]) for tok in ref_local_tokens([s], False, cp, c, pieces, t)]]


@world.case
def test_padded_shard_matches_independent_cut_and_round_trips():
    for cp, sp, packed in _configs():
        cp_g, tp_g, c, t = tp_cp_groups(cp)
        pieces = 2 if sp else 1
        b, s = (1, sum(LENGTHS)) if packed else (2, 11)
        cu = cu_of(LENGTHS) if packed else None
        emb = rand(b, s, 3, seed=1).requires_grad_()
        ids = torch.arange(1, b * s + 1, device=emb.device).view(b, s)
        labels, mask = ids + 1000, rand(b, s, seed=2) > 0
        adapter = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=sp)
        out = adapter.shard(emb, input_ids=ids, labels=labels, loss_mask=mask, cu_seqlens=cu)

        def cut(k, tt, packed=packed, cp=cp, c=c, s=s):
            return _cut(packed, s, cp, c, k, tt)

        starts = cu[:-1] if packed else None
        emb_cut, tok_cut = cut(pieces, t % pieces) * b, cut(pieces, 0) * b
        if pieces > 1:  # per-token tensors are CP-local: both pieces, in order
            tok_cut = [cut(pieces, 0)[0] + cut(pieces, 1)[0]] * b
        assert torch.equal(out.embeddings, _expected(emb.detach(), emb_cut, starts, 0.0))
        assert torch.equal(out.input_ids, _expected(ids, tok_cut, starts, 0))
        assert torch.equal(out.labels, _expected(labels, tok_cut, starts, -100))
        assert torch.equal(out.loss_mask, _expected(mask, tok_cut, starts, False))
        real = torch.tensor([tok is not None for tok in tok_cut[0]], device=emb.device)
        if out.token_mask is not None:
            assert torch.equal(out.token_mask, real)
        else:
            assert all(real.tolist()) and None not in emb_cut[0]
        # Real tokens keep their original positions; padding sits after its document.
        pos = torch.arange(s, device=emb.device).expand(b, s)
        assert torch.equal(out.position_ids[:, real], _expected(pos, tok_cut, starts, 0)[:, real])
        # unshard with the original layout returns the original tensors exactly.
        back = adapter.unshard(out.embeddings, cu_seqlens=cu, seq_len=None if packed else s)
        assert torch.equal(back, emb.detach()), (cp, sp, packed)
        back = adapter.unshard(out.labels, cu_seqlens=cu, seq_len=None if packed else s)
        assert torch.equal(back, labels), (cp, sp, packed)
        # Gradient: W on this CP rank's real tokens (SP gathers the TP pieces), else 0.
        w = rand(b, s, 3, seed=3)
        (out.embeddings * _expected(w, emb_cut, starts, 0.0)).sum().backward()
        held = torch.zeros(b, s, 1, device=emb.device)
        for row, toks in enumerate(tok_cut):
            for tok in filter(None, toks):
                held[0 if packed else row, (starts[tok[0]] if packed else 0) + tok[1]] = 1
        assert torch.equal(emb.grad, w * held), (cp, sp, packed)


@world.case
def test_causal_attention_over_padded_documents_equals_the_unpadded_one():
    for cp in (2, 4):
        cp_g, _, _, _ = tp_cp_groups(cp)
        cu, s = cu_of(LENGTHS), sum(LENGTHS)
        full = [rand(1, s, 2, 4, seed=i) for i in range(3)]
        ref = reference_attention(*full, LENGTHS, True)
        adapter = PartitionAdapter(cp_group=cp_g)
        shards = [adapter.shard(x, cu_seqlens=cu) for x in full]
        q, k, v = (sh.embeddings for sh in shards)
        sh = shards[0]
        assert sh.cu_seqlens.tolist() != cu  # the padded layout goes to the attention
        out = context_parallel_attention(
            q, k, v, cp_group=cp_g, position_ids=sh.position_ids, cu_seqlens=sh.cu_seqlens
        )
        torch.testing.assert_close(adapter.unshard(out, cu_seqlens=cu), ref, **TOL)
