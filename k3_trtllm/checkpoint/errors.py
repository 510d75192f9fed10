"""The error every checkpoint reader raises (its own module so that the readers and the
format detection can all raise it without importing one another)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config; names the file/tensor."""
