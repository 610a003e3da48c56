"""The rank set-up (backend, device, start method, torchrun), the test device, and
torchrun's size skip (no process group)."""

from __future__ import annotations

import pickle

import pytest
import torch

from mp_bridge.testing import DistributedWorld, current_device, device_under_test, rank_setup
from mp_bridge.testing.rank_setup import choose_start_method, resolve_setup

# (override, rank device, CUDA initialized here, CUDA available) -> method
RULE = [
    ((None, "cpu", False, False), "fork"),  # the CPU suite: fork is safe and fastest
    (("", "cpu", False, False), "fork"),  # an empty variable is no override
    ((None, "cuda", False, False), "forkserver"),  # ranks put tensors on a GPU
    ((None, "cpu", True, True), "forkserver"),  # CUDA lives in the caller
    ((None, "cpu", False, True), "forkserver"),  # a GPU machine: autograd's device threads
    (("spawn", "cpu", False, False), "spawn"),
    (("ForkServer", "cuda", True, True), "forkserver"),
    (("fork", "cuda", True, True), "fork"),  # the override is the caller's responsibility
]


@pytest.mark.parametrize("facts, method", RULE)
def test_rule(facts, method):
    override, device, initialized, available = facts
    got = choose_start_method(
        override=override,
        rank_device_type=device,
        cuda_initialized=initialized,
        cuda_available=available,
    )
    assert got == method


def test_bad_override_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"MP_BRIDGE_START_METHOD='vfork'.*'forkserver'"):
        choose_start_method(
            override="vfork", rank_device_type="cpu", cuda_initialized=False, cuda_available=False
        )


def _resolve(env, **kw):
    return resolve_setup(env, cuda_initialized=False, cuda_available=False, **kw)


def test_the_default_setup_is_cpu_gloo_fork_outside_torchrun():
    setup = _resolve({})
    assert (setup.backend, setup.device, setup.start_method) == (
        "gloo",
        torch.device("cpu"),
        "fork",
    )
    assert (setup.torchrun_world, setup.local_rank, setup.under_torchrun) == (None, 0, False)
    assert setup.device_type == "cpu"


def test_the_setup_reads_the_four_variables():
    env = {
        "MP_BRIDGE_BACKEND": "NCCL",
        "MP_BRIDGE_TEST_DEVICE": "cuda:1",
        "MP_BRIDGE_START_METHOD": "spawn",
        "TORCHELASTIC_RUN_ID": "7",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "5",
    }
    setup = _resolve(env)
    assert (setup.backend, setup.device, setup.start_method) == (
        "nccl",
        torch.device("cuda", 1),
        "spawn",
    )
    assert (setup.torchrun_world, setup.local_rank, setup.under_torchrun) == (8, 5, True)
    assert setup.device_type == "cuda"
    # without the override: NCCL ranks compute on CUDA, so no fork
    del env["MP_BRIDGE_START_METHOD"]
    assert _resolve(env).start_method == "forkserver"
    # RANK / WORLD_SIZE without torchrun's run id (run_distributed's own ranks): not torchrun
    del env["TORCHELASTIC_RUN_ID"]
    assert (_resolve(env).torchrun_world, _resolve(env).local_rank) == (None, 0)


def test_a_callers_choice_wins_over_the_variables():
    env = {"MP_BRIDGE_BACKEND": "nccl", "MP_BRIDGE_START_METHOD": "spawn"}
    setup = _resolve(env, backend="gloo", start_method="fork")
    assert (setup.backend, setup.start_method, setup.device_type) == ("gloo", "fork", "cpu")


def test_the_setup_names_a_bad_variable():
    with pytest.raises(ValueError, match=r"MP_BRIDGE_BACKEND='mpi'; use 'gloo' or 'nccl'"):
        _resolve({"MP_BRIDGE_BACKEND": "mpi"})
    with pytest.raises(ValueError, match=r"MP_BRIDGE_TEST_DEVICE='gpu' is not a test device"):
        _resolve({"MP_BRIDGE_TEST_DEVICE": "gpu"})


def test_the_setup_is_frozen_and_travels():
    setup = _resolve({"MP_BRIDGE_TEST_DEVICE": "cuda"})
    with pytest.raises(AttributeError):
        setup.backend = "nccl"
    assert pickle.loads(pickle.dumps(setup)) == setup


def test_this_machine(monkeypatch):
    monkeypatch.delenv("MP_BRIDGE_START_METHOD", raising=False)
    monkeypatch.delenv("MP_BRIDGE_TEST_DEVICE", raising=False)
    want = "forkserver" if torch.cuda.is_available() else "fork"
    assert rank_setup().start_method == want
    assert rank_setup(backend="nccl").start_method == "forkserver"
    assert rank_setup().context().get_start_method() == want
    monkeypatch.setenv("MP_BRIDGE_START_METHOD", "spawn")
    assert rank_setup().start_method == "spawn"


@pytest.mark.parametrize(
    "value, device",
    [("", "cpu"), ("cpu", "cpu"), ("cuda", "cuda:0"), ("CUDA:1", "cuda:1"), (" cuda ", "cuda:0")],
)
def test_test_device(monkeypatch, value, device):
    monkeypatch.setenv("MP_BRIDGE_TEST_DEVICE", value)
    assert device_under_test() == torch.device(device)
    assert current_device() == torch.device(device)  # no process group: not NCCL


@pytest.mark.parametrize("value", ["gpu", "mps", "cuda:x"])
def test_bad_test_device(monkeypatch, value):
    monkeypatch.setenv("MP_BRIDGE_TEST_DEVICE", value)
    with pytest.raises(ValueError, match=r"MP_BRIDGE_TEST_DEVICE=.*use 'cpu', 'cuda' or 'cuda:N'"):
        device_under_test()


# A world built on import travels by reference; one built in a function cannot travel.
module_world = DistributedWorld(2)


@module_world.case
def case_returns_rank():
    return 0


def test_module_world_pickles_as_a_reference_to_itself():
    assert pickle.loads(pickle.dumps(module_world)) is module_world


def test_function_world_refuses_to_travel_and_says_why():
    local = DistributedWorld(2)
    with pytest.raises(TypeError, match="built inside a function.*module level"):
        pickle.dumps(local)


def test_torchrun_skips_a_world_of_another_size(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    for _ in range(2):  # the second test of the same world skips too (it was a failure)
        with pytest.raises(pytest.skip.Exception, match="needs 2 ranks, torchrun launched 8"):
            module_world.check("case_returns_rank")
