"""Sizing the latent-cache block pool and the KDA state-slot pool."""
from __future__ import annotations

from typing import NamedTuple

GIB = 1 << 30
# the cache budget of run, bench, serve and engine dirs when neither it nor both pool counts are given
DEFAULT_CACHE_MEMORY_GB = 2.0


class PoolSizes(NamedTuple):
    num_blocks: int
    max_slots: int


def size_pools(bytes_per_block: int, bytes_per_slot: int, *, block_size: int, max_batch_size: int,
               max_seq_len: int, cache_memory_gb: float | None = None, num_blocks: int | None = None,
               max_slots: int | None = None) -> PoolSizes:
    """Explicit counts win. Otherwise ``cache_memory_gb`` is split: state slots for up to
    ``max_batch_size`` sequences but at most half the budget, the rest to blocks, but no
    more blocks than ``max_slots`` sequences of ``max_seq_len`` tokens can use."""
    if num_blocks is not None and max_slots is not None:
        return PoolSizes(num_blocks, max_slots)
    if cache_memory_gb is None:
        raise ValueError("give the cache size: --cache-memory-gb, or both --num-blocks and --max-slots")
    budget = int(cache_memory_gb * GIB)
    if max_slots is None:
        affordable = budget // 2 // bytes_per_slot if bytes_per_slot else max_batch_size
        max_slots = min(max_batch_size, affordable)
        if max_slots < 1:
            raise ValueError(f"--cache-memory-gb {cache_memory_gb} cannot hold one KDA state row "
                             f"({bytes_per_slot / GIB:.3f} GiB each in half the budget)")
    if num_blocks is None:
        left = budget - max_slots * bytes_per_slot
        usable = max_slots * -(-max_seq_len // block_size)
        num_blocks = min(left // bytes_per_block, usable) if bytes_per_block else usable
        if num_blocks < 1:
            raise ValueError(f"--cache-memory-gb {cache_memory_gb} leaves no room for latent-cache blocks "
                             f"after {max_slots} state rows")
    return PoolSizes(num_blocks, max_slots)
