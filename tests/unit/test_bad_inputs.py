"""Single-process bad inputs: each a clear TypeError/ValueError naming the
argument; and the agreement check's pure parts (fingerprint, switches)."""

from __future__ import annotations

import math

import pytest
import torch

from mp_bridge.comm import PartitionAdapter, check_agreement, checks_enabled, fingerprint
from mp_bridge.layers import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    context_parallel_attention,
    fused_linear_cross_entropy,
    masked_count,
    masked_mean,
    vocab_parallel_cross_entropy,
)
from mp_bridge.models import MimoConfig, dp_shard


def _ce(**kwargs):
    return vocab_parallel_cross_entropy(torch.randn(3, 8), torch.tensor([0, 1, 2]), **kwargs)


def _qkv():
    return (torch.randn(1, 4, 2, 4),) * 3


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: _ce(tp_group=3), "tp_group=3"),
        (lambda: VocabParallelEmbedding(16, 4, tp_group=3), "tp_group=3"),
        (lambda: VocabParallelLMHead(4, 16, tp_group=3), "tp_group=3"),
        (lambda: PartitionAdapter(cp_group=2), "cp_group=2"),
        (lambda: PartitionAdapter(tp_group=2), "tp_group=2"),
        (lambda: context_parallel_attention(*_qkv(), cp_group=2, causal=False), "cp_group=2"),
    ],
)
def test_an_int_where_a_group_goes_is_a_type_error(call, name):
    with pytest.raises(TypeError, match=f"{name} must be a torch.distributed ProcessGroup"):
        call()


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: _ce(invariant="no"), "invariant"),
        (
            lambda: fused_linear_cross_entropy(
                torch.randn(3, 4), torch.randn(8, 4), torch.tensor([0, 1, 2]), invariant="no"
            ),
            "invariant",
        ),
        (lambda: VocabParallelEmbedding(16, 4, sequence_parallel="yes"), "sequence_parallel"),
        (lambda: VocabParallelLMHead(4, 16, sequence_parallel="yes"), "sequence_parallel"),
        (lambda: PartitionAdapter(sequence_parallel="yes"), "sequence_parallel"),
        (lambda: VocabParallelLMHead(4, 16, bias="yes"), "bias"),
    ],
)
def test_string_booleans_are_type_errors(call, name):
    with pytest.raises(TypeError, match=f"{name} must be"):
        call()


def test_negative_mask_weights_are_rejected():
    values = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"mask holds negative weight -1\.0"):
        masked_mean(values, torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="negative weight"):
        masked_count(torch.tensor([-0.5]))
    assert masked_mean(values, torch.tensor([0.0, 2.0])).item() == 2.0  # weights >= 0 pass


@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0, 0.0])
def test_bad_softmax_scale_is_a_value_error(scale):
    with pytest.raises(ValueError, match=f"softmax_scale={scale!r} must be a finite float > 0"):
        context_parallel_attention(*_qkv(), causal=False, softmax_scale=scale)


def test_bad_softmax_scale_type():
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        context_parallel_attention(*_qkv(), causal=False, softmax_scale="0.5")


@pytest.mark.parametrize("eps", [-1.0, 0.0, math.nan, math.inf])
def test_mimo_config_rejects_bad_norm_eps(eps):
    with pytest.raises(ValueError, match=f"norm_eps={eps!r} must be a finite float > 0"):
        MimoConfig(norm_eps=eps)


def test_mimo_config_rejects_a_bool_norm_eps_as_the_wrong_kind():
    with pytest.raises(TypeError, match=r"MimoConfig.norm_eps must be a float, got True"):
        MimoConfig(norm_eps=True)


def test_dp_shard_rejects_a_rank_outside_the_dp_size():
    t = torch.arange(8)
    with pytest.raises(ValueError, match=r"dp_rank=2 must be in \[0, dp_size=2\)"):
        dp_shard(t, 2, 2)
    with pytest.raises(ValueError, match=r"dp_rank=-1"):
        dp_shard(t, -1, 2)
    assert dp_shard(t, 1, 2).tolist() == [4, 5, 6, 7]


# -------------------------------------------------------------- agreement, pure parts
def test_fingerprint_sees_every_bit_and_the_order():
    x = torch.tensor([1.0, 2.0, 3.0])
    assert int(fingerprint(x)) == int(fingerprint(x.clone()))
    assert int(fingerprint(x)) != int(fingerprint(x.flip(0)))  # a permutation
    assert int(fingerprint(torch.tensor([0.0]))) != int(fingerprint(torch.tensor([-0.0])))
    y = x.clone()
    y[1] = torch.nextafter(y[1], torch.tensor(9.0))  # one ulp
    assert int(fingerprint(x)) != int(fingerprint(y))
    # Hand-computed: int64 ids 5, 7 -> 5*1 + 7*2 + numel 2 = 21.
    assert int(fingerprint(torch.tensor([5, 7]))) == 21
    for t in (torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bool)):
        assert fingerprint(t).dtype == torch.int64 and fingerprint(t).dim() == 0
    assert int(fingerprint(torch.zeros(0))) == 0
    assert int(fingerprint(x[::2])) == int(fingerprint(torch.tensor([1.0, 3.0])))  # strides


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False)])
def test_checks_enabled_reads_the_environment(monkeypatch, value, on):
    monkeypatch.setenv("MP_BRIDGE_CHECK", value)
    assert checks_enabled() is on


def test_without_a_group_the_check_is_local(monkeypatch):
    monkeypatch.setenv("MP_BRIDGE_CHECK", "1")
    check_agreement("op", None, {"n": 1})  # no group: nothing to agree with
    with pytest.raises(ValueError, match="mine"):
        check_agreement("op", None, {"n": 1}, error=ValueError("mine"))
