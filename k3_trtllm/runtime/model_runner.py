"""The one place that turns scheduled sequences into step tensors and runs them."""
from __future__ import annotations

import numpy as np
import torch

from k3_trtllm.model.step import build_step, is_pure_decode
from k3_trtllm.runtime.executor import Executor
from k3_trtllm.runtime.scheduler import ScheduledBatch


class ModelRunner:
    """``first_snapshot_row``: where the prefix cache's snapshot rows start in its row namespace
    (``PrefixCache``: after the ``max_slots`` state slots); the ops index the snapshot pools."""

    def __init__(self, executor: Executor, block_size: int, first_snapshot_row: int = 0) -> None:
        self.executor = executor
        self.block_size = block_size
        self.first_snapshot_row = first_snapshot_row
        self._tables = _TableRows()

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run ``batch``; return fp32 logits ``[len(batch.sampling), vocab]``, one row per
        sampling sequence in order. A prefill chunk that leaves part of its prompt for a
        later step asks for no logits."""
        seqs = [(seq.token_ids[seq.num_cached_tokens: seq.num_cached_tokens + n], seq.num_cached_tokens,
                 seq.state_slot, seq.block_table) for seq, n in batch.entries]
        # the phase is decided here, once, from host lists: every layer below follows it
        decode = is_pure_decode(seqs)
        in_step, copies = self._snapshots(batch, decode)
        step = build_step(seqs, self.block_size, snapshots=in_step, block_tables=self._tables.gather(seqs))
        if len(batch.sampling) != len(batch.entries):
            samples = [n == seq.num_uncached_tokens for seq, n in batch.entries]
            last_tokens = step.cu_seqlens[1:] - 1
            step.logits_indices = last_tokens[torch.tensor(samples, dtype=torch.bool)]
        # prefix cache: restored KDA states must be in their slots before the step reads
        # them, and copied snapshots are the states the step leaves behind
        if batch.restores:
            self.executor.copy_states(batch.restores)
        logits = self.executor.execute(step, decode)
        if copies:
            self.executor.copy_states(copies)
        if logits.shape[0] != len(batch.sampling):
            raise ValueError(f"executor returned logits of shape {tuple(logits.shape)}; "
                             f"expected {len(batch.sampling)} rows")
        return logits

    def _snapshots(self, batch: ScheduledBatch, decode: bool):
        """(per entry, the ``(offset, snapshot-pool row)`` points the prefill ops take, or None;
        the ``(slot, row)`` copies after the step). The ops take them in a prefill step of an
        executor whose ops write snapshots; otherwise every point ends its chunk (the
        scheduler's ``clip``) and the state row the step leaves is copied."""
        if not batch.snapshots:
            return None, []
        if not decode and getattr(self.executor, "writes_snapshots", False):
            points: list[list[tuple[int, int]]] = [[] for _ in batch.entries]
            for entry, offset, row in batch.snapshots:
                points[entry].append((offset, row - self.first_snapshot_row))
            return points, []
        copies = []
        for entry, offset, row in batch.snapshots:
            seq, n = batch.entries[entry]
            if offset != n:
                raise ValueError(f"snapshot {offset} tokens into a chunk of {n}: this executor's steps "
                                 "take snapshots only where a chunk ends")
            copies.append((seq.state_slot, row))
        return None, copies


class _TableRows:
    """Each state slot's block table as a row of one array, kept from step to step: a decode step's
    tables are those of the step before, a block longer now and then, so a step updates the rows
    that changed and gathers the batch's rows in one numpy call, instead of reading every table
    list whole (about 20 ns an entry: 0.3 ms for 128 sequences at 8k tokens in 64-token blocks).

    A row is current while its slot's sequence holds the same table list, grown by appends only:
    what ``BlockManager`` does (it appends blocks, and gives a freed or shared sequence a new list).
    Any other list in a slot is written whole. Each row is zero past the table it holds."""

    def __init__(self) -> None:
        self.rows = np.zeros((0, 0), dtype=np.int32)
        self.held: dict[int, tuple[list[int], int]] = {}  # slot -> (the table list, entries written)

    def gather(self, seqs: list[tuple[list[int], int, int, list[int]]]) -> np.ndarray:
        """The ``[len(seqs), longest table]`` block tables of ``build_step(seqs)``, zero-padded."""
        held, slots, width = self.held, [], 1
        append = slots.append
        # one test for the common row (current already), no builtin call per sequence: this loop
        # runs for every sequence of every step (a max() and an elif here doubled its time)
        for _, _, slot, table in seqs:
            n = len(table)
            written = held.get(slot)
            if written is None or written[0] is not table or written[1] != n:
                if written is not None and written[0] is table and written[1] < n:
                    self._write(slot, table, written[1], written[1])  # grown by appends
                else:
                    self._write(slot, table, 0, 0 if written is None else written[1])
            append(slot)
            if n > width:
                width = n
        return self.rows[slots, :width]

    def _write(self, slot: int, table: list[int], start: int, old: int) -> None:
        """Write ``table[start:]`` into ``slot``'s row, which held ``old`` entries (zeroed past it)."""
        n = len(table)
        if slot >= self.rows.shape[0] or n > self.rows.shape[1]:
            grown = np.zeros((max(slot + 1, self.rows.shape[0] * 2), max(n, self.rows.shape[1] * 2)), dtype=np.int32)
            grown[: self.rows.shape[0], : self.rows.shape[1]] = self.rows
            self.rows = grown
        row = self.rows[slot]
        row[start:n] = table[start:]
        if old > n:
            row[n:old] = 0
        self.held[slot] = (table, n)
