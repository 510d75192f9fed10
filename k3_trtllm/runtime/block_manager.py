"""The cache bookkeeping: latent-cache blocks (a fixed pool of ``num_blocks`` blocks of
``block_size`` tokens), KDA state slots (one conv + recurrent state row per running sequence),
the prefix cache over both (shared full blocks and KDA state snapshots) and how a cache budget
is split between the pools."""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import NamedTuple

from k3_trtllm.ops.contract import KDA_CHUNK
from k3_trtllm.runtime.sequence import Sequence

GIB = 1 << 30
# the cache budget of run, bench, serve and engine dirs when neither it nor both pool counts are given
DEFAULT_CACHE_MEMORY_GB = 2.0
# tokens between KDA state snapshots when --prefix-cache-interval is 0 (rounded up to a multiple of
# the block size). The prefill kernels write snapshots mid-chunk (see PrefixCache), so the interval
# costs no prefill steps; a smaller one finds deeper hits but needs more snapshot rows.
DEFAULT_PREFIX_CACHE_INTERVAL = 512
# with the prefix cache on and no --prefix-cache-snapshots, snapshot rows get this share of the budget
SNAPSHOT_BUDGET_SHARE = 0.25


class PoolSizes(NamedTuple):
    num_blocks: int
    max_slots: int
    snapshot_slots: int = 0


def resolve_prefix_interval(interval: int | None, block_size: int) -> int:
    """The snapshot interval: 0/None is the default (rounded up to a block multiple); anything
    else must be a positive multiple of ``block_size`` (snapshots sit on block boundaries, so a
    restored sequence never writes into a shared block)."""
    if not interval:
        return -(-DEFAULT_PREFIX_CACHE_INTERVAL // block_size) * block_size
    if interval < 0 or interval % block_size:
        raise ValueError(f"--prefix-cache-interval {interval} must be a positive multiple of the block size "
                         f"{block_size} (or 0 for the default {DEFAULT_PREFIX_CACHE_INTERVAL})")
    return interval


def size_pools(bytes_per_block: int, bytes_per_slot: int, *, block_size: int, max_batch_size: int,
               max_seq_len: int, cache_memory_gb: float | None = None, num_blocks: int | None = None,
               max_slots: int | None = None, prefix_cache: bool = False, snapshot_slots: int | None = None,
               prefix_cache_interval: int | None = None) -> PoolSizes:
    """Explicit counts win. Otherwise ``cache_memory_gb`` is split: state slots for up to
    ``max_batch_size`` sequences but at most half the budget; with ``prefix_cache``, KDA state
    snapshot rows (each the size of a state slot) for a quarter of the budget, but no more
    than one per interval of ``max_slots`` sequences of ``max_seq_len`` tokens; the rest to
    blocks, but no more blocks than ``max_slots`` sequences of ``max_seq_len`` tokens can use
    plus (with the prefix cache) one interval of blocks behind every snapshot row: those hold
    cached prefixes. Given both pool counts and no budget, the snapshot rows default to
    ``default_snapshot_rows`` (memory beside the given pools, which the CLI states on stderr).
    Snapshot rows are 0 without the prefix cache."""
    if snapshot_slots is not None and snapshot_slots < (1 if prefix_cache else 0):
        raise ValueError(f"--prefix-cache-snapshots {snapshot_slots} must be >= 1 with the prefix cache on")
    interval = resolve_prefix_interval(prefix_cache_interval, block_size) if prefix_cache else 0
    if not prefix_cache:
        snapshot_slots = 0
    if num_blocks is not None and max_slots is not None and (snapshot_slots is not None or cache_memory_gb is None):
        if snapshot_slots is None:
            snapshot_slots = default_snapshot_rows(num_blocks, max_slots, block_size, interval) if prefix_cache else 0
        return PoolSizes(num_blocks, max_slots, snapshot_slots)
    if cache_memory_gb is None:
        raise ValueError("give the cache size: --cache-memory-gb, or both --num-blocks and --max-slots")
    budget = int(cache_memory_gb * GIB)
    if max_slots is None:
        affordable = budget // 2 // bytes_per_slot if bytes_per_slot else max_batch_size
        max_slots = min(max_batch_size, affordable)
        if max_slots < 1:
            raise ValueError(f"--cache-memory-gb {cache_memory_gb} cannot hold one KDA state row "
                             f"({bytes_per_slot / GIB:.3f} GiB each in half the budget)")
    if snapshot_slots is None:
        useful = max_slots * -(-max_seq_len // interval)
        share = int(budget * SNAPSHOT_BUDGET_SHARE)
        snapshot_slots = min(share // bytes_per_slot, useful) if bytes_per_slot else useful
        if snapshot_slots < 1:
            raise ValueError(f"--cache-memory-gb {cache_memory_gb} cannot hold one KDA state snapshot "
                             f"({bytes_per_slot / GIB:.3f} GiB each in a quarter of the budget); "
                             "give --prefix-cache-snapshots or turn the prefix cache off")
    if num_blocks is None:
        left = budget - (max_slots + snapshot_slots) * bytes_per_slot
        usable = max_slots * -(-max_seq_len // block_size) + snapshot_slots * (interval // block_size)
        num_blocks = min(left // bytes_per_block, usable) if bytes_per_block else usable
        if num_blocks < 1:
            raise ValueError(f"--cache-memory-gb {cache_memory_gb} leaves no room for latent-cache blocks "
                             f"after {max_slots} state rows and {snapshot_slots} snapshot rows")
    return PoolSizes(num_blocks, max_slots, snapshot_slots)


def default_snapshot_rows(num_blocks: int, max_slots: int, block_size: int, interval: int) -> int:
    """Snapshot rows for explicit ``--num-blocks``/``--max-slots`` without a budget or
    ``--prefix-cache-snapshots``: they are memory the user did not size, so no more than are
    useful: one per state slot (each running sequence leaves its deepest snapshot), and no
    more than the given blocks can keep the prefixes of (a held snapshot needs an interval of
    cached blocks behind it, as the budget split assumes), but at least one."""
    return max(1, min(max_slots, num_blocks * block_size // interval))


def chain_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """The chain hashes of ``seq``'s first ``num_blocks`` full blocks of ``block_size`` tokens
    (one engine, one block size): block i's is the blake2b of block i-1's hash and block i's
    token ids, so equal hashes mean equal prefixes. Cached on the sequence: its tokens only
    ever grow, so the hash of a full block never changes."""
    hashes, bs = seq.block_hashes, block_size
    pack = struct.Struct(f"<{bs}I").pack  # the block's ids as 4-byte little-endian words, in one call
    while len(hashes) < num_blocks:
        i = len(hashes)
        h = hashlib.blake2b(hashes[-1] if hashes else b"k3-trt prefix", digest_size=16)
        h.update(pack(*seq.token_ids[i * bs: (i + 1) * bs]))
        hashes.append(h.digest())
    return hashes[:num_blocks]


class BlockManager:
    """Hands out whole blocks and records them in each sequence's ``block_table``.

    Every block is in one of three states: free (never holding a known prefix), owned (a
    reference count > 0) or cached (count 0, still holding the full block of a known chain
    hash, ``register``ed after it was computed). Full blocks of a known hash are shared
    between sequences (``share``); they are immutable: ``allocate`` refuses to let a
    sequence write into a block it shares or one holding a known hash. Allocation takes free
    blocks first, then evicts the least recently released cached block. Without the prefix
    cache nothing is registered, so every block is free or owned by one sequence."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end; reversed so that block 0 is handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def capacity(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` could cache with its blocks plus every free one."""
        return (len(seq.block_table) + self.num_free) * self.block_size - seq.num_cached_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_new_tokens`` more tokens."""
        # every decode step of every sequence comes here: the block arithmetic is inlined, and a
        # step that fills no new block (most decode steps) stops after the write check
        start, table = seq.num_cached_tokens, seq.block_table
        end = -(-(start + num_new_tokens) // self.block_size)
        for block in table[start // self.block_size: end]:
            if self._refs[block] != 1 or self._hash_of[block] is not None:
                raise ValueError(f"sequence {seq.seq_id} would write tokens {start}.. into block {block}, which is "
                                 f"shared ({self._refs[block]} owners) or holds a cached prefix")
        needed = end - len(table)
        if needed <= 0:
            return
        if needed > self.num_free:
            raise ValueError(f"sequence {seq.seq_id} needs {needed} blocks, {self.num_free} are free")
        for _ in range(needed):
            block = self._take()
            self._refs[block] = 1
            table.append(block)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._lru.popitem(last=False)
        del self._by_hash[self._hash_of[block]]
        self._hash_of[block] = None
        self.num_evicted += 1
        return block

    def free(self, seq: Sequence) -> None:
        # The deepest block is released first, so it is evicted first: a prefix stays
        # usable from its start for as long as possible.
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._hash_of[block] is None:
                    self._free.append(block)
                else:
                    self._lru[block] = None
        seq.block_table = []

    # -- prefix sharing ----------------------------------------------------------

    def cached_block(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def num_reclaimed_by(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached (count 0): sharing them takes them off ``num_free``."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a sequence with no blocks the cached full blocks of its prefix."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        for block in blocks:
            if self._hash_of[block] is None:
                raise ValueError(f"block {block} holds no cached prefix")
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1
        seq.block_table = list(blocks)

    def register(self, seq: Sequence, start: int, end: int) -> None:
        """Record the hashes of ``seq``'s blocks that became full while its cached tokens grew
        from ``start`` to ``end``. A hash another block holds already (the same prefix computed
        twice at once) keeps that block; this one stays private."""
        bs = self.block_size
        if start // bs == end // bs:  # no block filled: most decode steps, no hashing
            return
        hashes = chain_hashes(seq, bs, end // bs)
        for i in range(start // bs, end // bs):
            block = seq.block_table[i]
            if hashes[i] not in self._by_hash and self._hash_of[block] is None:
                self._by_hash[hashes[i]] = block
                self._hash_of[block] = hashes[i]

    def check(self, owners: list[Sequence]) -> None:
        """Raise unless the counts are exactly the references of ``owners`` and every block is
        free, owned or cached, and every known hash names the block holding it."""
        refs = [0] * self.num_blocks
        for seq in owners:
            for block in seq.block_table:
                refs[block] += 1
        if refs != self._refs:
            bad = [b for b in range(self.num_blocks) if refs[b] != self._refs[b]]
            raise AssertionError(f"block reference counts disagree with the block tables at blocks {bad[:8]}")
        free, cached = set(self._free), set(self._lru)
        for b in range(self.num_blocks):
            kind = (b in free) + (b in cached) + (self._refs[b] > 0)
            if kind != 1:
                raise AssertionError(f"block {b} is in {kind} of free / cached / owned")
            if b in free and self._hash_of[b] is not None or b in cached and self._hash_of[b] is None:
                raise AssertionError(f"block {b}: free with a hash, or cached without one")
        if any(self._hash_of[b] != h for h, b in self._by_hash.items()) or \
                len(self._by_hash) != sum(h is not None for h in self._hash_of):
            raise AssertionError("the hash index and the blocks' hashes disagree")


class StateSlots:
    """A free list over the ``max_slots`` rows of the KDA conv/recurrent state pools."""

    def __init__(self, max_slots: int) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self._free = list(range(max_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def acquire(self) -> int:
        if not self._free:
            raise ValueError(f"all {self.max_slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)


class PrefixHit(NamedTuple):
    num_tokens: int  # the restored position (a multiple of the interval)
    blocks: list[int]  # the cached full blocks of the first num_tokens tokens
    snapshot_row: int  # the state row holding the KDA state at num_tokens


class PrefixCache:
    """KDA state snapshots and the hits they allow, over a ``BlockManager``'s shared blocks.

    State rows are one namespace over two pools: rows ``[0, max_slots)`` are the running
    sequences' slots (the pools every step binds), rows ``[max_slots, max_slots +
    snapshot_slots)`` the snapshot pool (separate tensors, so the step's pools, CUDA graphs
    and engine profiles keep their shapes). A snapshot row holds the KDA conv + recurrent state
    of some sequence at a position ``k * interval``, keyed by the chain hash of its blocks up to
    there. It is usable while those blocks are all cached; snapshot rows are evicted least
    recently used first, as blocks are, and never hold up a running sequence.

    How a snapshot gets written (``take`` reserves the rows of the positions a chunk covers):
    with ``mid_chunk`` (an executor whose prefill ops write the snapshots, as FlashKDA's
    checkpoint-state arguments do) the step asks the KDA prefill for the state after ``o`` of
    the chunk's tokens, which the kernels hold at every ``KDA_CHUNK``-token boundary of the
    chunk and at its end; a position that is neither (a chunk starting off the grid, e.g.
    after a budget-cut chunk) ends the chunk there (``clip``). Without ``mid_chunk`` every
    position ends its chunk, and the state row the step leaves is copied to the snapshot row
    after it. Pure-decode steps take theirs by that copy too (the decode ops take none)."""

    def __init__(self, blocks: BlockManager, max_slots: int, snapshot_slots: int, interval: int,
                 mid_chunk: bool = False) -> None:
        if snapshot_slots < 1:
            raise ValueError(f"--prefix-cache-snapshots {snapshot_slots} must be >= 1 with the prefix cache on")
        if interval < 1 or interval % blocks.block_size:
            raise ValueError(f"--prefix-cache-interval {interval} must be a positive multiple of the block size "
                             f"{blocks.block_size}")
        self.blocks = blocks
        self.interval = interval
        self.mid_chunk = mid_chunk
        self.snapshot_slots = snapshot_slots
        self.first_row = max_slots
        self._free = list(range(max_slots + snapshot_slots - 1, max_slots - 1, -1))
        self._row_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # rows holding a snapshot, least recent first
        self._pending: dict[int, bytes] = {}  # rows a save of the running step writes
        self.reset_counters()

    @property
    def snapshots_in_use(self) -> int:
        return len(self._lru)

    def reset_counters(self) -> None:
        self.queries = self.hits = self.cached_tokens = 0
        self.snapshots_taken = self.evicted_snapshots = 0

    def lookup(self, seq: Sequence) -> PrefixHit | None:
        """The deepest snapshot position ``p <= len(tokens) - 1`` (the last token always runs,
        for its logits) whose blocks are all cached and whose snapshot is held."""
        bs, s = self.blocks.block_size, self.interval
        limit = (len(seq.token_ids) - 1) // s * s
        hashes = chain_hashes(seq, bs, limit // bs)
        found: list[int] = []
        for h in hashes:
            block = self.blocks.cached_block(h)
            if block is None:
                break
            found.append(block)
        for p in range(len(found) * bs // s * s, 0, -s):
            row = self._row_of.get(hashes[p // bs - 1])
            if row is not None:
                return PrefixHit(p, found[: p // bs], row)
        return None

    def restore(self, seq: Sequence, hit: PrefixHit) -> tuple[int, int]:
        """Share the hit's blocks with ``seq`` (which holds a state slot) and return the copy
        ``(snapshot row, slot)`` the executor runs before the step."""
        self.blocks.share(seq, hit.blocks)
        seq.num_cached_tokens = hit.num_tokens
        self._lru.move_to_end(hit.snapshot_row)
        self.hits += 1
        self.cached_tokens += hit.num_tokens
        return hit.snapshot_row, seq.state_slot

    def clip(self, start: int, n: int, remaining: int) -> int:
        """``n`` (of the ``remaining`` tokens to compute) shortened so that a chunk of it from
        token ``start`` can take every snapshot position it crosses: it ends at the first one
        that is not ``KDA_CHUNK``-aligned from ``start`` (every one without ``mid_chunk``). With
        ``mid_chunk``, a chunk cut short by the budget ends on the ``KDA_CHUNK`` grid when it
        can, so that the next one starts on it and takes its positions mid-chunk too."""
        s = self.interval
        for p in range((start // s + 1) * s, start + n, s):
            if not self.mid_chunk or (p - start) % KDA_CHUNK:
                return p - start
        if self.mid_chunk and n < remaining and (start + n) // KDA_CHUNK * KDA_CHUNK > start:
            return (start + n) // KDA_CHUNK * KDA_CHUNK - start
        return n

    def take(self, seq: Sequence, n: int) -> list[tuple[int, int]]:
        """The snapshots a chunk of ``n`` tokens (``clip``-ped) takes: ``(tokens into the chunk,
        row)`` for each position in it whose snapshot is not held already, while rows last."""
        start, s, bs = seq.num_cached_tokens, self.interval, self.blocks.block_size
        positions = range((start // s + 1) * s, start + n + 1, s)
        if not positions:
            return []
        hashes = chain_hashes(seq, bs, positions[-1] // bs)
        taken = []
        for p in positions:
            row = self._reserve(hashes[p // bs - 1])
            if row is not None:
                taken.append((p - start, row))
        return taken

    def _reserve(self, h: bytes) -> int | None:
        """A row for the snapshot of hash ``h``, or None when it is held already (then it
        becomes the most recently used), written in this step or no row can be had."""
        if h in self._row_of:
            self._lru.move_to_end(self._row_of[h])
            return None
        if h in self._pending.values():
            return None
        if self._free:
            row = self._free.pop()
        elif self._lru:
            row, _ = self._lru.popitem(last=False)
            del self._row_of[self._hash_of.pop(row)]
            self.evicted_snapshots += 1
        else:
            return None
        self._pending[row] = h
        return row

    def discard_pending(self) -> None:
        """The last step's snapshots were not taken (it raised before ``commit``): their rows
        hold nothing and go back to the free list, never to the index."""
        self._free.extend(self._pending)
        self._pending.clear()

    def commit(self) -> None:
        """The step ran: the rows it took snapshots into hold them now."""
        for row, h in self._pending.items():
            self._row_of[h] = row
            self._hash_of[row] = h
            self._lru[row] = None
            self.snapshots_taken += 1
        self._pending.clear()

    def check(self) -> None:
        """Raise unless every snapshot row is free or holds exactly one indexed snapshot."""
        rows = range(self.first_row, self.first_row + self.snapshot_slots)
        free, held = set(self._free), set(self._lru)
        if self._pending or free & held or free | held != set(rows) or len(self._free) != len(free):
            raise AssertionError(f"snapshot rows: {len(free)} free, {len(held)} held, {len(self._pending)} "
                                 f"pending, of {self.snapshot_slots}")
        if set(self._hash_of) != held or any(self._row_of[h] != r for r, h in self._hash_of.items()) or \
                len(self._row_of) != len(held):
            raise AssertionError("the snapshot index and the rows' hashes disagree")
