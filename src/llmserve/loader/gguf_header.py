"""GGUF header parsing: metadata and the tensor table, without reading tensor data.

File layout (GGUF v2/v3, little-endian; spec: ggml ``docs/gguf.md``)::

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv      x ( string key | u32 value_type | value )
    n_tensors x ( string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset )
    padding to ``general.alignment`` (default 32)
    tensor data (each at data_start + offset)

Parsed here instead of with ``gguf.GGUFReader`` because that reader builds a numpy view
per tokenizer string (~3 s for a 49k vocabulary); large arrays are skipped, not
materialized, and read on demand (:func:`read_gguf_array`, :func:`read_gguf_strings`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Arrays longer than this (tokenizer vocab, merges, scores) stay out of the metadata dict.
MAX_METADATA_ARRAY_LEN = 1024

# GGUF value types: id -> struct format (scalars); 8 = string, 9 = array.
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry: ``shape`` in numpy order (``ne`` reversed), ``offset``
    in bytes from the start of the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class GGUFHeader:
    """Parsed header: ``metadata`` (large arrays omitted), ``array_lengths`` of every
    array field, the tensor table in file order, ``array_items`` (key -> (item value
    type, file offset of the first item), for :func:`read_gguf_array`), ``alignment``
    and ``file_size`` in bytes."""

    path: str
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: list[GGUFTensorInfo]
    array_items: dict[str, tuple[int, int]] = field(default_factory=dict)
    alignment: int = 32
    file_size: int = 0


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        buf, pos = self.buf, self.pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _FLOAT32:  # shortest decimal that round-trips float32 (1e-05, not 9.99e-06)
            return float(str(np.float32(self.unpack("<f"))))
        if vtype in _SCALAR_FMT:
            return self.unpack(_SCALAR_FMT[vtype])
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse a GGUF file's header (metadata and tensor table); tensor data is not read.

    Raises:
        ValueError: not a GGUF file, unsupported version (v1, big-endian) or a corrupt header.
    """
    file_size = os.path.getsize(path)
    if file_size < 24:  # magic, version, two counts
        raise ValueError(f"{path!r} is not a GGUF file (only {file_size} bytes)")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    try:
        if bytes(cur.buf[:4]) != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path!r}: GGUF version {version} is not supported (only v2 and v3, "
                             "little-endian)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        array_lengths: dict[str, int] = {}
        array_items: dict[str, tuple[int, int]] = {}
        for _ in range(n_kv):
            key, vtype = cur.string(), cur.unpack("<I")
            if vtype != _ARRAY:
                metadata[key] = cur.value(vtype)
                continue
            item_type, count = cur.unpack("<I"), cur.unpack("<Q")
            array_lengths[key] = count
            array_items[key] = (item_type, cur.pos)
            if count <= MAX_METADATA_ARRAY_LEN:
                metadata[key] = [cur.value(item_type) for _ in range(count)]
            elif item_type == _STRING:
                cur.skip_strings(count)
            elif item_type in _SCALAR_FMT:
                cur.pos += count * struct.calcsize(_SCALAR_FMT[item_type])
            else:
                raise ValueError(f"{path!r}: unsupported nested array in metadata key {key!r}")
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.unpack("<I")
            ne = [cur.unpack("<Q") for _ in range(n_dims)]
            infos.append((name, tuple(reversed(ne)), cur.unpack("<I"), cur.unpack("<Q")))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"{path!r}: general.alignment must be a positive integer, got "
                             f"{alignment!r}")
        data_start = (cur.pos + alignment - 1) // alignment * alignment
    except struct.error as e:
        raise ValueError(f"{path!r}: truncated or corrupt GGUF header ({e})") from None
    if cur.pos > file_size:
        raise ValueError(f"{path!r}: truncated GGUF header (it runs past the end of the "
                         f"{file_size}-byte file)")
    tensors = [GGUFTensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]
    return GGUFHeader(path, version, metadata, array_lengths, tensors, array_items,
                      alignment, file_size)


def read_gguf_strings(header: GGUFHeader, key: str, ids: list[int]) -> dict[int, str]:
    """``{index: string}`` for the given indices of string array ``key`` (e.g. a few
    token ids of ``tokenizer.ggml.tokens``) without decoding the rest; indices past the
    end are left out."""
    if key not in header.array_items or not ids:
        return {}
    item_type, pos = header.array_items[key]
    if item_type != _STRING:
        raise ValueError(f"{header.path!r}: metadata array {key!r} does not hold strings")
    wanted, last = set(ids), min(max(ids), header.array_lengths[key] - 1)
    buf = memoryview(np.memmap(header.path, dtype=np.uint8, mode="r"))
    unpack, out = struct.unpack_from, {}
    try:
        for i in range(last + 1):
            (n,) = unpack("<Q", buf, pos)
            if i in wanted:
                out[i] = bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace")
            pos += 8 + n
    except struct.error as e:
        raise ValueError(f"{header.path!r}: corrupt metadata array {key!r} ({e})") from None
    return out


def read_gguf_array(header: GGUFHeader, key: str) -> list[Any] | np.ndarray | None:
    """The full value of array field ``key`` (also the long ones the header leaves out):
    a list of str for string arrays, a 1-D numpy array for numeric ones, ``None`` if the
    file has no such key.

    Raises:
        ValueError: a nested array or a corrupt field.
    """
    if key not in header.array_items:
        return None
    item_type, pos = header.array_items[key]
    count = header.array_lengths[key]
    mm = np.memmap(header.path, dtype=np.uint8, mode="r")
    if item_type in _SCALAR_FMT and item_type != 7:
        dtype = np.dtype(_SCALAR_FMT[item_type])
        return np.frombuffer(mm, dtype=dtype, count=count, offset=pos).copy()
    cur = _Cursor(memoryview(mm))
    cur.pos = pos
    try:
        if item_type == _STRING:
            return [cur.string() for _ in range(count)]
        return [cur.value(item_type) for _ in range(count)]
    except (struct.error, ValueError) as e:
        raise ValueError(f"{header.path!r}: corrupt metadata array {key!r} ({e})") from None
