"""The rules for every output k3-trt writes (synth and converted checkpoints, engine dirs,
Triton models), in one place, so that no writer can destroy what k3-trt did not write:

- an output must not be, contain or lie inside one of its inputs (symlinks resolved);
- an existing output is replaced only with ``force``, and only when it carries k3-trt's
  marker (``MARKER``) of the same kind and holds no file the marker does not list;
- the output is written into ``.NAME.tmp.PID.TOKEN`` beside it, marked, and renamed at the
  end: it appears whole or not at all, and any exception (Ctrl-C included) removes the
  temp dir;
- temp dirs that a killed run left beside the same output are removed when they carry
  the marker and their process is gone, and reported otherwise;
- OS errors while writing (disk full, read-only, permission) become one ``OutputError``
  line naming the output.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Iterator

MARKER = ".k3-trt-output.json"
KINDS = {
    "hf-checkpoint": "HF checkpoint (k3-trt synth)",
    "trtllm-checkpoint": "converted checkpoint (k3-trt convert)",
    "engine": "engine dir (k3-trt build)",
    "triton-model": "Triton model (k3-trt triton-repo)",
}
# errnos that only a write raises: an error carrying one and no file name is the output's
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class OutputError(Exception):
    """An output k3-trt refuses to write, or could not write; the message is one line."""


class OutputExistsError(OutputError, FileExistsError):
    pass


def _version() -> str:
    try:
        return metadata.version("k3-trt")
    except metadata.PackageNotFoundError:
        return "unknown"


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


def input_paths(path: str | Path) -> list[Path]:
    """``path`` and, for a directory, its entries that are symlinks: a checkpoint in the
    HF cache is a directory of links into ``blobs/``, which an output must not touch either."""
    path = Path(path)
    found = [path]
    with contextlib.suppress(OSError):
        found += sorted(Path(e.path) for e in os.scandir(path) if e.is_symlink())
    return found


def _check_inputs(out: Path, inputs: Iterable[str | Path]) -> None:
    real_out = _real(out)
    for given in inputs:
        real_in = _real(given)
        if real_out == real_in:
            relation = "is"
        elif real_in.is_relative_to(real_out):
            relation = "contains"
        elif real_out.is_relative_to(real_in):
            relation = "lies inside"
        else:
            continue
        links = [f"{p} resolves to {r}" for p, r in ((out, real_out), (given, real_in)) if Path(p).absolute() != r]
        resolved = f" ({'; '.join(links)})" if links else ""
        raise OutputError(f"output {out} {relation} the input {given}{resolved}: choose an output outside the input")


def read_marker(out: str | Path) -> dict | None:
    """The marker of a directory k3-trt wrote, or None (absent or not k3-trt's)."""
    try:
        data = json.loads((Path(out) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(data, dict) or data.get("written_by") != "k3-trt" or data.get("kind") not in KINDS
            or not isinstance(data.get("files"), list)):
        return None
    return data


def _unlisted(out: Path, listed: list) -> list[str]:
    """Entries under ``out`` that its marker does not list (``__pycache__``, which Python
    writes beside an imported module such as a Triton model's model.py, counts as ours)."""
    listed, extra = set(listed), []
    for root, dirs, files in os.walk(out):
        rel_root = Path(root).relative_to(out)
        for d in list(dirs):
            if d == "__pycache__" or os.path.islink(os.path.join(root, d)):
                dirs.remove(d)
                if d != "__pycache__":
                    extra.append((rel_root / d).as_posix())
        extra += [(rel_root / f).as_posix() for f in files
                  if (rel_root / f).as_posix() not in listed and (rel_root / f).as_posix() != MARKER]
    return sorted(extra)


def _check_replaceable(out: Path, kind: str) -> None:
    if out.is_symlink():
        raise OutputError(f"{out}: not replaced: it is a symbolic link (pass the directory it points to, "
                          f"{_real(out)}, to replace that)")
    if not out.is_dir():
        raise OutputError(f"{out}: not replaced: it is a file, not a directory k3-trt wrote")
    marker = read_marker(out)
    if marker is None:
        raise OutputError(f"{out}: not replaced: it has no {MARKER}, so k3-trt did not write it "
                          "(remove it yourself or choose another output)")
    if marker["kind"] != kind:
        raise OutputError(f"{out}: not replaced: it holds a k3-trt {KINDS[marker['kind']]}, not a {KINDS[kind]}")
    extra = _unlisted(out, marker["files"])
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise OutputError(f"{out}: not replaced: it holds files k3-trt did not write ({', '.join(extra[:5])}{more}); "
                          "move them out first")


def check_output(out: str | Path, kind: str, *, force: bool = False, inputs: Iterable[str | Path] = ()) -> None:
    """Every refusal ``atomic_output_dir`` makes before writing, for writers that check
    before slow work. ``inputs``: paths the run reads (see ``input_paths``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    out = Path(out)
    _check_inputs(out, inputs)
    parent = out.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise OutputError(f"{out}: cannot write it: its parent directory {parent} {what}")
    if os.path.lexists(out):
        if not force:
            raise OutputExistsError(f"{out}: already exists (pass --force to replace it)")
        _check_replaceable(out, kind)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove_tree(path: Path) -> None:
    """Everything but the marker first and the marker last, so that a removal cut short
    still says whose leftover it is. Best effort: errors are ignored."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if entry.name == MARKER:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.unlink(path / MARKER)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _clear_leftovers(out: Path, log: Callable[[str], None]) -> None:
    """Remove the temp and old dirs of killed runs writing ``out`` (ours: marked, written on
    this host, their process gone); report the others that look like them."""
    ours = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)\.(\d+)\.[0-9a-f]+")
    looks_like = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)\..+")
    host = socket.gethostname()
    for entry in sorted(os.scandir(out.parent), key=lambda e: e.name):
        if not looks_like.fullmatch(entry.name):
            continue
        path, match = Path(entry.path), ours.fullmatch(entry.name)
        marker = read_marker(path) if entry.is_dir(follow_symlinks=False) else None
        if match is None or marker is None:
            reason = "it carries no k3-trt marker"
        elif marker.get("host") != host:
            reason = f"it was written on host {marker.get('host')!r}"
        elif _pid_alive(int(match.group(2))):
            reason = f"process {match.group(2)} is still running"
        else:
            _remove_tree(path)
            log(f"k3-trt: removed {path}, left by an interrupted k3-trt run (pid {match.group(2)})")
            continue
        log(f"k3-trt: left {path} in place ({reason}); remove it yourself if no k3-trt run is writing {out}")


def _listing(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MARKER)


def _write_marker(tmp: Path, kind: str, state: str, files: list[str]) -> None:
    marker = {"written_by": "k3-trt", "version": _version(), "kind": kind, "state": state,
              "host": socket.gethostname(), "pid": os.getpid(), "files": files}
    write_file(tmp / MARKER, json.dumps(marker, indent=1) + "\n")


def _as_output_error(e: OSError, out: Path, tmp: Path, existed: bool) -> OSError | OutputError:
    """The one-line error for an OSError raised while writing ``out`` through ``tmp``; an
    error about another file (an input being read) is returned unchanged."""
    left = f"{out} is unchanged" if existed else "nothing was written"
    if e.filename is not None:
        path = os.path.abspath(e.filename)
        if not Path(path).is_relative_to(os.path.abspath(tmp)):
            return e
        rel = Path(path).relative_to(os.path.abspath(tmp)).as_posix()
        what = f"cannot write {rel}" if rel != "." else "cannot write it"
        return OutputError(f"{out}: {what}: {e.strerror}; {left}")
    if e.errno in _WRITE_ERRNOS:
        return OutputError(f"{out}: cannot write it: {e.strerror}; {left}")
    return e


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, kind: str, *, force: bool = False, inputs: Iterable[str | Path] = (),
                      log: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Yields the temp dir to write ``out`` into; see the module docstring for the rules."""
    out, log = Path(out), log or _stderr
    inputs = list(inputs)
    check_output(out, kind, force=force, inputs=inputs)
    _clear_leftovers(out, log)
    existed = os.path.lexists(out)
    token = f"{os.getpid()}.{secrets.token_hex(4)}"
    tmp = out.with_name(f".{out.name}.tmp.{token}")
    try:
        os.mkdir(tmp, 0o700)
    except OSError as e:
        raise OutputError(f"{out}: cannot create it in {out.parent}: {e.strerror}") from e
    try:
        _write_marker(tmp, kind, "writing", [])
        yield tmp
        # temp dirs are private while written; outputs are ordinary shareable files
        os.chmod(tmp, 0o755)
        for f in tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        _write_marker(tmp, kind, "complete", _listing(tmp))
        # checked again: the output may have appeared or changed during the write
        check_output(out, kind, force=force, inputs=inputs)
        if os.path.lexists(out):
            old = out.with_name(f".{out.name}.old.{token}")
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old, out)
                raise
            _remove_tree(old)
        else:
            os.replace(tmp, out)
    except BaseException as e:
        _remove_tree(tmp)
        if isinstance(e, OSError) and not isinstance(e, OutputError):
            error = _as_output_error(e, out, tmp, existed)
            if error is not e:
                raise error from e
        raise


def write_file(path: str | Path, data: bytes | str) -> None:
    """Write a whole file and fsync it; an OSError names the file (``os.write``'s does not)."""
    view = memoryview(data.encode() if isinstance(data, str) else data)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def describe_os_error(e: OSError) -> str:
    """One line for an OSError that reaches a command: the file, then the reason."""
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)
