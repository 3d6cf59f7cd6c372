"""A GGUF file's metadata and tensor index, read in one pass over its header.

``gguf.GGUFReader`` builds a memory-mapped view for every part of every metadata field, which takes
seconds on a file with a 50k-token vocabulary; loading needs the header once per start, so it is read
here with ``struct`` instead (little-endian GGUF v2/v3), and each tensor's bytes are a slice of one
read-only memory map of the file. A tensor's ``data`` is its stored rows as uint8 [..., bytes per row],
what ``gguf.quants.dequantize`` takes for every type.
"""
from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class TensorInfo(NamedTuple):
    """One tensor of the file: ``shape`` in ggml's order (the row length first), as GGUFReader's."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 [..., bytes per row], read-only


class GGUFFile(NamedTuple):
    fields: dict[str, Any]  # metadata key -> value (numbers, strings, lists)
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALARS:
            raise ValueError(f"GGUF metadata value type {kind} is not one of the GGUF spec's (0-12)")
        return self.unpack(_SCALARS[kind])

    def array(self) -> list[Any]:
        kind, n = self.unpack("<I"), self.unpack("<Q")
        if kind in _NUMPY:  # numbers in one read
            arr: np.ndarray = np.frombuffer(self.buf, dtype=_NUMPY[kind], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        return [self.value(kind) for _ in range(n)]


def read_gguf(path: str) -> GGUFFile:
    """The metadata and tensor index of a GGUF file; a ValueError for anything else."""
    import gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(raw.data)
    if bytes(raw[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(raw[:4])!r}, expected {_MAGIC!r})")
    cur.pos = 4
    version, n_tensors, n_fields = cur.unpack("<I"), cur.unpack("<Q"), cur.unpack("<Q")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (supported: 2, 3; little-endian)")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.unpack("<I")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        infos.append((name, gguf.GGMLQuantizationType(cur.unpack("<I")), dims, cur.unpack("<Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    return GGUFFile(fields, [_tensor(raw, start, *info) for info in infos])


def _tensor(raw: np.ndarray, start: int, name: str, kind: Any, dims: tuple[int, ...], offset: int) -> TensorInfo:
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise ValueError(f"GGUF tensor {name!r}: rows of {dims[0]} do not fill {kind.name} blocks of {block}")
    row_bytes = dims[0] // block * type_size
    rows = int(np.prod(dims[1:], dtype=np.int64))
    begin = start + offset
    if begin + rows * row_bytes > raw.shape[0]:
        raise ValueError(f"GGUF tensor {name!r} runs past the end of the file (truncated download?)")
    data = raw[begin:begin + rows * row_bytes].reshape(*reversed(dims[1:]), row_bytes)
    return TensorInfo(name, kind, dims, data)
