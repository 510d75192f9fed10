"""Sizing the cache pools from a memory budget."""
import pytest
import torch

from k3_trtllm.checkpoint.synth import preset_config
from k3_trtllm.config import parse_config
from k3_trtllm.model import K3Caches
from k3_trtllm.runtime.block_manager import GIB, size_pools


def test_explicit_counts_win():
    assert size_pools(100, 1000, block_size=16, max_batch_size=8, max_seq_len=64,
                      num_blocks=3, max_slots=2) == (3, 2, 0)


def test_budget_split_between_slots_and_blocks():
    # Slots for the whole batch fit in half the budget; blocks take the rest.
    pools = size_pools(1 << 20, 1 << 20, block_size=16, max_batch_size=8, max_seq_len=1 << 20,
                       cache_memory_gb=64 / 1024)
    assert pools == (64 - 8, 8, 0)
    # Slots are held to half the budget; an explicit slot count is kept.
    pools = size_pools(1 << 20, 10 << 20, block_size=16, max_batch_size=8, max_seq_len=1 << 20,
                       cache_memory_gb=64 / 1024)
    assert pools == (64 - 30, 3, 0)
    assert size_pools(1 << 20, 10 << 20, block_size=16, max_batch_size=8, max_seq_len=1 << 20,
                      cache_memory_gb=64 / 1024, max_slots=5).num_blocks == 64 - 50
    # No more blocks than max_slots sequences of max_seq_len can fill.
    assert size_pools(1, 1, block_size=16, max_batch_size=4, max_seq_len=33,
                      cache_memory_gb=1).num_blocks == 4 * 3


def test_budget_too_small_is_an_error():
    with pytest.raises(ValueError, match="cannot hold one KDA state row"):
        size_pools(1, GIB, block_size=16, max_batch_size=4, max_seq_len=64, cache_memory_gb=1)
    with pytest.raises(ValueError, match="no room for latent-cache blocks"):
        size_pools(GIB, GIB // 4, block_size=16, max_batch_size=2, max_seq_len=64, cache_memory_gb=1)
    with pytest.raises(ValueError, match="give the cache size"):
        size_pools(1, 1, block_size=16, max_batch_size=4, max_seq_len=64, num_blocks=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_allocated_pools_fit_the_budget(dtype):
    cfg = parse_config(preset_config("tiny"))
    budget_gb = 0.002
    pools = size_pools(K3Caches.bytes_per_block(cfg, 16, dtype), K3Caches.bytes_per_slot(cfg, dtype),
                       block_size=16, max_batch_size=8, max_seq_len=1 << 20, cache_memory_gb=budget_gb)
    caches = K3Caches.allocate(cfg, pools.num_blocks, 16, pools.max_slots, dtype)
    used = sum(t.numel() * t.element_size()
               for pool in (caches.latent, caches.conv, caches.recurrent) for t in pool.values())
    assert used <= budget_gb * GIB
    # One more block would not have fitted.
    assert used + K3Caches.bytes_per_block(cfg, 16, dtype) > budget_gb * GIB
