"""``chunk_size`` means one thing in every engine and mode: the number of tokens whose
logits exist at once (issue 42).

Each engine is watched where it makes logits (the matmul or kernel that produces them),
on CPU: the torch engine's chunk runners, the triton engine's default-mode GEMMs
(``mm_f32``) and invariant-mode statistics / gradient kernels (under
``TRITON_INTERPRET=1``). Rounding is as each engine documents it: exact in both default
modes, up to ``TOKEN_TILE`` (128) in the torch invariant mode, up to a multiple of ``lcm(row_tile,
TILE_K)`` (64 in fp32, 128 in bf16 / fp16) in the triton invariant mode. An engine that cannot
bound it is refused by name and never picked by ``"auto"`` (``EngineCaps.chunk_size``).

Tolerance: the chunked triton default mode against the unchunked one, fp32, ``N = 13``,
``H = 8``, ``V = 300``: the slabs and the ``d W`` sum order differ (fp32 sums of <= 300
terms), so 1e-5 relative / absolute, 10x the differences seen; a wrong chunk (a missing or
doubled token, a stale slab) moves values by >= 1e-2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.triton_engine import run, triton_loss  # isort: split

from mp_bridge.layers import fused_linear_cross_entropy  # noqa: E402
from mp_bridge.layers.loss.engines.protocol import choose_engine  # noqa: E402
from mp_bridge.layers.loss.engines.registry import ENGINE_CAPS  # noqa: E402
from mp_bridge.layers.loss.engines.torch_ops import default, invariant  # noqa: E402
from mp_bridge.layers.loss.engines.triton_ops import default as triton_default  # noqa: E402
from mp_bridge.layers.loss.engines.triton_ops import invariant as triton_invariant  # noqa: E402

N, H, V = 13, 8, 300
TOL = dict(rtol=1e-5, atol=1e-5)


def _data():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    target = torch.randint(0, V, (N,), generator=g)
    target[2] = -100
    return hidden, weight, target


def _watch(monkeypatch, module, name, rows_of):
    """Record ``rows_of(args)`` of every call of ``module.name``."""
    seen, inner = [], getattr(module, name)

    def spy(*args, **kw):
        seen.append(rows_of(args))
        return inner(*args, **kw)

    monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 64])
def test_the_triton_default_mode_holds_logits_of_chunk_size_tokens(monkeypatch, chunk):
    hidden, weight, target = _data()
    want = run(lambda h, w, t: triton_loss("ce", h, w, t, label_smoothing=0.1), hidden,
               weight, target)  # fmt: skip
    # the logits GEMMs h [C, H] @ W_s^T [H, Vs] (not d W's g^T [Vs, C] @ h [C, H])
    calls = _watch(monkeypatch, triton_default, "mm_f32", lambda a: (a[0].shape, a[1].shape))

    got = run(lambda h, w, t: triton_loss("ce", h, w, t, label_smoothing=0.1, chunk_size=chunk),
              hidden, weight, target)  # fmt: skip
    # forward and backward: every logits GEMM over at most `chunk` tokens, all covered
    rows = [x[0] for x, y in calls if y[0] == H]
    assert max(rows) == min(chunk, N)
    assert sum(rows) == 2 * N * len(range(0, V, triton_default.slab_rows(min(chunk, N), V)))
    for a, b in zip((*got[0], *got[1:]), (*want[0], *want[1:])):
        if chunk >= N:  # one chunk: the unchunked call, bit for bit
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, **TOL)


def test_the_torch_engine_holds_chunk_size_tokens_exact_by_default_tiles_invariant(monkeypatch):
    hidden, weight, target = _data()
    for module, runner, is_invariant, want in (
        (default, default.TorchDefaultRunner, False, [5, 5, 3]),
        (invariant, invariant.TorchInvariantRunner, True, [13]),  # 128-token tiles
    ):
        seen = []
        inner = runner.forward_chunk

        def spy(self, h, *args, _inner=inner, _seen=seen, **kw):
            _seen.append(h.shape[0])
            return _inner(self, h, *args, **kw)

        monkeypatch.setattr(runner, "forward_chunk", spy)
        fused_linear_cross_entropy(
            hidden, weight, target, chunk_size=5, invariant=is_invariant, engine="torch"
        )
        assert seen == want, module.__name__


def test_the_triton_invariant_mode_rounds_chunk_size_up_to_its_tile(monkeypatch):
    _, weight, _ = _data()
    n = 140  # fp32: chunk_size=70 rounded up to 128 (a multiple of lcm(32, 64) = 64)
    g = torch.Generator().manual_seed(8)
    h, t = torch.randn(n, H, generator=g), torch.randint(0, V, (n,), generator=g)
    stats = _watch(monkeypatch, triton_invariant, "block_stats", lambda a: a[0].shape[0])
    grads = _watch(monkeypatch, triton_invariant, "block_grad", lambda a: a[0].shape[0])
    run(lambda a, b, c: triton_loss("ce", a, b, c, invariant=True, chunk_size=70), h, weight, t)
    assert stats == [128, 12] and grads == [128, 12]


def test_an_engine_that_cannot_bound_chunk_size_is_refused_by_name_and_never_auto(monkeypatch):
    hidden, weight, _ = _data()
    inputs = (("hidden", tuple(hidden.shape), torch.bfloat16),
              ("weight", tuple(weight.shape), torch.bfloat16))  # fmt: skip
    cuda = torch.device("cuda")  # the choice reads the device type only
    assert all(caps.chunk_size for caps in ENGINE_CAPS.values())  # every engine today
    assert choose_engine("auto", inputs, cuda, 64) == "triton"
    no_chunks = dataclasses.replace(ENGINE_CAPS["triton"], chunk_size=False)
    monkeypatch.setitem(ENGINE_CAPS, "triton", no_chunks)
    assert choose_engine("auto", inputs, cuda) == "triton"  # no chunk_size given: picked
    assert choose_engine("auto", inputs, cuda, 64) == "torch"
    with pytest.raises(ValueError, match=r"engine='triton' cannot run this call: chunk_size=64"):
        choose_engine("triton", inputs, cuda, 64)
