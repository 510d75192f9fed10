"""One rank's tensors of an HF checkpoint converted straight into memory: what
``k3-trt convert --tp --ep`` would write into that rank's file, without the file (how
``k3-trt run`` serves an HF checkpoint at world size N)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ..checkpoint.hf import HFCheckpoint
from ..checkpoint.loader import check_checkpoint
from ..checkpoint.mapping import targets
from ..checkpoint.rank_layout import RankLayout, rank_layout_for
from ..config import K3Config
from .plan import Planner
from .run import convert_piece


class _RankBuffers:
    """One rank's tensors in memory, filled the way the converter fills a rank file
    (``convert.writer.RankFile``: bytes at offsets inside each tensor's data)."""

    def __init__(self, entries) -> None:
        self.entries = entries
        self.data = {e.name: torch.empty(e.nbytes, dtype=torch.uint8) for e in entries}

    def write(self, name: str, offset: int, tensor: torch.Tensor) -> None:
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        self.data[name][offset: offset + data.numel()] = data

    def copy_from(self, name: str, offset: int, src_fd: int, src_offset: int, nbytes: int) -> None:
        dest = self.data[name][offset: offset + nbytes].numpy()
        done = 0
        while done < nbytes:
            n = os.preadv(src_fd, [memoryview(dest)[done:]], src_offset + done)
            if n == 0:
                raise OSError(f"source ended after {done} of {nbytes} bytes")
            done += n

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {e.name: self.data[e.name].view(e.dtype).reshape(e.shape) for e in self.entries}


def shard_hf_checkpoint(path: str | Path, tp: int, ep: int, rank: int) -> tuple[K3Config, dict[str, torch.Tensor],
                                                                                RankLayout]:
    """Rank ``rank``'s tensors of an HF checkpoint at ``--tp``/``--ep``: exactly what
    ``k3-trt convert --tp --ep`` writes into that rank's file (the converter's planner and
    piece conversion, experts kept as stored), read straight into memory: each rank reads
    only the pieces it holds."""
    with HFCheckpoint(path) as ckpt:
        cfg = ckpt.config
        layout = rank_layout_for(cfg, tp, ep, cfg.moe is not None and cfg.moe.mxfp4)
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank {rank} is outside world size {layout.world_size}")
        check_checkpoint(ckpt)
        planner = Planner(cfg, layout, list(targets(cfg)))
        mine = _RankBuffers(planner.rank_entries()[rank])
        for piece in planner.pieces():
            dests = tuple(d for d in piece.dests if d.rank == rank)
            if dests:
                convert_piece(dataclasses.replace(piece, dests=dests), ckpt, {rank: mine}, cfg)
        return cfg, mine.state_dict(), layout
