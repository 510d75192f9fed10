"""Decides which tokens of which sequences run in the next step. Pure bookkeeping:
no tensors, no model; the engine runs the batch and reports the sampled tokens back."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from k3_trtllm.runtime.block_manager import BlockManager, PrefixCache, StateSlots
from k3_trtllm.runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """``entries`` are ``(sequence, num_new_tokens)``: run ``token_ids[num_cached_tokens:
    num_cached_tokens + num_new_tokens]`` of each. ``sampling`` lists the sequences whose
    chunk reaches the end of their tokens, in entry order: only they sample a token.

    With the prefix cache, ``restores`` are the KDA state copies ``(snapshot row, slot)`` to
    run before the step (sequences admitted on a cached prefix) and ``snapshots`` the KDA
    snapshots the step takes, ``(entry index, tokens into its chunk, snapshot row)``: the
    model runner hands them to the prefill ops, or copies the state rows after the step
    where they end their chunk (see ``PrefixCache``); rows are in ``PrefixCache``'s namespace."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class StepResult:
    """What one step did to one sequence that sampled."""

    seq: Sequence
    new_token_id: int
    finished: bool


class Scheduler:
    """FCFS over ``waiting``/``running``. Each step schedules, within ``max_num_tokens``
    tokens and ``max_batch_size`` sequences: every running decode (in arrival order),
    then the next prefill chunk of running sequences whose prompt is not fully cached,
    then new sequences from ``waiting``. When a running sequence needs a block and none
    is free, the newest running sequence not yet scheduled in this step is preempted by
    recompute (blocks and state slot freed, back to the front of ``waiting`` with all
    its tokens uncached); if there is none, the sequence preempts itself. No new
    sequence is admitted in a step that preempted, so freed blocks go to the running
    ones first. A new sequence needs a free state slot; running out of slots only makes
    it wait, since running sequences never need a second one.

    With a ``prefix`` cache, a new sequence starts from the deepest cached prefix with a KDA
    snapshot (its blocks shared, its state restored, only the rest computed), and every chunk
    takes the snapshots of the positions it covers; it ends at one only where the prefill
    cannot take it mid-chunk (``PrefixCache.clip``). Cached blocks count as free: they are
    evicted before any running sequence is preempted."""

    def __init__(self, blocks: BlockManager, slots: StateSlots, max_batch_size: int,
                 max_num_tokens: int, eos_token_ids: tuple[int, ...] = (),
                 prefix: PrefixCache | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self.blocks = blocks
        self.slots = slots
        self.prefix = prefix
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; refuse one that could never fit the cache pool alone."""
        worst_case = seq.num_prompt_tokens + seq.sampling.max_new_tokens
        if self.blocks.blocks_for(worst_case) > self.blocks.num_blocks:
            raise ValueError(
                f"request needs up to {worst_case} tokens ({seq.num_prompt_tokens} prompt + "
                f"{seq.sampling.max_new_tokens} new) but the latent cache holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}; raise the cache size")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def schedule(self) -> ScheduledBatch:
        if self.prefix is not None:
            # snapshots still pending belong to a step that raised (postprocess commits them)
            self.prefix.discard_pending()
        batch = ScheduledBatch()
        scheduled: set[int] = set()
        budget = self.max_num_tokens
        preemptions_before = self.num_preemptions
        # Decodes first, then prefill chunks of running sequences. Iterate over a copy:
        # preemption removes sequences from self.running. The decode pass sets the prefills
        # aside in running order for the second (a sequence's phase changes only when it is
        # preempted, which the status check skips), so a batch of decodes is walked once; a
        # pass stopped by the budget or the batch size leaves nothing for the second.
        prefills: list[Sequence] = []
        # Without the prefix cache every block is owned by one sequence, so a decode whose token
        # fits its last block needs no block, can preempt nobody and writes where it may: it is
        # scheduled here as ``_schedule`` would, without the calls (every decode of every step).
        fits = self.blocks.block_size if self.prefix is None else 0
        entries, sampling = batch.entries, batch.sampling
        for decode_pass in (True, False):
            for seq in list(self.running) if decode_pass else prefills:
                if budget == 0 or len(entries) == self.max_batch_size:
                    prefills = []
                    break
                if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                    continue
                if decode_pass:
                    if seq.num_uncached_tokens != 1:
                        prefills.append(seq)
                        continue
                    if seq.num_cached_tokens < len(seq.block_table) * fits:
                        entries.append((seq, 1))
                        sampling.append(seq)
                        scheduled.add(seq.seq_id)
                        budget -= 1
                        continue
                capacity = self._make_room(seq, scheduled)
                if capacity == 0:
                    continue  # seq preempted itself
                # A prefill chunk shrinks to the room there is instead of preempting more.
                n = min(seq.num_uncached_tokens, budget, capacity)
                if self.prefix:
                    n = self.prefix.clip(seq.num_cached_tokens, n, seq.num_uncached_tokens)
                budget -= self._schedule(batch, scheduled, seq, n)
        if self.num_preemptions == preemptions_before:
            self._admit(batch, scheduled, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, scheduled: set[int], budget: int) -> None:
        while (self.waiting and budget > 0 and len(batch.entries) < self.max_batch_size
               and len(self.running) < self.max_batch_size and self.slots.num_free > 0):
            seq = self.waiting[0]
            hit = self.prefix.lookup(seq) if self.prefix else None
            cached = hit.num_tokens if hit else 0
            remaining = len(seq.token_ids) - cached
            n = min(remaining, budget)
            # the hit's blocks are full, and the cached ones among them stop being free
            capacity = (self.blocks.num_free - (self.blocks.num_reclaimed_by(hit.blocks) if hit else 0)) \
                * self.blocks.block_size
            if self.prefix:
                n = self.prefix.clip(cached, n, remaining)
            if capacity < n:
                # Start on a smaller chunk only when nothing else runs: otherwise the
                # sequence would hold blocks it cannot use and be the next victim.
                if self.running or capacity == 0:
                    break
                n = capacity
            self.waiting.popleft()
            seq.state_slot = self.slots.acquire()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.prefix:
                self.prefix.queries += 1
                if hit:
                    batch.restores.append(self.prefix.restore(seq, hit))
                if seq.num_preemptions == 0:
                    seq.prefix_cached_tokens = cached
            budget -= self._schedule(batch, scheduled, seq, n)

    def _schedule(self, batch: ScheduledBatch, scheduled: set[int], seq: Sequence, n: int) -> int:
        self.blocks.allocate(seq, n)
        batch.entries.append((seq, n))
        if self.prefix:
            entry = len(batch.entries) - 1
            batch.snapshots += [(entry, offset, row) for offset, row in self.prefix.take(seq, n)]
        if n == seq.num_uncached_tokens:
            batch.sampling.append(seq)
        scheduled.add(seq.seq_id)
        return n

    def _make_room(self, seq: Sequence, scheduled: set[int]) -> int:
        """Preempt the newest unscheduled running sequences until ``seq`` can cache at
        least one more token; return how many it can cache (0: it preempted itself)."""
        while (capacity := self.blocks.capacity(seq)) == 0:
            victim = next((s for s in reversed(self.running)
                           if s is not seq and s.seq_id not in scheduled), seq)
            self._preempt(victim)
            if victim is seq:
                return 0
        return capacity

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.state_slot is not None:
            self.slots.release(seq.state_slot)
            seq.state_slot = None

    def postprocess(self, batch: ScheduledBatch, sampled: list[int], now: float) -> list[StepResult]:
        """Record that ``batch`` ran and ``sampled[i]`` is the token of ``batch.sampling[i]``."""
        if len(sampled) != len(batch.sampling):
            raise ValueError(f"got {len(sampled)} sampled tokens for {len(batch.sampling)} sampling sequences")
        for seq, n in batch.entries:
            seq.num_cached_tokens += n
        if self.prefix:
            for seq, n in batch.entries:
                self.blocks.register(seq, seq.num_cached_tokens - n, seq.num_cached_tokens)
            self.prefix.commit()
        results = []
        any_finished = False
        for seq, token in zip(batch.sampling, sampled):
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason, now)
                any_finished = True
            results.append(StepResult(seq, token, reason is not None))
        if any_finished:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return results

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "eos"
        if seq.num_output_tokens >= params.max_new_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now

    def abort(self, seq: Sequence, now: float) -> None:
        """Drop an unfinished sequence between steps, freeing its blocks and slot."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            return
        self._finish(seq, "abort", now)
