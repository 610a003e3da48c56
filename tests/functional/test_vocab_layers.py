"""VocabParallelEmbedding / VocabParallelLMHead against F.embedding / F.linear on full weights.

One 8-rank world; TP groups of size 1 (``None``), 2, 3, 4, 8 (with TP=3 ranks 6, 7 sit out).
Every rank builds the same full weights and inputs from one seed, shards with
``from_full``, and compares outputs and gradients with the single-process computation.

Tolerances. Embedding: the TP sum adds one real row to zeros, so outputs and weight
gradients are exact (compared with ``torch.equal``), in fp32 and bf16. LM head: compared
with torch in fp64 on the same values, normwise (max error / max |reference| of each
tensor), because the input gradient is a sum over up to 50k vocab rows whose entries
cancel: fp32 5e-5 (random-walk rounding of a 50k-term fp32 sum, ~sqrt(5e4) * 6e-8 = 1.3e-5;
measured 6.5e-6), bf16 2e-2 (measured 5.8e-3) (outputs and the TP
all-reduce of the input gradient are rounded to bf16, 2**-8 each, plus the sum).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mp_bridge.layers import VocabParallelEmbedding, VocabParallelLMHead, vocab_shard_ranges
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.oracles import rank_in, tp_group

world = DistributedWorld(8)

TP_SIZES = (1, 2, 3, 4, 8)
VOCABS = ((1000, 1), (1001, 1), (50257, 128))  # (vocab_size, multiple)
H, B, S = 8, 2, 24  # S divisible by every TP size, for sequence parallelism
# Normwise relative error bounds (max |got - ref| / max |ref|) for the LM head; see above.
HEAD_TOL = {torch.float32: 5e-5, torch.bfloat16: 2e-2}


def _configs():
    """Yield (tp, group, vocab, multiple) for every config this rank takes part in."""
    for tp in TP_SIZES:
        group, active = tp_group(tp)
        if active:
            for vocab, multiple in VOCABS:
                yield tp, group, vocab, multiple


def _data(vocab: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dev = current_device()
    weight = torch.randn(vocab, H, generator=gen).to(dtype).to(dev)
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    ids[0, :3] = torch.tensor([0, vocab - 1, vocab // 2])  # both ends of the vocab
    upstream = torch.randn(B, S, H, generator=gen).to(dtype).to(dev)
    return weight, ids.to(dev), upstream


def _check_embedding(dtype: torch.dtype, sequence_parallel: bool) -> list[str]:
    failures = []  # collected, so a failing rank keeps issuing the same collectives
    for tp, group, vocab, multiple in _configs():
        weight, ids, upstream = _data(vocab, dtype, seed=tp + vocab)
        ref_w = weight.clone().requires_grad_()
        ref = F.embedding(ids, ref_w)
        (ref_grad,) = torch.autograd.grad(ref, ref_w, upstream)
        emb = VocabParallelEmbedding.from_full(
            weight, tp_group=group, multiple=multiple, sequence_parallel=sequence_parallel
        )
        with CollectiveCounter() as counter:
            out = emb(ids)
        expected = {"reduce_scatter": 1} if sequence_parallel else {"all_reduce": 1}
        if tp > 1 and counter.counts() != expected:
            failures.append(f"tp={tp}: collectives {counter.counts()}")
        chunk = S // tp
        r = rank_in(group)
        lo = r * chunk if sequence_parallel else 0
        hi = lo + chunk if sequence_parallel else S
        (grad,) = torch.autograd.grad(out, emb.weight, upstream[:, lo:hi])
        start, end = vocab_shard_ranges(vocab, tp, multiple=multiple)[r]
        ref_rows = torch.zeros(end - start, H, dtype=dtype, device=weight.device)
        ref_rows[: max(min(end, vocab) - start, 0)] = ref_grad[start:end]
        where = f"tp={tp} vocab={vocab} sp={sequence_parallel} {dtype}"
        if not torch.equal(out, ref[:, lo:hi]):
            failures.append(f"{where}: output")
        if not torch.equal(grad, ref_rows):
            failures.append(f"{where}: weight grad")
        if (emb.vocab_start_index, emb.vocab_end_index) != (start, end):
            failures.append(f"{where}: shard range")
    return failures


@world.case
def test_embedding_matches_f_embedding():
    failures = _check_embedding(torch.float32, False) + _check_embedding(torch.bfloat16, False)
    assert not failures, failures


@world.case
def test_embedding_sequence_parallel_reduce_scatters():
    failures = _check_embedding(torch.float32, True)
    assert not failures, failures


@world.case
def test_embedding_matches_megatron():
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding as MegatronEmbedding

    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False)
    for tp in (2, 4, 8):  # megatron needs the vocab to divide TP and a real group
        group, active = tp_group(tp)
        if not active:
            continue
        weight, ids, _ = _data(1000, torch.float32, seed=tp)
        ours = VocabParallelEmbedding.from_full(weight, tp_group=group)
        theirs = MegatronEmbedding(1000, H, init_method=None, config=config, tp_group=group)
        theirs = theirs.to(weight.device)  # megatron builds it on the CPU (cpu initialization)
        with torch.no_grad():
            theirs.weight.copy_(ours.weight)
        assert (theirs.vocab_start_index, theirs.vocab_end_index) == (
            ours.vocab_start_index,
            ours.vocab_end_index,
        )
        assert theirs.weight.device == ours.weight.device == ids.device
        assert torch.equal(ours(ids), theirs(ids))


def _check_head(dtype: torch.dtype, sequence_parallel: bool, bias: bool):
    failures = []
    tol = HEAD_TOL[dtype]
    worst = 0.0
    for tp, group, vocab, multiple in _configs():
        if vocab == 50257 and dtype != torch.float32:
            continue  # same code path as vocab 1001; keeps the bf16 case fast
        weight, _, h_full = _data(vocab, dtype, seed=3 * tp + vocab)
        b_full = torch.randn(vocab, dtype=dtype).to(weight.device) if bias else None
        gen = torch.Generator().manual_seed(tp)
        padded = vocab_shard_ranges(vocab, tp, multiple=multiple)[-1][1]
        g_full = torch.randn(B, S, padded, generator=gen).to(dtype).to(weight.device)
        # Padding logits get zero gradient from our losses; a nonzero one would (rightly)
        # train the padding rows, which the true-vocab reference does not have.
        g_full[..., vocab:] = 0
        # Reference: fp64 torch on the same (rounded) values, on the true vocab.
        rw = weight.double().requires_grad_()
        rh = h_full.double().requires_grad_()
        rb = b_full.double().requires_grad_() if bias else None
        ref = F.linear(rh, rw, rb)
        leaves = [rh, rw] + ([rb] if bias else [])
        ref_grads = torch.autograd.grad(ref, leaves, g_full[..., :vocab].double())

        head = VocabParallelLMHead.from_full(
            weight, b_full, tp_group=group, multiple=multiple, sequence_parallel=sequence_parallel
        )
        r = rank_in(group)
        lo, hi = (r * S // tp, (r + 1) * S // tp) if sequence_parallel else (0, S)
        h = h_full[:, lo:hi].clone().requires_grad_()
        start, end = head.vocab_start_index, head.vocab_end_index
        real = max(min(end, vocab) - start, 0)
        logits = head(h)
        leaves = [h, head.weight] + ([head.bias] if bias else [])
        grads = torch.autograd.grad(logits, leaves, g_full[..., start:end])
        where = f"tp={tp} vocab={vocab} sp={sequence_parallel} bias={bias} {dtype}"
        want_logits = torch.zeros(B, S, end - start, dtype=torch.float64, device=weight.device)
        want_logits[..., :real] = ref[..., start : start + real]
        want_w = torch.zeros_like(head.weight, dtype=torch.float64)
        want_w[:real] = ref_grads[1][start : start + real]
        checks = [
            (logits, want_logits, "logits"),
            (grads[0], ref_grads[0][:, lo:hi], "h grad"),
            (grads[1], want_w, "weight grad"),
        ]
        if bias:
            want_b = torch.zeros_like(head.bias, dtype=torch.float64)
            want_b[:real] = ref_grads[2][start : start + real]
            checks.append((grads[2], want_b, "bias grad"))
        for got, want, what in checks:
            # Normwise: error relative to the largest reference entry of that tensor.
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            worst = max(worst, err)
            if err > tol:
                failures.append(f"{where}: {what} (normwise rel err {err:.3g})")
    return failures, worst


@world.case
def test_lm_head_matches_f_linear():
    failures, worst = _check_head(torch.float32, False, bias=True)
    assert not failures, failures
    failures, worst_bf16 = _check_head(torch.bfloat16, False, bias=False)
    assert not failures, failures
    return {"fp32": worst, "bf16": worst_bf16}


@world.case
def test_lm_head_sequence_parallel_gathers_sequence():
    failures, worst = _check_head(torch.float32, True, bias=False)
    assert not failures, failures
    return {"fp32": worst}


@world.case
def test_lm_head_collectives():
    group, _ = tp_group(8)
    head = VocabParallelLMHead(H, 1001, tp_group=group, device=current_device())
    h = torch.randn(B, S, H, device=current_device(), requires_grad=True)
    with CollectiveCounter() as fwd:
        logits = head(h)
    with CollectiveCounter() as bwd:
        logits.sum().backward()
    assert fwd.counts() == {} and bwd.counts() == {"all_reduce": 1}


@world.case
def test_tied_head_shares_the_embedding_weight():
    group, _ = tp_group(4)  # every rank is in one of the two TP=4 groups
    emb = VocabParallelEmbedding(1001, H, tp_group=group, multiple=8, device=current_device())
    head = VocabParallelLMHead(H, 1001, tp_group=group, multiple=8, tie_to=emb)
    assert head.weight is emb.weight
    params = list(torch.nn.ModuleList([emb, head]).parameters())
    assert len(params) == 1
    with pytest.raises(ValueError, match="differ from this head"):
        VocabParallelLMHead(H, 1001, tp_group=group, multiple=1, tie_to=emb)
    with pytest.raises(ValueError, match="differ from this head"):
        VocabParallelLMHead(H + 1, 1001, tp_group=group, multiple=8, tie_to=emb)


@world.case
def test_out_of_range_ids_raise_before_the_all_reduce():
    group, _ = tp_group(8)
    emb = VocabParallelEmbedding(1001, H, tp_group=group, device=current_device())
    ids = torch.tensor([[3, 1001]], device=current_device())
    with CollectiveCounter() as counter:
        with pytest.raises(ValueError, match=r"ids hold 1001, outside \[0, 1001\)"):
            emb(ids)
        with pytest.raises(ValueError, match=r"outside \[0, 1001\)"):
            emb(torch.tensor([[-1]], device=current_device()))
    assert counter.counts() == {}
    sp = VocabParallelEmbedding(
        1001, H, tp_group=group, sequence_parallel=True, device=current_device()
    )
    with pytest.raises(ValueError, match="length 12.*divisible by the TP size 8"):
        sp(torch.zeros(2, 12, dtype=torch.long, device=current_device()))
