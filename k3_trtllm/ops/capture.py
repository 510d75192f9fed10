"""Per-device CUDA facts for code that may run with another device current.

``torch.cuda.is_current_stream_capturing()`` answers for the current device's current stream; a
tensor on another device (two devices in one process: tests, rank threads) needs its own device's
answer, which these helpers give. They never initialise CUDA for a CPU tensor's device.
"""
from __future__ import annotations

import torch


def device_key(device: torch.device) -> torch.device:
    """``device`` with its index made explicit (``cuda`` is the current CUDA device), so that every
    spelling of one device names it alike; other devices as given."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def capturing(device: torch.device) -> bool:
    """Whether a CUDA-graph capture is underway on ``device``'s current stream (False for a
    non-CUDA device)."""
    if device.type != "cuda":
        return False
    index = device_key(device).index
    if index == torch.cuda.current_device():  # the common case: no device switch
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()
