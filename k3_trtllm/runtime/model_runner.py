"""The one place that turns scheduled sequences into step tensors and runs them."""
from __future__ import annotations

import torch

from k3_trtllm.model.step import build_step, is_pure_decode
from k3_trtllm.runtime.executor import Executor
from k3_trtllm.runtime.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, executor: Executor, block_size: int) -> None:
        self.executor = executor
        self.block_size = block_size

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run ``batch``; return fp32 logits ``[len(batch.sampling), vocab]``, one row per
        sampling sequence in order. A prefill chunk that leaves part of its prompt for a
        later step asks for no logits."""
        seqs = [(seq.token_ids[seq.num_cached_tokens: seq.num_cached_tokens + n], seq.num_cached_tokens,
                 seq.state_slot, seq.block_table) for seq, n in batch.entries]
        step = build_step(seqs, self.block_size)
        if len(batch.sampling) != len(batch.entries):
            samples = [n == seq.num_uncached_tokens for seq, n in batch.entries]
            last_tokens = step.cu_seqlens[1:] - 1
            step.logits_indices = last_tokens[torch.tensor(samples, dtype=torch.bool)]
        # prefix cache: restored KDA states must be in their slots before the step reads
        # them, and saved snapshots are the states the step leaves behind
        if batch.restores:
            self.executor.copy_states(batch.restores)
        # the phase is decided here, once, from host lists: every layer below follows it
        logits = self.executor.execute(step, is_pure_decode(seqs))
        if batch.saves:
            self.executor.copy_states(batch.saves)
        if logits.shape[0] != len(batch.sampling):
            raise ValueError(f"executor returned logits of shape {tuple(logits.shape)}; "
                             f"expected {len(batch.sampling)} rows")
        return logits
