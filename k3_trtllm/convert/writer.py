"""A safetensors file written piece by piece: the header (names, dtypes, shapes, offsets)
is written first, from the plan; tensor bytes then arrive in any order with positional
writes, from any thread. Nothing but the piece being written is held in memory."""
from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path

import torch

from ..checkpoint.safetensors_format import build_header
from .plan import Entry


class RankFile:
    def __init__(self, path: Path, entries: list[Entry]):
        self.path = path
        header, offsets = build_header([(e.name, e.dtype, e.shape) for e in entries])
        self.regions = {e.name: (off, e.nbytes, e.dtype) for e, off in zip(entries, offsets)}
        self.num_tensors = len(entries)
        self.data_bytes = sum(e.nbytes for e in entries)
        self.file_bytes = len(header) + self.data_bytes
        self._written = 0
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with self._naming():
                _pwrite_all(self._fd, memoryview(header), 0)
                os.ftruncate(self._fd, self.file_bytes)
        except BaseException:
            os.close(self._fd)
            raise

    @contextlib.contextmanager
    def _naming(self):
        """os.pwrite / fsync errors carry no file name; a disk-full error must name the file."""
        try:
            yield
        except OSError as e:
            if e.filename is None:
                raise OSError(e.errno, e.strerror, str(self.path)) from e
            raise

    def write(self, name: str, offset: int, tensor: torch.Tensor) -> None:
        """Write ``tensor`` at byte ``offset`` of tensor ``name``'s data."""
        start, nbytes, dtype = self.regions[name]
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        if tensor.dtype != dtype or offset < 0 or offset + data.numel() > nbytes:
            raise RuntimeError(f"{self.path.name}: piece of {name!r} ({tensor.dtype}, {data.numel()} bytes at "
                               f"{offset}) does not fit its region ({dtype}, {nbytes} bytes)")
        with self._naming():
            _pwrite_all(self._fd, memoryview(data.numpy()), start + offset)
        with self._lock:
            self._written += data.numel()

    def copy_from(self, name: str, offset: int, src_fd: int, src_offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` from another file into tensor ``name``'s data at ``offset``, inside
        the kernel (``copy_file_range``: no user-space buffer). Raises OSError where the
        kernel cannot (e.g. across filesystems); nothing is counted as written then."""
        start, size, _ = self.regions[name]
        if offset < 0 or offset + nbytes > size:
            raise RuntimeError(
                f"{self.path.name}: copy of {nbytes} bytes at {offset} does not fit {name!r} ({size} bytes)")
        done, n = 0, -1
        with self._naming():
            while done < nbytes and n != 0:
                n = os.copy_file_range(src_fd, self._fd, nbytes - done, src_offset + done, start + offset + done)
                done += n
        if done < nbytes:  # the source's fault, not this file's: no file name on purpose
            raise OSError(errno.EIO, f"source ended after {done} of {nbytes} bytes")
        with self._lock:
            self._written += nbytes

    def close(self) -> None:
        """Flush to disk; every data byte must have been written exactly once."""
        try:
            if self._written != self.data_bytes:
                raise RuntimeError(f"{self.path.name}: wrote {self._written} of {self.data_bytes} data bytes")
            with self._naming():
                os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def abandon(self) -> None:
        os.close(self._fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
