"""JSON that strict parsers accept: Python's json writes ``Infinity`` / ``NaN`` for
non-finite floats, which is not JSON (RFC 8259) and breaks ``jq`` and JavaScript clients."""
from __future__ import annotations

import json
import math


def finite_or_null(value):
    """``value`` with every non-finite float (inf, -inf, nan) replaced by None (JSON null),
    through dicts, lists and tuples; other values are returned as they are."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """``json.dumps`` of ``value`` with non-finite floats as null; ``allow_nan=False`` makes
    any that slipped through (a float subclass, a custom encoder) an error, not bad output."""
    return json.dumps(finite_or_null(value), allow_nan=False, **kwargs)
