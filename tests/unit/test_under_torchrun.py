"""under_torchrun: torchrun's TORCHELASTIC_RUN_ID decides, not RANK/WORLD_SIZE alone."""

from __future__ import annotations

import pytest

from mp_bridge.testing import under_torchrun

_KEYS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, False),
        ({"RANK": "0", "WORLD_SIZE": "2"}, False),  # run_distributed ranks, env:// users
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, True),  # torchrun
        ({"TORCHELASTIC_RUN_ID": "x"}, False),  # incomplete: callers need RANK/WORLD_SIZE
    ],
)
def test_criterion(monkeypatch, env, expected):
    for key in _KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert under_torchrun() is expected
