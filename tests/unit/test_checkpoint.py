"""Checkpoints in one process (no process group): the pure pieces, a save -> load round
trip, and every bad input with its message.

Expected values are written by hand (row lists, the tensors a step produced) or are the
model's own tensors read before the save: a load must give them back bit for bit.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from mp_bridge.checkpoint import FORMAT_VERSION, CheckpointInfo, load, save
from mp_bridge.checkpoint.info import INFO_FILE
from mp_bridge.checkpoint.publish import clean_leftovers, publish, resolve, staging_dir
from mp_bridge.layers import ShardPiece, ShardSpec, VocabParallelEmbedding, mark_sharded
from mp_bridge.models import MimoConfig, ReferenceMimo, gather_full_state, load_full_state

CFG = MimoConfig()


# ------------------------------------------------------------------ pure pieces
def test_pieces_of_a_padded_vocab_and_of_fused_parts():
    vocab = ShardSpec(0, None, 1001)
    assert vocab.pieces(251, size=4, rank=0) == (ShardPiece(0, 0, 251),)
    assert vocab.pieces(251, size=4, rank=3) == (ShardPiece(0, 753, 248),)  # 3 padding rows
    assert ShardSpec(0, None, 5).pieces(4, size=4, rank=3) == ()  # only padding
    fused = ShardSpec(0, None, 8, parts=2)  # [gate; up], 4 rows each, TP 2
    assert fused.pieces(4, size=2, rank=0) == (ShardPiece(0, 0, 2), ShardPiece(2, 4, 2))
    assert fused.pieces(4, size=2, rank=1) == (ShardPiece(0, 2, 2), ShardPiece(2, 6, 2))


def test_fused_parameter_loads_and_gathers_part_by_part():
    p = mark_sharded(nn.Parameter(torch.zeros(8, 1)), dim=0, group=None, full_size=8, parts=2)
    full = torch.arange(8.0).view(8, 1)
    load_full_state(nn.ParameterDict({"w": p}), {"w": full})
    assert p.flatten().tolist() == list(range(8))  # one rank: every row, in order
    assert torch.equal(gather_full_state(nn.ParameterDict({"w": p}))["w"], full)


def test_mark_sharded_refuses_parts_that_do_not_split():
    with pytest.raises(ValueError, match=r"parts=3 does not split full_size=8"):
        mark_sharded(nn.Parameter(torch.zeros(8, 2)), dim=0, group=None, full_size=8, parts=3)


def test_publish_keeps_one_whole_checkpoint_and_a_cut_publication_is_found(tmp_path):
    path = str(tmp_path / "ck")
    for token, step in (("a", 1), ("b", 2)):
        staging = staging_dir(path, token)
        os.makedirs(staging)
        with open(os.path.join(staging, INFO_FILE), "w") as f:
            f.write(str(step))
        publish(staging, path, token)
        assert open(os.path.join(path, INFO_FILE)).read() == str(step)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the old copy is gone
    # A publication cut between its renames: the whole one sits beside the path.
    os.rename(path, str(tmp_path / ".ck.old-c"))
    os.makedirs(staging_dir(path, "d"))  # a dead save's partial write (no info file)
    assert resolve(path) == str(tmp_path / ".ck.old-c")
    clean_leftovers(path)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert open(os.path.join(path, INFO_FILE)).read() == "2"


# ------------------------------------------------------------------ round trip
class Toy(nn.Module):
    """A padded vocab layer (1001 rows on 4 "ranks" of 251), a fused [gate; up] weight,
    and a replicated norm, all in one process."""

    def __init__(self, vocab: int = 1001, hidden: int = 8):
        super().__init__()
        self.embed = VocabParallelEmbedding(vocab, hidden, multiple=251)
        self.gate_up = mark_sharded(
            nn.Parameter(torch.zeros(32, hidden)), dim=0, group=None, full_size=32, parts=2
        )
        self.norm = nn.LayerNorm(hidden)


def _trained(seed: int = 0) -> tuple[Toy, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Toy()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model.embed.weight[1001:] = 0
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model.embed.weight.grad[1001:] = 0  # padding rows get no gradient, as in a real step
    opt.step()
    return model, opt


def test_round_trip_restores_weights_adam_state_lr_rng_and_stateful(tmp_path):
    model, opt = _trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()  # a second step (same gradients), then the schedule halves the lr
    sched.step()
    torch.manual_seed(11)
    path = str(tmp_path / "ck")
    save(path, model, opt, step=5, extra={"run": "a"}, stateful={"sched": sched})
    draws = (torch.rand(3), random.random(), float(np.random.rand()))  # the run's next draws
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}

    other, other_opt = _trained(seed=1)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=1, gamma=0.5)
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    info = load(path, other, other_opt, stateful={"sched": other_sched})
    again = (torch.rand(3), random.random(), float(np.random.rand()))
    assert torch.equal(again[0], draws[0]) and again[1:] == draws[1:]  # RNG restored
    assert info == CheckpointInfo(
        step=5, extra={"run": "a"}, format_version=FORMAT_VERSION, world_size=1,
        group_sizes={"embed.weight": 1, "gate_up": 1}, grids={}, has_optimizer=True,
        optimizer="torch.optim.adamw.AdamW", path=path,
    )  # fmt: skip
    for k, v in other.state_dict().items():
        assert torch.equal(v, weights[k]), k
    loaded = other_opt.state_dict()
    assert loaded["param_groups"][0]["lr"] == 0.05  # the scheduler had halved it
    for k, s in loaded["state"].items():
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}
        for n, t in s.items():
            assert torch.equal(t, state[k][n]), (k, n)
    assert other_sched.state_dict() == sched.state_dict()


def test_model_only_load_of_a_checkpoint_with_optimizer_state(tmp_path):
    model, opt = _trained()
    save(tmp_path / "ck", model, opt)
    other = Toy()
    load(tmp_path / "ck", other)
    assert torch.equal(other.gate_up, model.gate_up)


def test_padding_rows_never_reach_the_disk_and_are_zero_after_a_load(tmp_path):
    model, _ = _trained()
    save(tmp_path / "ck", model)
    from mp_bridge.checkpoint.load import read_checkpoint

    _, metadata = read_checkpoint(str(tmp_path / "ck"))
    assert tuple(metadata.state_dict_metadata["model.embed.weight"].size) == (1001, 8)
    other = Toy()
    with torch.no_grad():
        other.embed.weight.fill_(3.0)
    load(tmp_path / "ck", other)
    assert other.embed.weight.shape == (1004, 8)
    assert not other.embed.weight[1001:].any()


def test_reference_mimo_prefix_load_of_one_part(tmp_path):
    torch.manual_seed(0)
    mimo = ReferenceMimo(CFG)
    save(tmp_path / "ck", mimo)
    torch.manual_seed(1)
    llm = ReferenceMimo(CFG).llm
    load(tmp_path / "ck", llm, prefix="llm.")
    for k, v in llm.state_dict().items():
        assert torch.equal(v, mimo.state_dict()[f"llm.{k}"]), k


def test_save_never_steps_or_initializes_the_optimizer(tmp_path):
    model = Toy()
    opt = torch.optim.Adam(model.parameters())
    before = [p.clone() for p in model.parameters()]
    save(tmp_path / "ck", model, opt)
    assert not opt.state  # DCP's get_optimizer_state_dict would have stepped it
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    other = Toy()
    other_opt = torch.optim.Adam(other.parameters())
    load(tmp_path / "ck", other, other_opt)  # a checkpoint of a never-stepped optimizer
    assert not other_opt.state


# ------------------------------------------------------------------ bad inputs
@pytest.fixture
def saved(tmp_path) -> str:
    model, opt = _trained()
    save(tmp_path / "ck", model, opt, step=3)
    return str(tmp_path / "ck")


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at '.*nowhere'"):
        load(tmp_path / "nowhere", Toy())


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"'.*plain' is not a checkpoint: it has no mp_bridge"):
        os.makedirs(tmp_path / "plain")
        load(tmp_path / "plain", Toy())


def test_a_truncated_file_is_a_damaged_checkpoint(saved):
    data = [f for f in os.listdir(saved) if f.endswith(".distcp")][0]
    with open(os.path.join(saved, data), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=rf"damaged checkpoint at '{saved}': {data} is 100 bytes"):
        load(saved, Toy())


def test_a_corrupt_metadata_file_is_a_damaged_checkpoint(saved):
    target = os.path.join(saved, ".metadata")
    size = os.path.getsize(target)
    with open(target, "wb") as f:
        f.write(b"\0" * size)  # same size: only unpickling finds it
    with pytest.raises(ValueError, match=r"damaged checkpoint at .*DCP metadata is unreadable"):
        load(saved, Toy())


def test_another_vocab_size_names_the_key_and_both_shapes(saved):
    with pytest.raises(
        ValueError, match=r"model\.embed\.weight: saved \(1001, 8\), expected \(1002, 8\)"
    ):
        load(saved, Toy(vocab=1002))


def test_another_hidden_size_names_every_key(saved):
    with pytest.raises(ValueError, match=r"model\.norm\.weight: saved \(8,\), expected \(6,\)"):
        load(saved, Toy(hidden=6))


def test_missing_and_unexpected_keys_are_named(saved):
    model = Toy()
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"model\.extra\.bias: saved nothing, expected \(2,\)"):
        load(saved, model)
    del model.extra, model.norm
    with pytest.raises(ValueError, match=r"model\.norm\.bias: saved \(8,\), expected nothing"):
        load(saved, model)


def test_another_layer_count_of_the_reference_mimo(tmp_path):
    save(tmp_path / "ck", ReferenceMimo(CFG))
    deeper = ReferenceMimo(MimoConfig(llm_layers=3))
    with pytest.raises(
        ValueError, match=r"model\.llm\.blocks\.2\.attn\.qkv\.weight: saved nothing"
    ):
        load(tmp_path / "ck", deeper)


def test_a_model_is_unchanged_by_a_load_that_fails(saved):
    model = Toy(hidden=6)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError):
        load(saved, model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_optimizer_load_from_a_model_only_checkpoint(tmp_path):
    save(tmp_path / "ck", Toy())
    model = Toy()
    with pytest.raises(ValueError, match=r"holds no optimizer state; pass optimizer=None"):
        load(tmp_path / "ck", model, torch.optim.Adam(model.parameters()))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(step=-1), ValueError, r"step=-1 must be an int >= 0"),
        (dict(extra={"x": object()}), ValueError, r"extra must hold JSON values"),
        (dict(async_save="yes"), TypeError, r"async_save"),
        (dict(stateful=[1]), TypeError, r"stateful must be a mapping"),
        (dict(stateful={"s": 1}), TypeError, r"stateful\['s'\] must .* state_dict\(\)"),
    ],
)
def test_bad_save_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        save(tmp_path / "ck", Toy(), **kwargs)
    assert not os.path.exists(tmp_path / "ck")


def test_bad_path_model_optimizer_and_prefix(tmp_path):
    with pytest.raises(TypeError, match=r"path must be a directory path"):
        save(3, Toy())
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got dict"):
        save(tmp_path / "ck", {})
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer"):
        save(tmp_path / "ck", Toy(), optimizer=[])
    with pytest.raises(ValueError, match=r"prefix='llm': pass the name .* followed by a dot"):
        load(tmp_path / "ck", Toy(), prefix="llm")


def test_an_undeclared_tensor_parallel_parameter_is_refused_by_name(tmp_path):
    model = Toy()
    model.gate_up.tensor_model_parallel = True  # megatron's marking...
    model.norm.weight.tensor_model_parallel = True  # ...without a ShardSpec
    with pytest.raises(ValueError, match=r"parameter 'norm\.weight' is tensor-parallel"):
        save(tmp_path / "ck", model)
    del model.norm.weight.tensor_model_parallel
    model.gate_up.partition_stride = 2
    mark_sharded(model.gate_up, dim=0, group=None, full_size=32)  # contiguous: wrong
    with pytest.raises(ValueError, match=r"'gate_up' has megatron partition_stride=2.*parts=2"):
        save(tmp_path / "ck", model)


def test_an_optimizer_over_other_parameters_is_refused(tmp_path):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a parameter of shape \(3,\)"):
        save(tmp_path / "ck", Toy(), opt)


def test_a_newer_format_is_refused(saved):
    info = os.path.join(saved, INFO_FILE)
    raw = json.load(open(info))
    raw["format_version"] = FORMAT_VERSION + 1
    json.dump(raw, open(info, "w"))
    with pytest.raises(ValueError, match=r"format version 2, newer than"):
        load(saved, Toy())


def test_sgd_momentum_round_trip(tmp_path):
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.embed.weight.grad[1001:] = 0  # padding rows get no gradient
    opt.step()
    save(tmp_path / "ck", model, opt)
    other = Toy()
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    load(tmp_path / "ck", other, other_opt)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], other_opt.state[q]["momentum_buffer"])


def test_an_optimizer_of_another_class_is_refused_by_name_and_changes_nothing(tmp_path):
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    save(tmp_path / "ck", model, opt)
    other = Toy()
    before = [p.detach().clone() for p in other.parameters()]
    adam = torch.optim.Adam(other.parameters())
    with pytest.raises(
        ValueError,
        match=r"holds the state of a torch\.optim\.sgd\.SGD, not of optimizer="
        r"torch\.optim\.adam\.Adam; pass a torch\.optim\.sgd\.SGD, or optimizer=None",
    ):
        load(tmp_path / "ck", other, adam)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    assert not adam.state
    info = load(tmp_path / "ck", other)  # the model alone loads
    assert info.optimizer == "torch.optim.sgd.SGD"


class _Refuses:
    """A stateful object whose ``load_state_dict`` raises."""

    def state_dict(self):
        return {"x": 1}

    def load_state_dict(self, state):
        raise RuntimeError("refused")


def test_a_stateful_that_fails_to_load_leaves_model_and_optimizer_unchanged(tmp_path):
    model, opt = _trained()
    save(tmp_path / "ck", model, opt, stateful={"s": _Refuses()})
    other, other_opt = _trained(seed=1)
    before = [p.detach().clone() for p in other.parameters()]
    state_before = {
        id(p): {k: v.clone() for k, v in st.items()} for p, st in other_opt.state.items()
    }
    with pytest.raises(RuntimeError, match="refused"):
        load(tmp_path / "ck", other, other_opt, stateful={"s": _Refuses()})
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    for p, st in other_opt.state.items():
        assert all(torch.equal(v, state_before[id(p)][k]) for k, v in st.items())


# ------------------------------------------------------------------ inspect
def test_inspect_prints_version_step_layout_and_every_key(saved, capsys):
    from mp_bridge.cli import main

    assert main(["checkpoint", "inspect", saved]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"checkpoint {saved}: format version {FORMAT_VERSION}, step 3, saved by 1 rank, "
        "with optimizer state\nextra: null\n"
    )
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[4:]}
    assert rows["model.embed.weight"] == ["(1001,", "8)", "torch.float32", "1"]
    assert rows["optim.gate_up.exp_avg"] == ["(32,", "8)", "torch.float32", "1"]
    assert rows["optim.gate_up.step"] == ["()", "torch.float32", "-"]
    assert rows["model.norm.bias"] == ["(8,)", "torch.float32", "-"]
    assert rows["rng.0"] == ["-", "object", "-"]


def test_inspect_of_a_missing_path_is_one_line_naming_it(tmp_path, capsys):
    from mp_bridge.cli import main

    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    assert f"no checkpoint at '{tmp_path / 'nope'}'" in capsys.readouterr().err


def test_a_load_with_an_optimizer_over_other_parameters_is_refused(saved):
    model = Toy()
    opt = torch.optim.AdamW([*model.parameters(), nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a parameter of shape \(3,\)"):
        load(saved, model, opt)
