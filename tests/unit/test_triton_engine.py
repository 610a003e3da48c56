"""The ``"triton"`` loss engine at TP = 1 against an fp64 oracle (both modes, every
option), its invariant bits, and its refusals (an explicit engine never falls back);
kernels under ``TRITON_INTERPRET=1`` without CUDA (``tests.triton_engine``).

Shapes are small and odd on purpose: ``N = 45`` tokens (no multiple of any tile: 8, 16,
32), ``H = 24`` (not a multiple of the 32-wide ``k`` step), vocab 600 (not a whole
number of 256-row blocks, nor of the 512 / 1024-wide column tiles).

Tolerances. fp32 inputs: the logits are fp32 sums of 24 products (~1e-6 relative) and
every statistic an fp32 sum over <= 600 columns; 2e-5 absolute / relative is 10x the
errors seen here and catches any wrong term (>= 1e-3). bf16 / fp16 inputs: the oracle
takes the *same* rounded inputs in fp64, so values stay within the fp32 bound (the
logits are exact products, fp32-accumulated, never rounded); gradients are rounded to
the input dtype twice (``g`` before the two products, the result): relative 2**-8
(bf16) / 2**-11 (fp16) each, so 2e-2 / 4e-3 relative with an absolute floor.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from tests.triton_engine import DEVICE, oracle, run, triton_loss  # isort: split

import triton  # noqa: E402 - after tests.triton_engine (TRITON_INTERPRET, importorskip)
import triton.language as tl  # noqa: E402

from mp_bridge.layers.loss.engines.triton_ops.tiles import INTERPRET, rounded  # noqa: E402

N, H, V = 45, 24, 600
FP32 = dict(rtol=2e-5, atol=2e-5)
# bf16 / fp16 gradients: ``g`` and the result are each rounded to the input dtype (2**-9 /
# 2**-12 relative), and a sum over 600 columns of rounded terms errs by ~2**-9 of the
# gradient's scale (~0.3 here) where a small element sits next to large ones.
GRAD_LOW = {torch.bfloat16: dict(rtol=2e-2, atol=6e-3), torch.float16: dict(rtol=4e-3, atol=8e-4)}


def _data(dtype=torch.float32, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.4).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    target[[3, 17]] = -100
    return hidden, weight, target


def _msg(what: str, message: str) -> str:
    return f"{what}: {message}"


def _check(kind, kw, dtype=torch.float32, shape=(N,)):
    """Both modes against the fp64 oracle; ``shape``: the leading dims of the tokens."""
    hidden, weight, target = _data(dtype)
    hidden, target = hidden.view(*shape, H), target.view(shape)
    if kw.get("ignore_index", -100) is None:
        target = target.clamp(min=0)
    flat = dict(kw)
    if isinstance(kw.get("temperature"), torch.Tensor):  # the oracle sees flat tokens
        flat["temperature"] = kw["temperature"].expand(shape).reshape(-1)
    flat_h, flat_t = hidden.flatten(0, -2), target.flatten()
    want = run(oracle(kind, V, **flat), flat_h, weight, flat_t, device="cpu")
    for invariant in (False, True):
        got = run(
            functools.partial(triton_loss, kind, invariant=invariant, chunk_size=20, **kw),
            hidden,
            weight,
            target,
        )
        what = f"{kind} {kw} invariant={invariant} {dtype}"
        msg = functools.partial(_msg, what)
        assert len(got[0]) == len(want[0]), what
        for a, b in zip(got[0], want[0]):
            assert a.shape == (shape if b.dim() else ()), what
            torch.testing.assert_close(a.double().flatten(), b.double().flatten(), **FP32, msg=msg)
        tol = FP32 if dtype == torch.float32 else GRAD_LOW[dtype]
        for a, b in zip(got[1:], want[1:]):
            assert a.dtype == dtype, what
            torch.testing.assert_close(a.double().flatten(0, -2), b.double(), **tol, msg=msg)


# Every option at least once, in both modes (each case runs the two).
CASES = {
    "ce_mean": ("ce", dict()),
    "ce_none_smoothing_zloss_softcap_temperature": (
        "ce",
        dict(
            reduction="none",
            label_smoothing=0.1,
            z_loss_weight=1e-2,
            return_z_loss=True,
            softcap=3.0,
            temperature=0.7,
        ),
    ),  # fmt: skip
    "lp_none_entropy_sq_softcap_temperature": (
        "logprob",
        dict(temperature=0.8, softcap=2.5, return_entropy=True, return_sum_pi_squared=True),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_options_match_fp64(name):
    _check(*CASES[name])


def test_per_token_temperature_leading_dims_sum_and_no_ignore_index():
    g = torch.Generator().manual_seed(7)
    per_token = torch.rand(5, 9, generator=g) + 0.5
    kw = dict(temperature=per_token, reduction="sum", ignore_index=None, label_smoothing=0.2)
    _check("ce", kw, shape=(5, 9))
    per_sample = torch.rand(5, 1, generator=g) + 0.5  # broadcast over each row's 9 tokens
    kw = dict(temperature=per_sample, reduction="mean", return_entropy=True,
              return_sum_pi_squared=True)  # fmt: skip
    _check("logprob", kw, shape=(5, 9))


def test_low_precision_inputs_keep_fp32_logits():
    _check("ce", dict(label_smoothing=0.1, z_loss_weight=1e-3), torch.bfloat16)
    _check("logprob", dict(return_entropy=True, temperature=0.9), torch.float16)


def test_all_tokens_ignored_is_nan_with_zero_grads():
    hidden, weight, _ = _data()
    ignored = torch.full((N,), -100)
    for invariant in (False, True):
        (out,), gh, gw = run(
            functools.partial(triton_loss, "ce", invariant=invariant, label_smoothing=0.1),
            hidden,
            weight,
            ignored,
        )
        assert torch.isnan(out), invariant
        assert torch.all(gh == 0) and torch.all(gw == 0), invariant


def _invariant(h, w, t, chunk, up):
    h, w, t, up = (x.to(DEVICE) for x in (h, w, t, up))
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = triton_loss("ce", hh, ww, t, invariant=True, chunk_size=chunk, reduction="none",
                      label_smoothing=0.1, softcap=6.0)  # fmt: skip
    out.backward(up)
    return out.detach().cpu(), hh.grad.cpu(), ww.grad.cpu()


def test_invariant_bits_do_not_depend_on_chunks_or_other_tokens():
    hidden, weight, target = _data()
    extra_h, _, extra_t = _data(n=40, seed=9)
    up = torch.linspace(0.5, 1.5, N)
    ref = _invariant(hidden, weight, target, 64, up)
    zeros = torch.zeros(40)
    for chunk, front in ((33, None), (64, False), (100, True)):
        if front is None:
            got = _invariant(hidden, weight, target, chunk, up)
            base = slice(0, N)
        else:
            parts = [(extra_h, extra_t, zeros), (hidden, target, up)]
            parts = parts if front else parts[::-1]
            h, t, u = (torch.cat([p[i] for p in parts]) for i in range(3))
            base = slice(40, 40 + N) if front else slice(0, N)
            got = _invariant(h, weight, t, chunk, u)
        assert torch.equal(got[0][base], ref[0]), (chunk, front)
        assert torch.equal(got[1][base], ref[1]), (chunk, front)
        if not front:  # appended tokens with zero upstream add exact zeros to d weight
            assert torch.equal(got[2], ref[2]), (chunk, front)


def test_bf16_invariant_bits_do_not_depend_on_chunks_or_other_tokens():
    """bf16 runs 128-row tiles and chunks of whole 128 + 64 tokens: 300 tokens in one
    chunk against chunks of 128 with 40 unrelated tokens (zero upstream) in front (values
    and d h) or behind (d W too: ``d W`` sums tokens in 64-token steps from the first,
    so tokens in front regroup them)."""
    hidden, weight, target = _data(torch.bfloat16, n=300, seed=3)
    extra_h, _, extra_t = _data(torch.bfloat16, n=40, seed=9)
    up, zeros = torch.linspace(0.5, 1.5, 300), torch.zeros(40)
    ref = _invariant(hidden, weight, target, None, up)
    front = _invariant(torch.cat([extra_h, hidden]), weight, torch.cat([extra_t, target]),
                       128, torch.cat([zeros, up]))  # fmt: skip
    assert torch.equal(front[0][40:], ref[0]) and torch.equal(front[1][40:], ref[1])
    back = _invariant(torch.cat([hidden, extra_h]), weight, torch.cat([target, extra_t]),
                      128, torch.cat([up, zeros]))  # fmt: skip
    assert torch.equal(back[0][:300], ref[0]) and torch.equal(back[1][:300], ref[1])
    assert torch.equal(back[2], ref[2])  # one chunk written directly = three accumulated


def test_fp64_under_an_explicit_triton_engine_is_a_value_error():
    # The kernels take fp32 / bf16 / fp16 (registry.ENGINE_CAPS): no silent torch fallback.
    hidden, weight, target = _data(torch.float64)
    match = (
        r"engine='triton' cannot run this call: dtype torch.float64 \(it takes float32, "
        r"bfloat16, float16\); pass engine='auto'"
    )
    with pytest.raises(ValueError, match=match):
        triton_loss("ce", hidden, weight, target)
    auto = triton_loss("ce", hidden, weight, target, engine="auto")  # picks torch
    assert torch.equal(auto, triton_loss("ce", hidden, weight, target, engine="torch"))


def test_torch_engine_calls_never_import_the_triton_engine(monkeypatch):
    # A None entry makes any import of the engine raise ImportError.
    monkeypatch.setitem(sys.modules, "mp_bridge.layers.loss.engines.triton_ops", None)
    hidden, weight, target = _data()
    from mp_bridge.layers import fused_linear_cross_entropy

    for engine in ("torch", "auto"):  # "auto" on CPU tensors is "torch"
        fused_linear_cross_entropy(hidden, weight, target, engine=engine)
    with pytest.raises(ImportError):
        triton_loss("ce", hidden, weight, target)


def test_unknown_engine_is_a_value_error():
    hidden, weight, target = _data()
    with pytest.raises(ValueError, match=r"engine='cuda' must be one of"):
        triton_loss("ce", hidden, weight, target, engine="cuda")


@triton.jit
def _store(x_ptr, y_ptr, n, B: tl.constexpr, INTERPRET: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, rounded(x, y_ptr, INTERPRET), mask=i < n)


def test_bf16_gradient_stores_round_to_nearest_even_like_torch():
    # The interpreter truncates fp32 -> bf16; ``tiles.rounded`` keeps the GPU's rounding.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g) * 10.0 ** torch.randint(-20, 20, (1000,), generator=g)
    x[:3] = torch.tensor([1.00390625, 1.01171875, 1 + 3 * 2.0**-9])  # ties to even, a carry
    x = x.to(DEVICE)
    y = torch.empty(1000, dtype=torch.bfloat16, device=DEVICE)
    _store[(1,)](x, y, 1000, B=1024, INTERPRET=INTERPRET)
    assert torch.equal(y, x.to(torch.bfloat16))


def test_token_row_owners_split_like_tensor_split():
    # the invariant d h by token-row ownership (triton_ops.dhidden): rank r owns slice r
    # of the chunk's rows, empty when TP > C
    from mp_bridge.layers.loss.reduce import split_slices

    for hidden, tp in ((16, 3), (4096, 8), (3, 4), (5, 4), (1, 1), (7, 7)):
        want = [(int(c[0]), int(c[-1]) + 1) if len(c) else None
                for c in torch.arange(hidden).tensor_split(tp)]  # fmt: skip
        got = [(c.start, c.stop) if c.stop > c.start else None for c in split_slices(hidden, tp)]
        assert got == want, (hidden, tp)
        assert sum(c.stop - c.start for c in split_slices(hidden, tp)) == hidden


def test_invariant_chunks_keep_g_under_int32_offsets_and_scale_with_tp():
    from mp_bridge.layers.loss.engines.triton_ops.invariant import TritonInvariantRunner
    from mp_bridge.layers.vocab_shards import VocabShard

    spec = None  # build only stores it
    w = torch.empty((262144, 8), dtype=torch.bfloat16, device="meta")
    one = VocabShard.of_rank(1, 262144, rank=0, vocab_size=262144)
    # 16384 tokens x 262144 columns would be 2**32 elements: 2**31 // 262144 = 8192 rows
    # is exactly 2**31, so the cap is the tile (128) below it
    assert TritonInvariantRunner.build(w, None, one, spec, 16384).chunk == 8064
    assert TritonInvariantRunner.build(w, None, one, spec, 1000).chunk == 1024  # rounded up
    # no chunk_size: 8192 tokens (triton_invariant.default_chunk) capped like 16384
    assert TritonInvariantRunner.build(w, None, one, spec, None).chunk == 8064
    shard = VocabShard.of_rank(8, 32768, rank=3, vocab_size=262144)
    assert TritonInvariantRunner.build(w[:32768], None, shard, spec, None).chunk == 8192


def test_invariant_chunks_keep_hidden_rows_under_int32_offsets():
    """The chunk's ``h`` and ``d h`` rows ``[C, H]`` are read and written with int32
    offsets too (``rows * h_stride``): where ``H`` is wider than the chunk's ``g`` (few
    local vocab blocks) it caps the chunk as well."""
    from mp_bridge.layers.loss.engines.triton_ops.invariant import TritonInvariantRunner
    from mp_bridge.layers.vocab_shards import VocabShard

    # V = 32768 at TP 8: K = 16 local blocks, g [C, 4096]; H = 8192
    w = torch.empty((4096, 8192), dtype=torch.bfloat16, device="meta")
    shard = VocabShard.of_rank(8, 4096, rank=1, vocab_size=32768)
    # 262144 tokens x 8192 columns would be 2**31 elements (g: 2**30): 262143 rows fit,
    # 262016 in whole 128-token tiles
    assert TritonInvariantRunner.build(w, None, shard, None, 262144).chunk == 262016
    assert TritonInvariantRunner.build(w, None, shard, None, 100000).chunk == 100096
    assert TritonInvariantRunner.build(w, None, shard, None, None).chunk == 8192


def test_invariant_chunk_cap_is_the_same_on_every_rank():
    """Every rank of a TP group must cut the same chunks (``grads`` gathers ``g`` and the
    ``d h`` columns per chunk, ``stats`` the block statistics per group of chunks): the
    cap is set by the most real blocks a rank holds, not this rank's. Llama 3's vocab
    (128256) at TP 8: ranks 0-6 hold 63 real blocks, rank 7 holds 60 (was: 133120 tokens
    per chunk on ranks 0-6, 139008 on rank 7, so mismatched collectives past 133120)."""
    from mp_bridge.layers.loss.engines.triton_ops.invariant import TritonInvariantRunner
    from mp_bridge.layers.vocab_shards import VocabShard

    w = torch.empty((16128, 8), dtype=torch.bfloat16, device="meta")
    chunks = []
    for rank in range(8):
        shard = VocabShard.of_rank(8, 16128, rank=rank, vocab_size=128256)
        chunks.append(TritonInvariantRunner.build(w, None, shard, None, 139000).chunk)
    assert chunks == [133120] * 8, chunks
    # ranks past the vocab (no real block) too: vocab 1000 in 256-row shards at TP 8
    w = torch.empty((256, 8), dtype=torch.bfloat16, device="meta")
    chunks = []
    for rank in range(8):
        shard = VocabShard.of_rank(8, 256, rank=rank, vocab_size=1000)
        chunks.append(TritonInvariantRunner.build(w, None, shard, None, 2**24).chunk)
    assert chunks == [(2**31 - 1) // 256 // 128 * 128] * 8, chunks
