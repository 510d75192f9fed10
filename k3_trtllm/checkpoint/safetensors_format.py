"""The safetensors file format, read and written without loading tensor data.

A file is: 8 bytes little-endian header length N, N bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
end of the header; the data regions tile the rest of the file) plus an optional
``__metadata__`` object, then the raw little-endian tensor bytes. Parsing the header
ourselves lets the converter validate every file (truncation included) before reading
data, and read row ranges with plain ``pread`` — no memory map, whose touched pages
would count towards the process's resident memory for the whole run.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch


class SafetensorsFormatError(ValueError):
    """A file that is not a complete, well-formed safetensors file; names the file."""


DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_MAX_HEADER = 100_000_000  # the header-length limit of the safetensors library


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    key: str  # name as stored in the file
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate the header of ``path`` by the rules the safetensors library
    enforces: a JSON object of at most 100 MB; per tensor a known dtype, a shape of
    non-negative integers and ``data_offsets`` holding exactly shape x dtype bytes; the
    tensors' byte ranges, in offset order, tile the data section from its first byte to
    the end of the file (no overlap, no gap, nothing after). A file that breaks a rule is
    refused, naming the tensor: two tensors sharing bytes would otherwise read silently."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsFormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(prefix, "little")
        if n > _MAX_HEADER:
            raise SafetensorsFormatError(f"{path}: not a safetensors file (header length {n} bytes exceeds the "
                                         f"format's limit of {_MAX_HEADER})")
        if 8 + n > size:
            raise SafetensorsFormatError(
                f"{path}: truncated safetensors file: header of {n} bytes does not fit in the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        # A tensor named twice would be whichever entry the parser kept: refuse instead.
        raise SafetensorsFormatError(f"{path}: the header names {e.args[0]!r} twice") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsFormatError(f"{path}: not a safetensors file (header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}: not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None)  # optional, and null is as good as absent
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise SafetensorsFormatError(f"{path}: `__metadata__` is not an object of strings")
    start = 8 + n
    out = {key: _entry(path, key, entry, start) for key, entry in header.items()}
    _check_layout(path, out, start, size)
    return out


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _check_layout(path: Path, infos: dict[str, TensorInfo], start: int, size: int) -> None:
    """The tensors' byte ranges tile ``[start, size)`` exactly."""
    def rel(info: TensorInfo) -> list[int]:
        return [info.offset - start, info.offset - start + info.nbytes]

    cursor, prev = start, None
    # Empty tensors first among equal offsets: they hold no bytes, so they fit anywhere.
    for info in sorted(infos.values(), key=lambda i: (i.offset, i.nbytes)):
        if info.offset < cursor:
            raise SafetensorsFormatError(
                f"{path}: tensor {info.key!r}: data_offsets {rel(info)} overlap tensor {prev.key!r} {rel(prev)}")
        if info.offset > cursor:
            after = f"after tensor {prev.key!r} {rel(prev)}" if prev else "at the start of the data section"
            raise SafetensorsFormatError(
                f"{path}: tensor {info.key!r}: data_offsets {rel(info)} leave bytes "
                f"[{cursor - start}, {info.offset - start}) {after} in no tensor")
        cursor, prev = info.offset + info.nbytes, info
    if cursor > size:
        raise SafetensorsFormatError(
            f"{path}: truncated safetensors file: header declares {cursor - start} bytes of tensor data, "
            f"the file holds {size - start}")
    if cursor < size:
        last = f"after tensor {prev.key!r} {rel(prev)}" if prev else "and the header names no tensor"
        raise SafetensorsFormatError(
            f"{path}: the data section holds {size - start} bytes; the last {size - cursor} ({last}) "
            "are in no tensor")


def row_span(info: TensorInfo, shape: tuple[int, ...] | None = None, start_row: int = 0,
             stop_row: int | None = None) -> tuple[int, int]:
    """Absolute byte offset and length of rows ``[start_row, stop_row)`` of ``info`` viewed as ``shape``."""
    shape = tuple(shape or info.shape)
    if not shape:  # a scalar is one row
        return info.offset, info.nbytes
    stop_row = shape[0] if stop_row is None else stop_row
    row_bytes = math.prod(shape[1:]) * element_size(info.dtype)  # from the shape: a tensor may have no rows
    return info.offset + start_row * row_bytes, (stop_row - start_row) * row_bytes


def read_tensor(fd: int, info: TensorInfo, start_row: int = 0, stop_row: int | None = None,
                shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rows ``[start_row, stop_row)`` of tensor ``info`` viewed as ``shape`` (default: as
    stored), read with ``pread`` into a fresh, allocator-aligned tensor (a view into a
    shared buffer at an odd offset can make CPU GEMMs round differently)."""
    shape = tuple(shape or info.shape)
    offset, nbytes = row_span(info, shape, start_row, stop_row)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view, done = memoryview(buf.numpy()), 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise SafetensorsFormatError(f"{info.file}: cannot read tensor {info.key!r}: the file ended early")
        done += n
    if not shape:
        return buf.view(info.dtype).view(())
    rows = (shape[0] if stop_row is None else stop_row) - start_row
    return buf.view(info.dtype).view(rows, *shape[1:])


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, each in its own buffer."""
    header = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return {key: read_tensor(fd, info) for key, info in header.items()}
    finally:
        os.close(fd)


def _entry(path: Path, key: str, entry, start: int) -> TensorInfo:
    where = f"{path}: tensor {key!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise SafetensorsFormatError(f"{where}: malformed header entry {entry!r} (expected an object with "
                                     "dtype, shape and data_offsets)")
    name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(name, str) or name not in DTYPES:
        raise SafetensorsFormatError(f"{where}: unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_natural(s) for s in shape):
        raise SafetensorsFormatError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise SafetensorsFormatError(f"{where}: data_offsets {offsets!r} are not [begin, end] with "
                                     "0 <= begin <= end")
    dtype, (begin, end) = DTYPES[name], offsets
    nbytes = math.prod(shape) * element_size(dtype)
    if end - begin != nbytes:
        raise SafetensorsFormatError(
            f"{where}: data_offsets {[begin, end]} do not hold {nbytes} bytes of {name} {list(shape)}")
    return TensorInfo(path, key, dtype, tuple(shape), start + begin, nbytes)


def _natural(x) -> bool:
    return type(x) is int and x >= 0  # bool is an int subclass, and JSON true is no size


def build_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for tensors laid out in the given order, and
    each tensor's absolute byte offset in the file."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    rel = []
    cursor = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * element_size(dtype)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        rel.append(cursor)
        cursor += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # data starts 8-byte aligned, as safetensors writes it
    prefix = len(body).to_bytes(8, "little")
    return prefix + body, [8 + len(body) + r for r in rel]
