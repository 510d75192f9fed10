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
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_MAX_HEADER = 100 << 20  # the limit safetensors itself enforces


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
    """Parse and validate the header of ``path``; raise if the file is truncated."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsFormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(prefix, "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsFormatError(
                f"{path}: truncated safetensors file: header of {n} bytes does not fit in the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsFormatError(f"{path}: not a safetensors file (header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}: not a safetensors file (header is not a JSON object)")
    start, data_end, out = 8 + n, 0, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        out[key] = _entry(path, key, entry, start)
        data_end = max(data_end, out[key].offset + out[key].nbytes - start)
    if start + data_end > size:
        raise SafetensorsFormatError(
            f"{path}: truncated safetensors file: header declares {data_end} bytes of tensor data, "
            f"the file holds {size - start}")
    return out


def row_span(info: TensorInfo, shape: tuple[int, ...] | None = None, start_row: int = 0,
             stop_row: int | None = None) -> tuple[int, int]:
    """Absolute byte offset and length of rows ``[start_row, stop_row)`` of ``info`` viewed as ``shape``."""
    shape = tuple(shape or info.shape)
    stop_row = (shape[0] if shape else 1) if stop_row is None else stop_row
    row_bytes = info.nbytes // shape[0] if shape else info.nbytes
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
    rows = nbytes // (info.nbytes // shape[0]) if shape else 1
    return buf.view(info.dtype).view((rows, *shape[1:]) if shape else ())


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, each in its own buffer."""
    header = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return {key: read_tensor(fd, info) for key, info in header.items()}
    finally:
        os.close(fd)


def _entry(path: Path, key: str, entry, start: int) -> TensorInfo:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(s) for s in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise SafetensorsFormatError(f"{path}: tensor {key!r}: malformed header entry {entry!r}") from e
    nbytes = math.prod(shape) * element_size(dtype)
    if begin < 0 or end - begin != nbytes:
        raise SafetensorsFormatError(
            f"{path}: tensor {key!r}: data_offsets {[begin, end]} do not hold {nbytes} bytes of "
            f"{entry['dtype']} {list(shape)}")
    return TensorInfo(path, key, dtype, shape, start + begin, nbytes)


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
