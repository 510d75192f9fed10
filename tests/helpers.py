"""Helpers shared by several test files (imported as ``helpers``; pytest puts tests/ on sys.path)."""
from __future__ import annotations

import socket
from pathlib import Path

import torch

from k3_trtllm.ops.moe import dequantize_mxfp4


def dequantized_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same model tensors with every MXFP4 ``weight_packed``/``weight_scale`` pair replaced
    by the bf16 ``weight`` it encodes (exact, spec §2.6)."""
    out = {}
    for name, t in state.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            out[base + ".weight"] = dequantize_mxfp4(t, state[base + ".weight_scale"], torch.bfloat16)
        elif not name.endswith(".weight_scale"):
            out[name] = t
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` right now (for the multi-process tests' rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def live_processes(markers: tuple[str, ...] = (), process_group: int | None = None) -> list[str]:
    """Live (non-zombie) processes whose command line names one of ``markers`` or that belong
    to ``process_group``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgid = fields[0], int(fields[2])
        if state != "Z" and (pgid == process_group or any(m in cmdline for m in markers)):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found
