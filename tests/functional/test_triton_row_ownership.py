"""The triton engine's invariant ``d h`` by token-row ownership (``reduce.gather_weight_pieces``
/ ``exchange_token_rows`` / ``gather_token_rows``, all ``async_op``) in the layouts its code
branches on: TP 1's bits (values, ``d hidden``, every rank's ``d weight`` gathered) and the
fp64 oracle, on 3 gloo ranks under ``TRITON_INTERPRET=1`` (``tests.triton_engine``).

- the weight gathered in several column groups (``reduce.MAX_GROUP_ELEMENTS`` made 3 x 256
  x 256 at TP 3, so ``H = 300`` goes as 256 + 44 columns), 5 chunks of 32 tokens with
  their collectives in flight across chunks, rows that TP 3 does not divide (150 = 4 x 32
  + 22: the last chunk's 22 rows split 8 / 7 / 7, through the gather's buffer);
- bf16, one chunk whose rows split 13 / 12 / 12, a shard past the vocab (ranks hold 512
  rows of vocab 1300: rank 2 holds 276 true ids).

Tolerances: ``tests/unit/test_triton_engine``'s (fp32 2e-5; bf16 gradients 2e-2 / 6e-3).
"""

from __future__ import annotations

import functools

import torch

from mp_bridge.layers.loss import reduce
from mp_bridge.testing import DistributedWorld
from tests.loss_refs import Checks
from tests.oracles import tp_member
from tests.triton_engine import oracle, run, triton_loss

world = DistributedWorld(3, timeout_s=240)
FP32 = dict(rtol=2e-5, atol=2e-5)
BF16_GRAD = dict(rtol=2e-2, atol=6e-3)


def _compare(kind, kw, n, h, vocab, v_local, dtype, groups=None, seed=0):
    inside, group, rank = tp_member(3)
    assert inside
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(3 * v_local, h, generator=g) * 0.4).to(dtype)  # past vocab: padding
    target = torch.randint(0, vocab, (n,), generator=g)
    target[[1, n // 2]] = -100
    kw = dict(kw, vocab_size=vocab, invariant=True)
    ref = run(functools.partial(triton_loss, kind, **kw), hidden, weight[:vocab], target)
    saved = reduce.MAX_GROUP_ELEMENTS
    reduce.MAX_GROUP_ELEMENTS = groups or saved
    try:
        start = rank * v_local
        fn = functools.partial(triton_loss, kind, **kw, tp_group=group)
        outs, gh, gw = run(fn, hidden, weight[start : start + v_local], target)
    finally:
        reduce.MAX_GROUP_ELEMENTS = saved
    parts = [torch.empty_like(gw) for _ in range(3)]
    torch.distributed.all_gather(parts, gw, group=group)
    gw = torch.cat(parts)
    checks, what = Checks(), f"{kind} tp=3 {kw} {dtype} groups={groups}"
    for i, (a, b) in enumerate(zip(outs, ref[0], strict=True)):
        checks.equal(a, b, f"{what} value {i}")
    checks.equal(gh, ref[1], f"{what} d hidden")
    checks.equal(gw[:vocab], ref[2], f"{what} d weight")
    want = run(oracle(kind, vocab, **kw), hidden, weight, target)
    grad_tol = FP32 if dtype == torch.float32 else BF16_GRAD
    for i, (a, b) in enumerate(zip(outs, want[0], strict=True)):
        checks.close(a, b, f"{what} value {i} vs fp64", **FP32)
    checks.close(gh, want[1], f"{what} d hidden vs fp64", **grad_tol)
    checks.close(gw[:vocab], want[2][:vocab], f"{what} d weight vs fp64", **grad_tol)
    checks.done()


def test_weight_groups_stay_under_the_int32_limit_in_whole_tiles():
    # TP 8 x 16384 rows x 4096 columns is 2**29 elements: one group
    assert reduce.weight_groups(4096, 8, 16384) == [slice(0, 4096)]
    # TP 8 x 32768 rows (V = 262144) x 16384 columns is 2**32: 2**31 - 1 // 2**18 = 8191
    # columns, 7936 in whole 256-column tiles: 3 groups, each under 2**31 elements
    got = reduce.weight_groups(16384, 8, 32768)
    assert got == [slice(0, 7936), slice(7936, 15872), slice(15872, 16384)]
    assert all(8 * 32768 * (s.stop - s.start) < 2**31 for s in got)
    assert reduce.split_slices(22, 3) == [slice(0, 8), slice(8, 15), slice(15, 22)]


@world.case
def test_weight_in_column_groups_over_chunks_in_flight():
    kw = dict(reduction="sum", label_smoothing=0.1, chunk_size=32)
    _compare("ce", kw, 150, 300, 768, 256, torch.float32, groups=3 * 256 * 256)


@world.case
def test_bf16_rows_split_unevenly_with_a_shard_past_the_vocab():
    kw = dict(temperature=0.8, return_entropy=True)
    _compare("logprob", kw, 37, 40, 1300, 512, torch.bfloat16, seed=3)
