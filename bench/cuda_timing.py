"""The CUDA-event timer the kernel benchmarks share (bench/ scripts import it from their folder)."""
from __future__ import annotations

import statistics

import torch


def time_ms(fn, reps: int, warmup: int = 1, before=None) -> float:
    """Median of ``reps`` calls of ``fn`` (CUDA events around the call alone) after ``warmup`` calls;
    ``before()``, if given, runs ahead of each timed call, outside the events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
