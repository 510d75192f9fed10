"""Latent-cache blocks: a fixed pool of ``num_blocks`` blocks of ``block_size`` tokens."""
from __future__ import annotations

from k3_trtllm.runtime.sequence import Sequence


class BlockManager:
    """Hands out whole blocks from a free list and records them in each sequence's
    ``block_table``. There is no prefix sharing (a KDA state cannot be rebuilt from a
    shared prefix of blocks), so a block has exactly one owner and needs no ref count."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end; reversed so that block 0 is handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def capacity(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` could cache with its blocks plus every free one."""
        return (len(seq.block_table) + len(self._free)) * self.block_size - seq.num_cached_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_new_tokens`` more tokens."""
        needed = self.blocks_for(seq.num_cached_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self._free):
            raise ValueError(f"sequence {seq.seq_id} needs {needed} blocks, {len(self._free)} are free")
        for _ in range(needed):
            seq.block_table.append(self._free.pop())

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []
