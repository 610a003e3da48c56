"""The loss seam on one process: ``engine=`` checked at the door, the ``triton`` engine
imported only when asked for or picked, an explicit engine never falling back, one
``LossOptions`` per call, an engine plugged in through the registry alone, and the loss
doors' bad tensors named before any collective.

Oracles: the ``"torch"`` engine's own outputs (a plugged-in engine that delegates to it
must give the same bits) and literal error messages.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import pytest
import torch

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from mp_bridge.layers.loss import fused, vocab_parallel
from mp_bridge.layers.loss.engines.protocol import FusedLossEngine, choose_engine, load_engine
from mp_bridge.layers.loss.engines.registry import ENGINE_CAPS, ENGINES
from mp_bridge.layers.loss.engines.torch_ops import ENGINE as TORCH_ENGINE
from mp_bridge.layers.loss.options import LossOptions

TRITON_MODULE = ENGINE_CAPS["triton"].module


def _described(*tensors, names=("hidden", "weight")):
    return tuple((n, tuple(t.shape), t.dtype) for n, t in zip(names, tensors, strict=True))


def _inputs(n=6, h=4, v=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.arange(n) % v


# ------------------------------------------------------------------- engine choice
@pytest.mark.parametrize("bad", ["cuda", "Torch", None, 1])
def test_engine_is_one_of_the_choices(bad):
    hidden, weight, target = _inputs()
    match = rf"engine={bad!r} must be one of \['auto', 'torch', 'triton'\]"
    for door in (fused_linear_cross_entropy, fused_linear_logprobs):
        with pytest.raises(ValueError, match=match):
            door(hidden, weight, target, engine=bad)


def test_triton_asked_for_without_its_module_says_how_to_install(monkeypatch):
    # None in sys.modules: the import fails as if the module (or triton) were missing.
    monkeypatch.setitem(sys.modules, TRITON_MODULE, None)
    hidden, weight, target = _inputs()
    with pytest.raises(ImportError, match=r"engine='triton' is unavailable.*pip install triton"):
        fused_linear_cross_entropy(hidden, weight, target, engine="triton")


def test_auto_is_torch_on_cpu_and_the_same_bits():
    hidden, weight, target = _inputs()
    assert choose_engine("auto", _described(hidden, weight), hidden.device) == "torch"
    auto = fused_linear_logprobs(hidden, weight, target)
    torch_ = fused_linear_logprobs(hidden, weight, target, engine="torch")
    assert torch.equal(auto, torch_)


def test_auto_on_cuda_without_triton_warns_and_runs_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, TRITON_MODULE, None)
    hidden, weight, _ = _inputs()
    with pytest.warns(UserWarning, match=r"engine='auto' runs the 'torch' engine on CUDA"):
        assert choose_engine("auto", _described(hidden, weight), torch.device("cuda")) == "torch"


def test_auto_reads_the_capabilities_and_an_explicit_engine_checks_them(monkeypatch):
    # Data, not code: the device types and dtypes of ENGINE_CAPS decide, before any import.
    hidden, weight, _ = _inputs()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fp64 = _described(hidden.double(), weight.double())
    assert choose_engine("auto", fp64, cuda) == "torch"  # no triton import tried
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert ENGINE_CAPS["triton"].unsupported(cpu, (torch.float32,)) == (
        "cpu tensors (it runs cuda tensors (cpu only under TRITON_INTERPRET=1))"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ENGINE_CAPS["triton"].unsupported(cpu, (torch.float32,)) is None
    assert ENGINE_CAPS["torch"].unsupported(cpu, (torch.float64,)) is None


_NO_TRITON = """
import importlib.abc, sys, traceback

attempts = []

class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton" or name.startswith(sys.argv[1]):
            # the frame that ran the import statement: the first outside importlib
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
            attempts.append((name, frames[-1].filename))
        return None

sys.meta_path.insert(0, Spy())
import torch
from mp_bridge.layers import fused_linear_cross_entropy, fused_linear_logprobs
h, w, t = torch.randn(5, 4, requires_grad=True), torch.randn(8, 4), torch.arange(5)
fused_linear_cross_entropy(h, w, t, engine="torch").backward()
fused_linear_logprobs(h, w, t, invariant=True).sum().backward()  # "auto" on CPU
ours = [a for a in attempts if a[0].startswith(sys.argv[1]) or "mp_bridge" in a[1]]
assert not ours, ours
print("ok", len(attempts))
"""


def test_torch_engine_never_imports_triton():
    """No ``mp_bridge`` import statement reaches ``triton`` or the triton engine module
    (megatron-core may import ``triton`` itself: those attempts are not ours)."""
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _NO_TRITON, TRITON_MODULE],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-2000:]


# ----------------------------------------------------------------- plugging in
class _Delegating:
    """A plugged-in engine: records its calls and runs the torch engine."""

    name = "triton"

    def __init__(self, missing=None):
        self.missing, self.calls = missing, []

    def unsupported(self, inputs):
        return self.missing

    def loss(self, hidden, weight, target, temperature, options):
        self.calls.append((tuple(hidden.shape), tuple(target.shape), temperature, options))
        return TORCH_ENGINE.loss(hidden, weight, target, temperature, options)


def _plug(monkeypatch, engine) -> None:
    module = types.ModuleType(TRITON_MODULE)
    module.ENGINE = engine
    monkeypatch.setitem(sys.modules, TRITON_MODULE, module)


def test_an_engine_plugs_in_through_the_registry_alone(monkeypatch):
    engine = _Delegating()
    _plug(monkeypatch, engine)
    assert isinstance(engine, FusedLossEngine) and isinstance(TORCH_ENGINE, FusedLossEngine)
    hidden, weight, target = _inputs(6)
    hidden, target = hidden.view(2, 3, 4), target.view(2, 3)
    kw = dict(temperature=torch.linspace(0.5, 2.0, 6).view(2, 3), return_entropy=True)
    lp, ent = fused_linear_logprobs(hidden, weight, target, engine="triton", **kw)
    ref = fused_linear_logprobs(hidden, weight, target, engine="torch", **kw)
    assert lp.shape == (2, 3) and torch.equal(lp, ref[0]) and torch.equal(ent, ref[1])
    fused_linear_logprobs(hidden, weight, target, **kw)  # "auto" on CPU: not the plug-in
    assert len(engine.calls) == 1
    h_shape, t_shape, temp, options = engine.calls[0]  # the tokens flattened
    assert (h_shape, t_shape, temp.shape, temp.dtype) == ((6, 4), (6,), (6,), torch.float32)
    assert options.engine == "triton" and options.spec.entropy


def test_an_explicit_engine_never_falls_back(monkeypatch):
    # An input the asked-for engine cannot run is a ValueError naming the reason, raised
    # by the parse (before the agreement and any collective); "auto" picks another engine.
    engine = _Delegating(missing="weight (8, 4) of 2**31 or more elements (int32 offsets)")
    _plug(monkeypatch, engine)
    hidden, weight, target = _inputs()
    match = (
        r"engine='triton' cannot run this call: weight \(8, 4\) of 2\*\*31 or more elements "
        r"\(int32 offsets\); pass engine='auto'"
    )
    for door in (fused_linear_cross_entropy, fused_linear_logprobs):
        with pytest.raises(ValueError, match=match):
            door(hidden, weight, target, engine="triton")
    assert engine.calls == []
    auto = fused_linear_cross_entropy(hidden, weight, target, label_smoothing=0.1)
    ref = fused_linear_cross_entropy(hidden, weight, target, label_smoothing=0.1, engine="torch")
    assert torch.equal(auto, ref) and engine.calls == []


# -------------------------------------------------------------- the options object
def _options_of(monkeypatch, module, call) -> LossOptions:
    seen = []
    parse = module.parse_loss_options

    def spy(kind, **args):
        seen.append(parse(kind, **args))
        return seen[-1]

    monkeypatch.setattr(module, "parse_loss_options", spy)
    call()
    assert len(seen) == 1
    return seen[0]


def test_every_door_parses_into_one_frozen_options_object(monkeypatch):
    hidden, weight, target = _inputs()
    logits = hidden @ weight.t()
    doors = [
        (vocab_parallel, lambda: vocab_parallel_cross_entropy(logits, target), "ce"),
        (vocab_parallel, lambda: vocab_parallel_logprobs(logits, target), "logprob"),
        (vocab_parallel, lambda: vocab_parallel_entropy(logits), "entropy"),
        (fused, lambda: fused_linear_cross_entropy(hidden, weight, target), "ce"),
        (fused, lambda: fused_linear_logprobs(hidden, weight, target), "logprob"),
    ]
    for module, call, kind in doors:
        options = _options_of(monkeypatch, module, call)
        assert isinstance(options, LossOptions) and options.kind == kind
        with pytest.raises(dataclasses.FrozenInstanceError):
            options.reduction = "sum"
        fields = options.fields()
        # compared by value: small values only (tensors by their bits, no group, no offset)
        assert not any(isinstance(v, torch.Tensor) for v in fields.values())
        assert {"tp_group", "shard", "target", "token_temperature"}.isdisjoint(fields)
        inputs = ("hidden", "weight") if module is fused else ("logits",)
        assert [k for k in fields if k.endswith(".shape")] == [f"{n}.shape" for n in inputs]
        assert {"spec", "reduction", "invariant", "engine", "chunk"} <= set(fields)
        assert fields["engine"] == "torch"
        # any number of fields fits the agreement's fixed row (pack_row folds the ones past
        # its slots: tests/unit/test_checks_agree.py), so the options have room to grow


def test_load_engine_reads_the_options(monkeypatch):
    hidden, weight, target = _inputs()
    options = _options_of(
        monkeypatch, fused, lambda: fused_linear_cross_entropy(hidden, weight, target)
    )
    assert load_engine(options) is TORCH_ENGINE and options.engine_reduction == "mean"
    assert ENGINES == ("auto", *ENGINE_CAPS)


# ----------------------------------------------------------------- bad tensors
def test_meta_tensors_are_named_before_any_collective():
    target = torch.tensor([0, 1, 2])
    meta = torch.empty(3, 8, device="meta")
    with pytest.raises(
        ValueError, match=r"logits is a meta tensor \(device='meta', shape \(3, 8\)"
    ):
        vocab_parallel_cross_entropy(meta, target)
    with pytest.raises(ValueError, match=r"target is a meta tensor"):
        vocab_parallel_cross_entropy(torch.randn(3, 8), target.to("meta"))
    hidden, weight, target = _inputs(3)
    with pytest.raises(ValueError, match=r"hidden is a meta tensor"):
        fused_linear_cross_entropy(hidden.to("meta"), weight.to("meta"), target)
    with pytest.raises(ValueError, match=r"weight is a meta tensor"):
        fused_linear_cross_entropy(hidden, weight.to("meta"), target)


def test_an_empty_weight_shard_blames_weight():
    hidden, _, target = _inputs(3)
    match = r"weight must be this rank's vocab shard \[V_local, H\] with V_local >= 1, got \(0, 4\)"
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(hidden, torch.randn(0, 4), target)
