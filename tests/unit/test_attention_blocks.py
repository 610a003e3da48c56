"""Attention's host plans by hand (runs, block pairs), the ragged image attention against
one SDPA per image, and the memory bound: S = 16384, 8 heads in a child process whose
address space is capped at 3 GiB (one fp32 score copy alone would be 8 GiB).

Tolerance (fp32, vs SDPA on the same tensors): both are fused kernels summing the
softmax in different orders (merge of two pieces vs one kernel); measured max abs error
~1e-6 on outputs of order 1 and gradients of order 10; ``atol = rtol = 1e-4`` at 16k keys
(sums of 16k terms) and 1e-5 for the small cases.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F

from mp_bridge.comm import pad_layout
from mp_bridge.layers import image_attention
from mp_bridge.layers.attention.pieces import CAUSAL, FULL, BlockPair, run_pieces
from mp_bridge.layers.attention.runs import Run, layout_runs, natural_order


def test_layout_runs_are_the_load_balanced_chunks_and_padding_is_its_own_segment():
    # plain S = 8, cp = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    layout = pad_layout(8, 2)
    assert layout_runs(layout, 0) == (Run(0, 2, 0, 0), Run(2, 2, 0, 6))
    assert layout_runs(layout, 1) == (Run(0, 4, 0, 2),)  # chunks 1, 2 are adjacent
    # packed [3, 5] at cp = 2 pads to [4, 8] (padded positions 0..3 and 4..11): doc 0 =
    # 3 real + 1 pad, doc 1 = 5 real (4..8) + 3 pad (9..11); rank 0 keeps chunks 0 and 3
    # of each: 0 | 3 (pad) and 4, 5 | 10, 11 (pad)
    packed = pad_layout(8, 2, cu_seqlens=[0, 3, 8])
    assert layout_runs(packed, 0) == (
        Run(0, 1, 0, 0), Run(1, 1, 1, 3), Run(2, 2, 2, 4), Run(4, 2, 3, 10),
    )  # fmt: skip


def test_causal_block_pairs_by_hand():
    one = (Run(0, 8, 0, 0),)
    assert run_pieces(one, one, True) == [BlockPair(0, 8, 0, 8, CAUSAL)]
    # CP 2, rank 0's chunk at positions 6..7 over natural-order keys 0..7
    assert run_pieces((Run(2, 2, 0, 6),), one, True) == [
        BlockPair(2, 4, 0, 6, FULL), BlockPair(2, 4, 6, 8, CAUSAL),
    ]  # fmt: skip
    # a key run that ends inside the query run: the rows after it see it all
    assert run_pieces((Run(0, 6, 0, 0),), (Run(10, 3, 0, 1),), True) == [
        BlockPair(1, 4, 10, 13, CAUSAL), BlockPair(4, 6, 10, 13, FULL),
    ]  # fmt: skip
    # future keys and other segments: no pair at all (no kernel launch)
    assert run_pieces((Run(0, 2, 0, 0),), (Run(0, 2, 0, 5), Run(2, 2, 1, 0)), True) == []
    assert run_pieces((Run(0, 2, 0, 4),), (Run(0, 3, 0, 0),), False) == [
        BlockPair(0, 2, 0, 3, FULL)
    ]


def test_natural_order_reorders_and_coalesces():
    runs = (Run(0, 2, 0, 0), Run(2, 2, 0, 6), Run(4, 2, 0, 2), Run(6, 2, 0, 4))
    index, merged = natural_order(runs)
    assert index.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    assert merged == (Run(0, 8, 0, 0),)
    assert natural_order((Run(0, 4, 0, 0), Run(4, 4, 1, 0)))[0] is None


def test_image_attention_equals_one_sdpa_per_image_without_a_dense_mask():
    torch.manual_seed(0)
    lengths = (5, 1, 5, 3, 1)
    q = torch.randn(1, sum(lengths), 4, 8, requires_grad=True)
    k, v = (torch.randn(1, sum(lengths), 2, 8, requires_grad=True) for _ in range(2))
    out = image_attention(q, k, v, lengths)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    ref, at = [], 0
    for n in lengths:
        qi, ki, vi = (t[:, at : at + n].transpose(1, 2) for t in (q, k, v))
        ref.append(F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True).transpose(1, 2))
        at += n
    ref = torch.cat(ref, 1)
    ref_grads = torch.autograd.grad((ref * g).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


_CHILD = """
import resource, torch, torch.nn.functional as F
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
from mp_bridge.layers import context_parallel_attention, image_attention
torch.manual_seed(0)
S, H, D = 16384, 8, 16  # d is free: one fp32 score copy is S² · H · 4 B = 8 GiB at any d
q, k, v = (torch.randn(1, S, H, D, requires_grad=True) for _ in range(3))
g = torch.randn(1, S, H, D)
out = {call}
grads = torch.autograd.grad((out * g).sum(), (q, k, v))
qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
ref = {ref}
ref_grads = torch.autograd.grad((ref * g).sum(), (qs, ks, vs))
torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
for a, b in zip(grads, ref_grads):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
print("ok")
"""
_SDPA = "F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ({})), {}).transpose(1, 2)"


def _run_capped(call: str, ref: str) -> None:
    cap = 3 * 2**30
    code = textwrap.dedent(_CHILD.format(cap=cap, call=call, ref=ref))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin", **_python_env()},
    )  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def _python_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HOME", "VIRTUAL_ENV")}


def test_16k_tokens_one_process_under_a_3_gib_address_space():
    _run_capped(
        "context_parallel_attention(q, k, v, position_ids=torch.arange(S))",
        _SDPA.format("qs, ks, vs", "is_causal=True"),
    )


def test_16k_image_tokens_under_a_3_gib_address_space():
    # 64 images of 256 tokens: one dense [T, T] bool mask alone would be 256 MiB, its fp32
    # scores 8 GiB; the per-image reference is SDPA on [64, 256] batches.
    _run_capped(
        "image_attention(q, k, v, (256,) * 64)",
        "F.scaled_dot_product_attention(*(t.view(64, 256, H, D).transpose(1, 2) for t in "
        "(qs, ks, vs))).transpose(1, 2).reshape(1, S, H, D)",
    )


def test_a_gradient_buffer_copied_into_is_zero_where_no_pair_covers_a_row():
    # Rows each in one pair get their gradient copied in, so the buffer starts uninitialized
    # but for the rows no pair covers: those (query rows 3..4 and 7, key rows 0..1) are zero.
    from mp_bridge.layers.attention.local_attention import _grad_buffer

    t = torch.full((1, 2, 8, 4), float("nan"))
    pieces = [BlockPair(0, 3, 2, 5, CAUSAL), BlockPair(5, 7, 5, 8, CAUSAL)]
    for keys, uncovered in ((False, [3, 4, 7]), (True, [0, 1])):
        buf = _grad_buffer(t, True, pieces, keys=keys)
        assert buf.dtype == t.dtype
        assert bool((buf[:, :, uncovered] == 0).all()), (keys, buf[0, 0, :, 0])
    assert torch.equal(_grad_buffer(t, False, pieces, keys=False), torch.zeros(t.shape))
