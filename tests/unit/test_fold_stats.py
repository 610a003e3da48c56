"""``fold_stats``: the invariant mode's one-launch fold of the per-block statistics.

1. The root against ``tree.fold_tree`` of the same fp32 leaves merged in float64
   (``formulas.combine_stats``), for ``K = 1, 2, 3, 5, 8, 10, 513`` and ``S = 4, 5, 6``.
   Tolerance: ``m`` exact (a max); every other statistic within ``1e-5`` of the sum of its
   terms' magnitudes (``sum_k |x_k|``, plus ``sum_k s_k`` for ``u``, whose moved terms
   ``d_k s_k exp(d_k)`` are at most ``s_k / e``): an fp32 tree of depth ``D <= 10`` errs
   by at most about ``(2 D + 2) 2**-24 = 1.3e-6`` of it.
2. The tree is the canonical one, in bits: the root of ``K`` leaves is the kernel's
   two-leaf merge of the roots of ``[0, 2**(D-1))`` and ``[2**(D-1), K)``.
3. The rank-major all-gathered layout of every TP size gives the flat layout's bits (the
   rank slots past a rank's real blocks hold NaN and are never read).
4. The kernel compiles for sm_90 as launched: no spills, pinned options, no FMA.

Kernels under ``TRITON_INTERPRET=1`` without CUDA (``tests.triton_engine``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_engine import DEVICE  # isort: split

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK, BlockLayout  # noqa: E402
from mp_bridge.layers.loss.engines.triton_ops.fold_stats import fold_stats  # noqa: E402
from mp_bridge.layers.loss.formulas import LossSpec, combine_stats  # noqa: E402
from mp_bridge.layers.loss.tree import fold_tree, tree_depth  # noqa: E402
from mp_bridge.layers.vocab_shards import VocabShard, vocab_shard_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
C = 67  # token columns: two programs of 64, the second masked
SPECS = {
    4: LossSpec.cross_entropy(1000, -100, 0.1, z_loss_weight=1e-2),
    5: LossSpec.logprob(1000, 1.0, entropy=True),
    6: LossSpec.logprob(1000, 1.0, entropy=True, sum_pi_squared=True),
}


def _leaves(spec: LossSpec, k: int, seed: int = 0) -> torch.Tensor:
    """``[S, K, C]`` fp32 block statistics shaped like ``block_stats``'s: max ``m``, ``s in
    [1, 256]``, one target block per column, ``u``, ``q in [1, s]``; column 0 all-masked
    (every block the identity) and column 1 with one all-masked block."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(k, C, generator=g) * 3
    s = 1 + 255 * torch.rand(k, C, generator=g)
    t = torch.zeros(k, C)
    t[torch.randint(0, k, (C,), generator=g), torch.arange(C)] = torch.randn(C, generator=g)
    planes = [m, s, t, torch.randn(k, C, generator=g) * 16]
    if spec.entropy:
        planes.append(-s * torch.rand(k, C, generator=g) * 4)
    if spec.sum_pi_squared:
        planes.append(1 + (s - 1) * torch.rand(k, C, generator=g))
    x = torch.stack(planes)
    x[:, :, 0] = 0.0
    x[0, :, 0] = -torch.inf
    x[:, k // 2, 1] = 0.0
    x[0, k // 2, 1] = -torch.inf
    return x.contiguous()


def _fold(x: torch.Tensor, spec: LossSpec, num_real=None) -> torch.Tensor:
    return fold_stats(x.to(DEVICE), spec, num_real).cpu()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 10, 513])
@pytest.mark.parametrize("s", [4, 5, 6])
def test_root_matches_the_float64_tree(k, s):
    if k == 513 and s != 6:
        pytest.skip("K = 513 once (interpreted: seconds per call)")
    spec = SPECS[s]
    x = _leaves(spec, k, seed=k)
    got = _fold(x, spec)
    x64 = x.double()

    def combine(a, b):
        return combine_stats(a, b, sum_pi_squared=spec.sum_pi_squared)

    ref = fold_tree({(0, j): x64[:, j] for j in range(k)}, k, combine)
    assert got.shape == (s, C) and got.dtype == torch.float32
    assert torch.equal(got[0], ref[0].float()), "m is a max: exact"
    scale = x64.abs().sum(dim=1)
    if spec.entropy:
        scale[4] += x64[1].sum(dim=0)
    err = (got.double() - ref).abs()
    assert (err[1:] <= 1e-5 * scale[1:]).all(), (err[1:] / scale[1:]).amax(dim=1)
    assert torch.equal(got[:, 0], torch.tensor([-torch.inf] + [0.0] * (s - 1))), "identity"


@pytest.mark.parametrize("k", [3, 5, 10, 17, 33, 100])
def test_the_tree_is_the_canonical_one_in_bits(k):
    spec = SPECS[6]
    x = _leaves(spec, k, seed=100 + k)
    half = 1 << (tree_depth(k) - 1)
    left, right = _fold(x[:, :half].contiguous(), spec), _fold(x[:, half:].contiguous(), spec)
    assert torch.equal(_fold(x, spec), _fold(torch.stack([left, right], dim=1), spec))
    # one leaf: the root is the leaf itself, every bit (carried, never merged)
    one = _fold(x[:, :1].contiguous(), spec)
    assert torch.equal(one, x[:, 0])


@pytest.mark.parametrize("vocab", [1000, 3 * VOCAB_BLOCK, 37 * VOCAB_BLOCK - 5])
def test_the_gathered_layout_of_every_tp_gives_the_flat_bits(vocab):
    from mp_bridge.layers.loss.engines.triton_ops.invariant import TritonInvariantRunner

    spec = SPECS[5]
    k = -(-vocab // VOCAB_BLOCK)
    x = _leaves(spec, k, seed=vocab)
    flat = _fold(x, spec)
    for tp in (1, 2, 3, 4, 5, 8):
        v_local = vocab_shard_size(vocab, tp, multiple=VOCAB_BLOCK)
        slabs, slots = [], None
        for rank in range(tp):
            shard = VocabShard.of_rank(tp, v_local, rank=rank, vocab_size=vocab)
            lay = BlockLayout.of_shard(shard)
            runner = TritonInvariantRunner.build(torch.empty(v_local, 1), None, shard, spec, None)
            slots = runner._slots if tp > 1 else lay.num_local
            slab = torch.full((spec.num_stats, slots, C), torch.nan)
            slab[:, : lay.num_local] = x[:, lay.first : lay.first + lay.num_local]
            slabs.append(slab)
        gathered = torch.stack(slabs).contiguous()
        assert torch.equal(_fold(gathered, spec, k), flat), f"tp={tp} ({slots} slots)"


_COMPILE = """
import json, torch, triton
from triton.backends.compiler import GPUTarget
from tests.triton_facts import facts, launch_source
from mp_bridge.layers.loss.engines.triton_ops import fold_stats as fs
from mp_bridge.layers.loss.formulas import LossSpec
out = {}
for spec in (LossSpec.cross_entropy(131072, -100, 0.0),
             LossSpec.logprob(131072, 1.0, entropy=True, sum_pi_squared=True)):
    x = torch.empty((spec.num_stats, 512, 8192), device="meta")
    src, opts = launch_source(fs._fold_stats_kernel, lambda: fs.fold_stats(x, spec))
    f = facts(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts), opts)
    out[spec.num_stats] = {k: f[k] for k in ("stack", "ldl_stl", "fma", "regs", "options")}
print(json.dumps(out))
"""


def test_the_kernel_compiles_for_sm90_without_spills():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for s, f in json.loads(out.stdout.strip().splitlines()[-1]).items():
        assert f["stack"] == 0 and f["ldl_stl"] == 0, f"S={s} spills: {f}"
        assert f["fma"] == 0, f"S={s}: fma.rn in the PTX"
        assert f["options"] == {"num_warps": 2, "num_stages": 1, "enable_fp_fusion": False}
