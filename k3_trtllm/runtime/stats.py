"""Counters and timings the engine keeps while it runs."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Per-step samples kept for percentiles; a long-lived engine keeps only the latest.
_WINDOW = 100_000


def summarize(values, scale: float = 1.0) -> dict[str, float] | None:
    """Mean and p50/p90/p99 (nearest rank) of ``values`` times ``scale``; None if empty."""
    data = sorted(v * scale for v in values if v is not None)
    if not data:
        return None
    def rank(p: float) -> float:
        return data[min(len(data) - 1, max(0, round(p / 100 * len(data)) - 1))]
    return {"mean": sum(data) / len(data), "p50": rank(50), "p90": rank(90), "p99": rank(99), "max": data[-1]}


@dataclass
class EngineStats:
    num_steps: int = 0
    computed_tokens: int = 0  # tokens run through the model, recomputed ones included
    generated_tokens: int = 0
    peak_blocks_in_use: int = 0
    peak_slots_in_use: int = 0
    peak_batch: int = 0
    first_step_time: float | None = None
    last_step_time: float | None = None
    scheduler_cpu_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    step_wall_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    batch_per_step: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
