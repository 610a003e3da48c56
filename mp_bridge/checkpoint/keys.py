"""Every name a checkpoint stores a value under, made here and nowhere else.

The checkpoint's namespace (single-process parameter names; see :mod:`.entries`):

- ``model.<name>``: a parameter or persistent buffer (its unpadded global tensor);
- ``optim.<name>.<state>``: an optimizer state of parameter ``<name>`` (``exp_avg``,
  ``step``, ``momentum_buffer``; a state name has no dot);
- ``optim_group.<name>``: the hyper-parameters of the parameter's group (an object);
- ``rng.<rank>``: a rank's random-number generator states (an object);
- ``stateful.<key>.<rank>``: a rank's ``state_dict()`` of ``stateful[key]`` (an object);
- ``hf_untrained.<disk key>``: a tensor of the Hugging Face checkpoint the model was loaded
  from that no parameter holds (``model.hf_untrained``; replicated, its own name on disk).

Example: ``optim_key("llm.embed.weight", "exp_avg") == "optim.llm.embed.weight.exp_avg"``.
No collective, no I/O.
"""

from __future__ import annotations

__all__ = [
    "HF_UNTRAINED",
    "MODEL",
    "OPTIM",
    "OPTIM_GROUP",
    "hf_untrained_key",
    "model_key",
    "optim_group_key",
    "optim_key",
    "optim_param",
    "optim_state_name",
    "rng_key",
    "stateful_key",
]

MODEL, OPTIM, OPTIM_GROUP = "model.", "optim.", "optim_group."
HF_UNTRAINED = "hf_untrained."


def model_key(name: str) -> str:
    """``model.<name>``."""
    return MODEL + name


def hf_untrained_key(disk_key: str) -> str:
    """``hf_untrained.<disk key>``."""
    return HF_UNTRAINED + disk_key


def optim_key(name: str, state: str) -> str:
    """``optim.<name>.<state>``."""
    return f"{OPTIM}{name}.{state}"


def optim_group_key(name: str) -> str:
    """``optim_group.<name>``."""
    return OPTIM_GROUP + name


def rng_key(rank: int) -> str:
    """``rng.<rank>``."""
    return f"rng.{rank}"


def stateful_key(key: str, rank: int) -> str:
    """``stateful.<key>.<rank>``."""
    return f"stateful.{key}.{rank}"


def optim_state_name(key: str, name: str) -> str | None:
    """The state name of ``key`` when it is an ``optim.`` key of parameter ``name``, else
    ``None`` (``optim.a.b.exp_avg`` is ``exp_avg`` of ``a.b``, not of ``a``)."""
    head = optim_key(name, "")
    rest = key[len(head) :] if key.startswith(head) else ""
    return rest if rest and "." not in rest else None


def optim_param(key: str) -> str:
    """The parameter name of an ``optim.<name>.<state>`` key."""
    return key[len(OPTIM) :].rsplit(".", 1)[0]
