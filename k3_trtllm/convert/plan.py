"""Where every byte of a converted checkpoint comes from.

Each target of the transformation table is the row concatenation of its units' outputs
(``mapping.Target.units``); on a rank it holds the outputs of the units that rank holds,
each from that rank's slice of the unit's parts. The planner lays out every rank file
(tensor names, dtypes, shapes: the safetensors headers, known before any data is read)
and cuts the work into pieces: one unit, or a chunk of a unit's rows, read once and
written to every rank that needs it. Pieces write disjoint byte ranges, so they may run
in any order and concurrently; each holds at most ``chunk_bytes`` of source rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from ..checkpoint.mapping import COLS, ROW_WISE, ROWS, Part, Target, unit_output_shape
from ..checkpoint.safetensors_format import element_size
from ..config import K3Config
from ..checkpoint.rank_layout import Holder, RankLayout, local_shape, slice_range

CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)


@dataclass(frozen=True)
class Dest:
    rank: int
    offset: int  # byte offset inside the target's data on that rank
    cols: tuple[tuple[int, int] | None, ...]  # per part: column range to keep, None = all


@dataclass(frozen=True)
class Piece:
    target: Target
    parts: tuple[Part, ...]
    rows: tuple[int, int] | None  # rows of every part to read; None: each part whole
    dests: tuple[Dest, ...]
    nbytes: int  # bytes written over all dests


@dataclass(frozen=True)
class Placed:
    holder: Holder
    offset: int  # of the unit's local output inside the target on holder.rank
    shape: tuple[int, ...]  # of the unit's local output


class Planner:
    def __init__(self, cfg: K3Config, par: RankLayout, targets: list[Target], chunk_bytes: int = CHUNK_BYTES,
                 file_dtypes: Mapping[str, torch.dtype] | None = None):
        """``file_dtypes``: the dtype each source tensor is stored in, which bounds the bytes a
        piece reads (files may hold any float dtype); default: the spec's dtypes."""
        self.cfg, self.par, self.targets, self.chunk_bytes = cfg, par, targets, chunk_bytes
        self.file_dtypes = file_dtypes or {}

    # ---- layout ------------------------------------------------------------------
    def unit_shape(self, target: Target, unit: tuple[Part, ...], holder: Holder) -> tuple[int, ...]:
        """Shape of ``unit_output`` for the holder's slice of the unit."""
        return unit_output_shape(target, [local_shape(p, holder) for p in unit], self.cfg)

    def placed_units(self, target: Target) -> Iterator[tuple[tuple[Part, ...], list[Placed]]]:
        cursor = [0] * self.par.world_size
        for unit in target.units():
            placed = []
            for h in self.par.holders(unit[0]):
                shape = self.unit_shape(target, unit, h)
                placed.append(Placed(h, cursor[h.rank], shape))
                cursor[h.rank] += math.prod(shape) * element_size(target.dtype)
            yield unit, placed

    def target_entries(self, target: Target) -> list[Entry]:
        """The target's tensor on each rank (rank order)."""
        rows = [0] * self.par.world_size
        units = [0] * self.par.world_size
        trailing: tuple[int, ...] = ()
        for _, placed in self.placed_units(target):
            for p in placed:
                rows[p.holder.rank] += p.shape[0]
                units[p.holder.rank] += 1
                trailing = p.shape[1:]
        entries = []
        for r in range(self.par.world_size):
            if target.combine in ("experts", "dequant_experts"):
                experts = units[r] // (target.per_expert // target.unit_size)
                shape = (experts, rows[r] // experts, *trailing)
            else:
                shape = (rows[r], *trailing)
            entries.append(Entry(target.name, target.dtype, shape))
        return entries

    def rank_entries(self) -> list[list[Entry]]:
        per_rank: list[list[Entry]] = [[] for _ in range(self.par.world_size)]
        for target in self.targets:
            for r, entry in enumerate(self.target_entries(target)):
                per_rank[r].append(entry)
        return per_rank

    # ---- pieces ------------------------------------------------------------------
    def pieces(self) -> Iterator[Piece]:
        for target in self.targets:
            for unit, placed in self.placed_units(target):
                yield from self._unit_pieces(target, unit, placed)

    def _unit_pieces(self, target: Target, unit: tuple[Part, ...], placed: list[Placed]) -> Iterator[Piece]:
        out_es = element_size(target.dtype)
        if target.combine not in ROW_WISE:
            # Not computable row by row (absorbed MLA heads, AttnRes queries): whole local parts.
            for rows, items in _by_rows(unit, placed):
                yield Piece(target, unit, rows, tuple(Dest(p.holder.rank, p.offset, _cols(unit, p.holder))
                                                      for p in items),
                            sum(math.prod(p.shape) * out_es for p in items))
            return
        src_row_bytes = sum(math.prod(p.shape[1:]) * element_size(self.file_dtypes.get(p.source, p.dtypes[0]))
                            for p in unit)
        for (start, stop), items in _by_rows(unit, placed):
            out_row = max(math.prod(p.shape[1:]) * out_es for p in items)
            step = max(1, self.chunk_bytes // max(src_row_bytes, out_row))
            for a in range(start, stop, step):
                b = min(stop, a + step)
                dests = tuple(Dest(p.holder.rank, p.offset + (a - start) * math.prod(p.shape[1:]) * out_es,
                                   _cols(unit, p.holder)) for p in items)
                yield Piece(target, unit, (a, b), dests,
                            sum((b - a) * math.prod(p.shape[1:]) * out_es for p in items))


def _by_rows(unit: tuple[Part, ...], placed: list[Placed]) -> list[tuple[tuple[int, int] | None, list[Placed]]]:
    """Row-split units: one read per holder (its own rows). Others: one read for all."""
    part = unit[0]
    if part.split == ROWS and placed[0].holder.count > 1:
        return [(slice_range(part.shape[0], p.holder.index, p.holder.count), [p]) for p in placed]
    whole = (0, part.shape[0]) if all(q.shape[:1] == part.shape[:1] for q in unit) else None
    return [(whole, placed)]


def _cols(unit: tuple[Part, ...], holder: Holder) -> tuple[tuple[int, int] | None, ...]:
    return tuple(slice_range(p.shape[1], holder.index, holder.count) if p.split == COLS and holder.count > 1
                 else None for p in unit)
