"""The CUDA-event timer the kernel benchmarks share (bench/ scripts import it from their folder)."""
from __future__ import annotations

import statistics

import torch


def time_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median of ``reps`` calls of ``fn`` (CUDA events) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
