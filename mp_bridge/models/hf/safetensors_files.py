"""Reading and streaming-writing safetensors files of a ``save_pretrained`` directory.

Reading: :class:`HFFiles` opens ``model.safetensors`` or the shards listed by
``model.safetensors.index.json`` and reads *slices* of a key (``get_slice``), so a rank
reads only the rows it holds. Writing: :class:`StreamingSafetensorsWriter` writes the
header first (names, dtypes, shapes known up front), then each tensor's bytes as it
comes, so the writer holds one tensor at a time (the safetensors format: an 8-byte
little-endian header size, a JSON header of ``data_offsets``, then the bytes).
"""

from __future__ import annotations

import json
import os
import struct

import torch

__all__ = ["HFFiles", "StreamingSafetensorsWriter", "SINGLE_FILE"]

SINGLE_FILE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
}


class HFFiles:
    """The tensors of a ``save_pretrained`` directory, by on-disk key (read lazily)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        if not os.path.isdir(path):
            raise ValueError(f"{path!r} is not a directory; pass a save_pretrained directory")
        index = os.path.join(path, _INDEX)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index!r} has no weight_map; the sharded index is damaged")
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            weight_map = None
        else:
            raise ValueError(
                f"{path!r} holds neither {SINGLE_FILE} nor {_INDEX}; save the model with "
                "save_pretrained(..., safe_serialization=True)"
            )
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._handles = {}
        for name in files:
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                raise ValueError(f"{path!r}: the index names {name!r}, which is missing")
            self._handles[name] = safe_open(full, framework="pt")
        if weight_map is None:
            weight_map = {k: SINGLE_FILE for k in self._handles[SINGLE_FILE].keys()}  # noqa: SIM118
        self.file_of = weight_map

    def keys(self) -> list[str]:
        return sorted(self.file_of)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[key]].get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype of ``key`` (``ValueError`` for one without a torch name here)."""
        name = self._handles[self.file_of[key]].get_slice(key).get_dtype()
        found = [d for d, n in _DTYPES.items() if n == name]
        if not found:
            raise ValueError(f"{key} is stored as {name}; use one of {sorted(_DTYPES.values())}")
        return found[0]

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int = 0):
        """The tensor ``key``, or its rows / columns ``[start, stop)`` along ``dim`` (0/1)."""
        sl = self._handles[self.file_of[key]].get_slice(key)
        if dim is None:
            return sl[:]
        return sl[start:stop] if dim == 0 else sl[:, start:stop]


class StreamingSafetensorsWriter:
    """``with StreamingSafetensorsWriter(file, [(key, dtype, shape), ...]) as w:
    w.write(key, tensor)`` in the order given (checked)."""

    def __init__(self, filename: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header, offset = {}, 0
        for key, dtype, shape in entries:
            if dtype not in _DTYPES:
                raise ValueError(f"{key}: dtype {dtype} has no safetensors name here")
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[key] = {
                "dtype": _DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._order = [(k, d, tuple(s)) for k, d, s in entries]
        self._next = 0
        self._file = open(filename, "wb")  # noqa: SIM115 - closed by __exit__
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want, dtype, shape = self._order[self._next]
        if key != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"wrote {key} {tensor.dtype} {tuple(tensor.shape)}; the header "
                f"expects {want} {dtype} {shape} next"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().tobytes())
        self._next += 1

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if exc[0] is None and self._next != len(self._order):
            raise ValueError(f"only {self._next} of {len(self._order)} tensors were written")
