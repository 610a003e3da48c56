"""The triton engine's invariant mode at TP > 1 in layouts ``test_triton_engine_tp`` does
not name: TP 1's bits (values, ``d hidden``, every rank's ``d weight`` gathered) and the
fp64 oracle, on 4 gloo ranks under ``TRITON_INTERPRET=1`` (``tests.triton_engine``).

- hidden sizes below the TP size (``H = 3`` at TP 4: rank 3 owns no hidden column of the
  column-ownership ``d h``, ``triton_ops.dhidden``), in bf16 at 1-token chunks, vocab 700
  (rank 2 holds 188 true ids of its block, rank 3 none);
- over-padded shards (1024 rows per rank for vocab 600 at TP 2: rank 0 holds all three
  real blocks and a padding one, rank 1 only padding), ``H = 17``;
- statistics folded in several groups of chunks (``FOLD_TOKENS`` made 64 at TP 2 with
  chunks of 32, TP 1 folding all 150 tokens in one group), log-probs with the entropy.

Tolerances: ``tests/unit/test_triton_engine``'s (fp32 2e-5; bf16 gradients 2e-2 / 6e-3).
"""

from __future__ import annotations

import functools

import torch

from mp_bridge.layers.loss.engines.triton_ops import invariant as triton_invariant
from mp_bridge.testing import DistributedWorld
from tests.loss_refs import Checks
from tests.oracles import tp_member
from tests.triton_engine import oracle, run, triton_loss

world = DistributedWorld(4, timeout_s=180)
FP32 = dict(rtol=2e-5, atol=2e-5)
BF16_GRAD = dict(rtol=2e-2, atol=6e-3)


def _data(n, h, rows, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(rows, h, generator=g) * 0.4).to(dtype)  # past vocab: padding
    target = torch.randint(0, vocab, (n,), generator=g)
    target[[1, n // 2]] = -100
    return hidden, weight, target


def _compare(kind, kw, vocab, tp, v_local, data, fold=None):
    """TP ``tp`` (shards of ``v_local`` rows) against TP 1 in bits and against fp64."""
    inside, group, rank = tp_member(tp)
    if not inside:
        return
    hidden, weight, target = data
    kw = dict(kw, vocab_size=vocab, invariant=True)
    ref = run(functools.partial(triton_loss, kind, **kw), hidden, weight[:vocab], target)
    saved = triton_invariant.FOLD_TOKENS
    triton_invariant.FOLD_TOKENS = fold or saved
    try:
        start = rank * v_local
        fn = functools.partial(triton_loss, kind, **kw, tp_group=group)
        outs, gh, gw = run(fn, hidden, weight[start : start + v_local], target)
    finally:
        triton_invariant.FOLD_TOKENS = saved
    parts = [torch.empty_like(gw) for _ in range(tp)]
    torch.distributed.all_gather(parts, gw, group=group)
    gw = torch.cat(parts)
    checks, what = Checks(), f"{kind} tp={tp} {kw} {hidden.dtype}"
    for i, (a, b) in enumerate(zip(outs, ref[0], strict=True)):
        checks.equal(a, b, f"{what} value {i}")
    checks.equal(gh, ref[1], f"{what} d hidden")
    checks.equal(gw[:vocab], ref[2], f"{what} d weight")
    checks.equal(gw[vocab:], torch.zeros_like(gw[vocab:]), f"{what} d weight padding")
    want = run(oracle(kind, vocab, **kw), hidden, weight, target)
    grad_tol = FP32 if hidden.dtype == torch.float32 else BF16_GRAD
    for i, (a, b) in enumerate(zip(outs, want[0], strict=True)):
        checks.close(a, b, f"{what} value {i} vs fp64", **FP32)
    checks.close(gh, want[1], f"{what} d hidden vs fp64", **grad_tol)
    checks.close(gw[:vocab], want[2][:vocab], f"{what} d weight vs fp64", **grad_tol)
    checks.done()


@world.case
def test_hidden_narrower_than_tp_in_bf16():
    data = _data(37, 3, 1024, 700, torch.bfloat16)
    _compare("ce", dict(reduction="none", chunk_size=1, label_smoothing=0.1), 700, 4, 256, data)


@world.case
def test_over_padded_shards():
    data = _data(37, 17, 2048, 600, torch.float32, seed=1)
    kw = dict(reduction="sum", z_loss_weight=1e-2, softcap=4.0, chunk_size=32)
    _compare("ce", kw, 600, 2, 1024, data)


@world.case
def test_statistics_folded_in_groups_of_chunks():
    data = _data(150, 8, 1024, 600, torch.float32, seed=2)
    kw = dict(temperature=0.8, return_entropy=True, return_sum_pi_squared=True, chunk_size=32)
    _compare("logprob", kw, 600, 2, 512, data, fold=64)
