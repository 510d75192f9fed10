"""A model stand-in that checks the step metadata instead of doing math.

It keeps token ids where a model keeps its caches: the "latent cache" stores the id
written at each ``slot_mapping`` entry, the "state row" of each KDA slot stores the
ids it has absorbed. Every step it reads a sequence's context back through its block
table and compares it with its state row, so a block or slot handed to two sequences,
a stale ``context_lens``, a wrong ``has_initial_state`` or a phase (``decode``) that is not
the step's raises at once. Logits are
a fixed pseudo-random function of the whole token history, so, like a real model, a
sequence's next token does not depend on what else shares the step. Used by the
runtime tests and to time the runtime without a model.

Prefix-cache snapshot rows (``snapshot_slots`` of them, after the ``max_slots`` running rows)
hold token histories too; ``copy_states`` copies them and a prefill step writes the ones its
``snapshot_offsets`` ask for (the history up to that point), under the rules of the KDA
prefill contract, so restoring the wrong snapshot, or one whose blocks were overwritten since,
raises at the next step, and so does a snapshot point the kernels could not take.
"""
from __future__ import annotations

import torch

from k3_trtllm.model.step import StepInputs
from k3_trtllm.ops.contract import KDA_CHUNK

_NUM_LOGIT_ROWS = 4096
_HASH_MODULUS = (1 << 61) - 1


class SyntheticExecutor:
    writes_snapshots = True

    def __init__(self, vocab_size: int, num_blocks: int, block_size: int, max_slots: int,
                 seed: int = 0, snapshot_slots: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device("cpu")
        self.block_size = block_size
        self.latent_cache = [-1] * (num_blocks * block_size)
        self.max_slots = max_slots
        self.state_rows: list[list[int] | None] = [None] * (max_slots + snapshot_slots)
        self.state_hashes = [0] * (max_slots + snapshot_slots)
        self.copies = 0
        gen = torch.Generator().manual_seed(seed)
        self._logit_table = torch.randn(_NUM_LOGIT_ROWS, vocab_size, generator=gen)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        rows = len(self.state_rows)
        if any(not 0 <= r < rows for pair in copies for r in pair):
            raise ValueError(f"state copies {copies}: rows are 0..{rows - 1}")
        read = [(self.state_rows[src], self.state_hashes[src]) for src, _ in copies]
        for (_, dst), (row, h) in zip(copies, read):
            self.state_rows[dst] = None if row is None else list(row)
            self.state_hashes[dst] = h
        self.copies += len(copies)

    def execute(self, step: StepInputs, decode: bool) -> torch.Tensor:
        ids = step.input_ids.tolist()
        cu = step.cu_seqlens.tolist()
        pure_decode = len(ids) == len(cu) - 1 and all(c > 0 for c in step.context_lens.tolist())
        if decode != pure_decode:
            raise ValueError(f"step of {len(ids)} tokens from {len(cu) - 1} sequences given phase "
                             f"{'decode' if decode else 'prefill'}")
        slot_mapping = step.slot_mapping.tolist()
        tables = step.block_tables.tolist()
        points = self._snapshot_points(step, decode, cu)
        history_rows = []
        for b, (ctx, slot, has_state) in enumerate(zip(step.context_lens.tolist(), step.state_slots.tolist(),
                                                        step.has_initial_state.tolist())):
            state = self._state(slot, ctx, has_state)
            cached = self._read_context(tables[b], ctx)
            if cached != state:
                raise ValueError(f"sequence {b}: latent cache {cached[-8:]}... disagrees with state row "
                                 f"{slot} {state[-8:]}... (blocks {tables[b]}, context {ctx})")
            h = self.state_hashes[slot]
            for t in range(cu[b], cu[b + 1]):
                self.latent_cache[slot_mapping[t]] = ids[t]
                state.append(ids[t])
                h = (h * 1_000_003 + ids[t] + 1) % _HASH_MODULUS
                history_rows.append(h % _NUM_LOGIT_ROWS)
                if (row := points[b].get(t + 1 - cu[b])) is not None:
                    self.state_rows[row], self.state_hashes[row] = list(state), h
            self.state_hashes[slot] = h
        return self._logit_table[[history_rows[i] for i in step.logits_indices.tolist()]]

    def _snapshot_points(self, step: StepInputs, decode: bool, cu: list[int]) -> list[dict[int, int]]:
        """Per sequence ``{tokens into its chunk: state row}``, checked as the KDA prefill checks them."""
        if step.snapshot_offsets is None:
            return [{} for _ in cu[1:]]
        if decode:
            raise ValueError("a decode step carries snapshot points (the decode ops take none)")
        points, used = [], set()
        for b, (offs, rows) in enumerate(zip(step.snapshot_offsets.tolist(), step.snapshot_rows.tolist())):
            n, mine, last = cu[b + 1] - cu[b], {}, 0
            for o, r in zip(offs, rows):
                if o == -1:
                    continue
                row = self.max_slots + r
                if not (last < o <= n and (o % KDA_CHUNK == 0 or o == n)):
                    raise ValueError(f"sequence {b}: snapshot point {o} of a {n}-token chunk (after {last}) is "
                                     f"not a {KDA_CHUNK}-token boundary or its end")
                if not self.max_slots <= row < len(self.state_rows) or row in used:
                    raise ValueError(f"sequence {b}: snapshot row {r} out of range or taken twice")
                mine[o], last = row, o
                used.add(row)
            points.append(mine)
        return points

    def _state(self, slot: int, ctx: int, has_state: int) -> list[int]:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"state slot {slot} is not a running slot (0..{self.max_slots - 1})")
        if not has_state:
            if ctx:
                raise ValueError(f"state slot {slot}: has_initial_state=0 with {ctx} cached tokens")
            self.state_rows[slot] = []
            self.state_hashes[slot] = 0
        state = self.state_rows[slot]
        if state is None or len(state) != ctx:
            held = None if state is None else len(state)
            raise ValueError(f"state slot {slot} holds {held} tokens, context_lens says {ctx}")
        return state

    def _read_context(self, table: list[int], ctx: int) -> list[int]:
        bs = self.block_size
        out: list[int] = []
        for block in table[: -(-ctx // bs)]:
            out.extend(self.latent_cache[block * bs: (block + 1) * bs])
        return out[:ctx]
