"""Count the collectives (and bytes) a piece of code issues, for budget tests.

Wraps the ``torch.distributed`` functions our code, megatron-core and FSDP2 call through
the module attribute (``dist.all_reduce(...)``), and watches the functional collectives
(``torch.ops._c10d_functional``: what DTensor's ``redistribute`` / ``full_tensor`` and
``torch.distributed._functional_collectives`` issue, which no ``dist.<name>`` wrapper
sees) with a dispatch mode; both record into one list. Use as::

    with CollectiveCounter() as counter:
        y = bridge.communicate(x)
    assert counter.counts() == {"all_gather": 1}

The agreement check's own collectives (``MP_BRIDGE_CHECK=1``, which the test kit turns on)
are kept apart in ``counter.check_calls`` (``mp_bridge.checks.in_agreement_check`` says
when one runs): a budget is what the operation needs, not the debug check in front of it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from mp_bridge.checks import in_agreement_check

__all__ = ["CollectiveCall", "CollectiveCounter"]

# Canonical name of each wrapped function: the two spellings of one collective count alike.
_WRAPPED = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "all_gather_object": "all_gather_object",
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
}


@dataclass(frozen=True)
class CollectiveCall:
    """One observed collective: canonical name, group size and bytes this rank received
    from other ranks (``all_to_all``: its output minus the piece it sent itself)."""

    name: str
    group_size: int
    bytes_received: int


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def _received_bytes(
    name: str, args: tuple, kwargs: dict, group_size: int, group_rank: int = 0
) -> int:
    """Bytes arriving from other ranks (the payload a bandwidth bound talks about)."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name == "all_to_all":
        return _all_to_all_received(args, kwargs, group_size, group_rank)
    if name == "all_gather":
        # output holds group_size pieces; one of them is our own.
        return _tensor_bytes(first) * (group_size - 1) // max(group_size, 1)
    if name == "all_reduce":
        return _tensor_bytes(first)
    if name == "reduce_scatter":
        return _tensor_bytes(first) * (group_size - 1)
    return _tensor_bytes(first)


def _all_to_all_received(args: tuple, kwargs: dict, group_size: int, group_rank: int) -> int:
    """``all_to_all_single`` (output, input, output_split_sizes, ...) or ``all_to_all``
    (output list, input list): the output minus the piece this rank sends itself."""
    output = args[0] if args else kwargs.get("output", kwargs.get("output_tensor_list"))
    if isinstance(output, (list, tuple)):
        return sum(_tensor_bytes(t) for i, t in enumerate(output) if i != group_rank)
    total = _tensor_bytes(output)
    splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
    if not splits:  # equal split along dim 0
        return total * (group_size - 1) // max(group_size, 1)
    rows = output.shape[0] if output.dim() else 0
    row_bytes = total // rows if rows else 0
    return total - splits[group_rank] * row_bytes


#: Functional collectives (``torch.ops._c10d_functional.<op>``) -> canonical name.
#: ``wait_tensor`` is no collective; the ``_c10d_functional_autograd`` ops run these.
_FUNCTIONAL = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def _functional_call(name: str, args: tuple) -> CollectiveCall:
    """The call of functional op ``name`` with ``args`` (the group is its last string
    argument; inputs come first: a tensor, or a list for the ``_coalesced`` ops)."""
    canonical = _FUNCTIONAL[name]
    group = _c10d._resolve_process_group(next(a for a in reversed(args) if isinstance(a, str)))
    size, rank = group.size(), dist.get_rank(group)
    sent = _tensor_bytes(args[0])  # the input: this rank's piece / its whole buffer
    if canonical == "all_gather":
        received = sent * (size - 1)
    elif canonical == "reduce_scatter":
        received = sent * (size - 1) // max(size, 1)
    elif canonical == "all_to_all":  # (input, output_split_sizes, input_split_sizes, group)
        rows = args[0].shape[0] if args[0].dim() else 0
        row_bytes = sent // rows if rows else 0
        out_rows = sum(args[1]) if args[1] else rows
        own = args[1][rank] if args[1] else rows // max(size, 1)
        received = (out_rows - own) * row_bytes
    else:
        received = sent
    return CollectiveCall(canonical, size, received)


class _FunctionalCollectives(TorchDispatchMode):
    """Records ``_c10d_functional`` collectives on plain tensors. An op on DTensors is
    left to DTensor first (``NotImplemented``): the collectives it desugars into come back
    here on plain tensors, as in torch's ``CommDebugMode``."""

    def __init__(self, counter: CollectiveCounter) -> None:
        super().__init__()
        self.supports_higher_order_operators = True  # DTensor's RNG ops: passed through
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if DTensor in types:  # modes run before subclasses: let DTensor desugar first
            return NotImplemented
        packet = getattr(func, "_overloadpacket", None)
        if packet is not None and packet._qualified_op_name.startswith("_c10d_functional::"):
            name = packet._qualified_op_name.split("::", 1)[1]
            if name in _FUNCTIONAL:
                self.counter.record(_functional_call(name, args))
        return func(*args, **(kwargs or {}))


class CollectiveCounter:
    """Context manager recording every wrapped collective issued inside it (this rank)."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        #: The agreement check's collectives (not part of any budget).
        self.check_calls: list[CollectiveCall] = []
        self._saved: dict[str, Any] = {}
        self._functional: _FunctionalCollectives | None = None

    def record(self, call: CollectiveCall) -> None:
        """Add ``call`` (to ``check_calls`` while the agreement check runs)."""
        (self.check_calls if in_agreement_check() else self.calls).append(call)

    def __enter__(self) -> CollectiveCounter:
        for attr, canonical in _WRAPPED.items():
            original = getattr(dist, attr, None)
            if original is None:
                continue
            wrapper = self._wrap(original, canonical)
            self._saved[attr] = original
            setattr(dist, attr, wrapper)
            # ``P2POp`` and ``batch_isend_irecv`` test ``op is isend`` against c10d's own
            # globals (torch's pipeline schedules build ``P2POp(dist.isend, ...)``): the
            # same wrapper there keeps those checks true.
            if getattr(_c10d, attr, None) is original:
                setattr(_c10d, attr, wrapper)
        self._functional = _FunctionalCollectives(self)
        self._functional.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._functional is not None:
            self._functional.__exit__(*exc)
            self._functional = None
        for attr, original in self._saved.items():
            if getattr(_c10d, attr, None) is getattr(dist, attr):
                setattr(_c10d, attr, original)
            setattr(dist, attr, original)
        self._saved.clear()

    def _wrap(self, original: Any, canonical: str) -> Any:
        counter = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            size = dist.get_world_size(group)
            rank = dist.get_rank(group)
            nbytes = _received_bytes(canonical, args, kwargs, size, rank)
            # Inner spellings (all_gather_single -> all_gather_into_tensor) record once.
            if not getattr(counter, "_inside", False):
                counter.record(CollectiveCall(canonical, size, nbytes))
                counter._inside = True
                try:
                    return original(*args, **kwargs)
                finally:
                    counter._inside = False
            return original(*args, **kwargs)

        return wrapper

    def counts(self) -> dict[str, int]:
        """``{canonical name: number of calls}``."""
        return dict(Counter(c.name for c in self.calls))

    def bytes_received(self, name: str | None = None) -> int:
        """Total bytes received by this rank (optionally for one collective name)."""
        return sum(c.bytes_received for c in self.calls if name is None or c.name == name)
