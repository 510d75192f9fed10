"""Outputs appear whole or not at all: write into a temp dir beside the target, rename
at the end, remove the temp dir on any exception (Ctrl-C included)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out}: already exists (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp.", dir=out.parent))
    try:
        yield tmp
        # mkdtemp makes 0700; outputs are ordinary shareable files
        os.chmod(tmp, 0o755)
        for f in tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        if out.exists():
            old = out.with_name(f".{out.name}.old.{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
