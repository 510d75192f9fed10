"""Prefix caching (issue 22): shared full latent-cache blocks (chain-hashed, ref-counted, LRU
cached when free) and KDA state snapshots every ``interval`` tokens, restored on a hit.

Every token comparison is against the same engine with the prefix cache off, through the
SyntheticExecutor (which checks every block table and state row against the token history,
so a wrong share or restore raises) and through the real tiny K3 model in fp32 (world 1, and
world 2 over gloo in fp64 as tests/test_runtime_world.py does). The expected ``cached_tokens``
are computed here from the token lists alone: a request's hit is the deepest multiple of the
interval that is at most its prompt length - 1 and within its common prefix with a token
history computed before it (a prompt plus all but the last of its outputs)."""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch

from k3_trtllm.model import K3Caches, load_model
from k3_trtllm.runtime.block_manager import (DEFAULT_PREFIX_CACHE_INTERVAL, BlockManager, PrefixCache,
                                             chain_hashes, resolve_prefix_interval, size_pools)
from k3_trtllm.runtime.engine import EngineConfig, LLMEngine, build_engine
from k3_trtllm.runtime.executor import TorchExecutor
from k3_trtllm.runtime.sequence import SamplingParams, Sequence
from k3_trtllm.runtime.testing.synthetic_executor import SyntheticExecutor

BS, S = 4, 8  # block size, snapshot interval
VOCAB, EOS = 64, 2
TINY_K3 = Path(__file__).resolve().parents[1] / "examples/tiny-k3"


def make_seq(seq_id: int, tokens: list[int], slot: int | None = None) -> Sequence:
    seq = Sequence(seq_id, tokens, SamplingParams(), 0.0)
    seq.state_slot = slot
    return seq


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_hit(prompt: list[int], histories: list[list[int]], interval: int = S) -> int:
    return max([min(common_prefix(prompt, h), len(prompt) - 1) // interval * interval for h in histories] + [0])


def history(result) -> list[int]:
    """The tokens a finished request computed into the caches (its last token never ran)."""
    return result.prompt_token_ids + result.output_token_ids[:-1]


def check_all_released(engine: LLMEngine) -> None:
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    sched.blocks.check([])  # every count is 0: each block free or cached
    assert sched.blocks.num_used == 0 and sched.slots.num_used == 0
    if sched.prefix is not None:
        sched.prefix.check()  # every snapshot row free or holding one indexed snapshot


def shared_prefix_workload(n: int, seed: int, vocab: int, max_new: int = 8):
    """Prompts cut from three base texts at lengths below, at and above the interval (and
    several intervals deep), each with its own tail; some repeat a whole earlier prompt."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(3)]
    prompts, params = [], []
    for i in range(n):
        k = rng.choice([0, 3, 7, 8, 9, 12, 15, 16, 17, 24, 33])
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(0 if k else 1, 6))]
        prompts.append(bases[i % 3][:k] + tail)
        params.append(SamplingParams(max_new_tokens=rng.randint(1, max_new)))
    for i in range(0, n, 5):  # exact repeats: the hit stops one interval short of the last token
        prompts[i] = list(prompts[max(0, i - 3)])
    return prompts, params


# -- the block manager and the snapshot pool ---------------------------------------

def test_chain_hash_is_blake2b_of_the_previous_hash_and_the_block():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    expect, prev = [], b"k3-trt prefix"
    for i in range(2):
        h = hashlib.blake2b(prev, digest_size=16)
        for t in tokens[i * BS: (i + 1) * BS]:
            h.update(t.to_bytes(4, "little"))
        prev = h.digest()
        expect.append(prev)
    assert chain_hashes(make_seq(0, tokens), BS, 2) == expect
    same_start = chain_hashes(make_seq(1, tokens[:4] + [99] * 4), BS, 2)
    assert same_start[0] == expect[0] and same_start[1] != expect[1]
    # the same second block after another first block is another prefix
    assert chain_hashes(make_seq(2, [1, 2, 3, 4] + tokens[4:8]), BS, 2)[1] != expect[1]


def test_chain_hashing_updates_each_block_once(monkeypatch):
    """The hit path hashes a whole prompt prefix (64 blocks of a 4k one): one update per block
    of its packed ids, not one per token; the digests are the definition's (test above)."""
    import k3_trtllm.runtime.block_manager as bm_module

    updates, blake2b = [], hashlib.blake2b

    class Counting:
        def __init__(self, *args, **kwargs):
            self.h = blake2b(*args, **kwargs)

        def update(self, data):
            updates.append(len(data))
            self.h.update(data)

        def digest(self):
            return self.h.digest()

    tokens = [3 + i % 1000 for i in range(4096)]
    expect = chain_hashes(make_seq(0, tokens), 64, 64)
    monkeypatch.setattr(bm_module.hashlib, "blake2b", Counting)
    assert chain_hashes(make_seq(1, tokens), 64, 64) == expect
    assert updates == [64 * 4] * 64


def test_state_copies_without_overlap_are_one_fused_copy_of_row_views():
    """Restores (snapshot -> slot) and the copies after a step (slot -> snapshot) read no row they
    write: the rows are copied as views, every layer in one _foreach_copy_ per pool kind (no index
    tensors staged to the device, no gathered temporaries), with the values of the general path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = load_model(TINY_K3, dtype=torch.float32).config
    caches = K3Caches.allocate(cfg, 2, BS, 3, torch.float32, snapshot_slots=3)
    gen = torch.Generator().manual_seed(1)
    for pool in (caches.conv, caches.recurrent, caches.snapshot_conv, caches.snapshot_recurrent):
        for t in pool.values():
            t.copy_(torch.randn(t.shape, generator=gen))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    for copies in ([(4, 0)], [(3, 1), (5, 2)], [(0, 3), (2, 5)]):
        run = lambda c: [torch.cat([c.conv[i], c.snapshot_conv[i]]).clone() for i in c.conv] + \
            [torch.cat([c.recurrent[i], c.snapshot_recurrent[i]]).clone() for i in c.recurrent]
        before = run(caches)
        with Ops() as ops:
            caches.copy_states(copies)
        assert [f.__name__ for f in ops.seen if "copy" in f.__name__ or "index" in f.__name__] == \
            ["_foreach_copy_.default"] * 2, ops.seen
        for old, new in zip(before, run(caches)):
            expect = old.clone()
            for src, dst in copies:
                expect[dst] = old[src]
            assert torch.equal(new, expect)


def _computed(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """A sequence whose tokens were all computed: its blocks allocated and registered."""
    seq = make_seq(seq_id, tokens)
    bm.allocate(seq, len(tokens))
    bm.register(seq, 0, len(tokens))
    seq.num_cached_tokens = len(tokens)
    return seq


def test_cached_blocks_are_evicted_least_recently_used_first_after_free_ones():
    bm = BlockManager(7, BS)
    a, b, c = (_computed(bm, i, [10 * i + t for t in range(8)]) for i in range(1, 4))
    blocks = {s.seq_id: list(s.block_table) for s in (a, b, c)}
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_cached == 6 and bm.num_free == 7 and bm.num_used == 0
    # sharing b's prefix again makes its blocks the most recently used once released
    e = make_seq(5, b.token_ids + [1])
    hashes = chain_hashes(e, BS, 2)
    shared = [bm.cached_block(h) for h in hashes]
    assert shared == blocks[2]
    bm.share(e, shared)
    assert bm.num_used == 2
    bm.free(e)
    bm.check([])
    # the one never-used block goes first, then a (deepest block first), then c
    d = make_seq(6, list(range(100, 116)))
    bm.allocate(d, 16)
    assert d.block_table == [6, blocks[1][1], blocks[1][0], blocks[3][1]]
    assert bm.num_evicted == 3
    assert [bm.cached_block(h) for h in chain_hashes(a, BS, 2)] == [None, None]
    assert bm.cached_block(chain_hashes(c, BS, 1)[0]) == blocks[3][0]
    assert [bm.cached_block(h) for h in hashes] == blocks[2]
    bm.check([d])


def test_a_shared_or_cached_block_is_never_written():
    bm = BlockManager(4, BS)
    a = _computed(bm, 0, list(range(3, 11)))
    b = make_seq(1, a.token_ids[:6])
    bm.share(b, a.block_table[:1])
    b.num_cached_tokens = 2  # pretend b resumes inside the shared block
    with pytest.raises(ValueError, match="shared"):
        bm.allocate(b, 1)
    b.num_cached_tokens = 4  # at the block boundary it writes a block of its own
    bm.allocate(b, 2)
    assert b.block_table[1] not in a.block_table
    bm.check([a, b])


def test_snapshot_rows_are_evicted_least_recently_used_first():
    bm = BlockManager(16, BS)
    pc = PrefixCache(bm, max_slots=2, snapshot_slots=2, interval=BS)
    seqs = []
    for i in range(3):
        seq = make_seq(i, [20 * i + t + 3 for t in range(BS)], slot=0)
        bm.allocate(seq, BS)
        taken = pc.take(seq, BS)
        pc.commit()
        bm.register(seq, 0, BS)
        seq.num_cached_tokens = BS
        bm.free(seq)
        seqs.append(seq)
        if i == 1:  # a hit on the first snapshot: it becomes the most recently used
            probe = make_seq(9, seqs[0].token_ids + [1], slot=1)
            hit = pc.lookup(probe)
            assert hit.num_tokens == BS and hit.snapshot_row == 2
            assert pc.restore(probe, hit) == (2, 1)
            bm.free(probe)
        assert taken == [(BS, [2, 3, 3][i])]  # rows 2, 3 after the 2 slots; the third evicts row 3
    assert pc.evicted_snapshots == 1 and pc.snapshots_taken == 3 and pc.snapshots_in_use == 2
    assert pc.lookup(make_seq(10, seqs[1].token_ids + [1], slot=0)) is None
    assert pc.lookup(make_seq(11, seqs[0].token_ids + [1], slot=0)).snapshot_row == 2
    assert pc.lookup(make_seq(12, seqs[2].token_ids + [1], slot=0)).snapshot_row == 3
    # the last token always runs: a prompt of exactly one interval has no hit
    assert pc.lookup(make_seq(13, seqs[0].token_ids, slot=0)) is None
    pc.check()
    bm.check([])


def test_interval_and_snapshot_counts_are_checked_and_sized():
    assert resolve_prefix_interval(0, 16) == DEFAULT_PREFIX_CACHE_INTERVAL
    assert resolve_prefix_interval(0, 48) % 48 == 0
    for bad in (-16, 20):
        with pytest.raises(ValueError, match="--prefix-cache-interval"):
            resolve_prefix_interval(bad, 16)
    with pytest.raises(ValueError, match="--prefix-cache-snapshots"):
        size_pools(1, 1, block_size=16, max_batch_size=4, max_seq_len=64, num_blocks=4, max_slots=2,
                   prefix_cache=True, snapshot_slots=0)
    # explicit pools: one snapshot row per slot unless given, but no more than one per interval of the
    # given blocks (4 blocks of 16 hold no 512-token prefix: the floor of one row); none without the cache
    assert size_pools(1, 1, block_size=16, max_batch_size=4, max_seq_len=64, num_blocks=4, max_slots=2,
                      prefix_cache=True) == (4, 2, 1)
    assert size_pools(1, 1, block_size=16, max_batch_size=4, max_seq_len=64, num_blocks=4, max_slots=8,
                      prefix_cache=True, prefix_cache_interval=16) == (4, 8, 4)
    assert size_pools(1, 1, block_size=16, max_batch_size=4, max_seq_len=64, num_blocks=400, max_slots=3,
                      prefix_cache=True, prefix_cache_interval=16) == (400, 3, 3)
    assert size_pools(1, 1, block_size=16, max_batch_size=4, max_seq_len=64, num_blocks=4, max_slots=2,
                      snapshot_slots=5) == (4, 2, 0)
    # a budget of 64 rows/blocks: 8 slots, a quarter (16) to snapshots, the rest to blocks
    mib = 1 << 20
    pools = size_pools(mib, mib, block_size=16, max_batch_size=8, max_seq_len=1 << 20, cache_memory_gb=64 / 1024,
                       prefix_cache=True, prefix_cache_interval=64)
    assert pools == (64 - 8 - 16, 8, 16)
    # snapshots are capped at one per interval of max_slots sequences; blocks at what they can use
    pools = size_pools(1, 1, block_size=16, max_batch_size=2, max_seq_len=128, cache_memory_gb=1,
                       prefix_cache=True, prefix_cache_interval=64)
    assert pools == (2 * 8 + 4 * 4, 2, 2 * 2)


def test_k3_caches_copy_rows_between_slots_and_snapshots_reading_all_sources_first():
    cfg = load_model(TINY_K3, dtype=torch.float32).config
    caches = K3Caches.allocate(cfg, 2, BS, 3, torch.float32, snapshot_slots=2)
    gen = torch.Generator().manual_seed(0)
    for pool in (caches.conv, caches.recurrent, caches.snapshot_conv, caches.snapshot_recurrent):
        for t in pool.values():
            t.copy_(torch.randn(t.shape, generator=gen))

    def rows(c):  # every layer's rows 0..4 in the one namespace, conv and recurrent
        return [[torch.cat([run[i], snap[i]])[r].clone() for r in range(5)]
                for run, snap in ((c.conv, c.snapshot_conv), (c.recurrent, c.snapshot_recurrent)) for i in run]

    before = rows(caches)
    copies = [(0, 3), (4, 1), (2, 0), (1, 4)]  # slot->snapshot, snapshot->slot, slot->slot, and a swap
    caches.copy_states(copies)
    after = rows(caches)
    for old, new in zip(before, after):
        expect = list(old)
        for src, dst in copies:
            expect[dst] = old[src]
        for r in range(5):
            assert torch.equal(new[r], expect[r])
    with pytest.raises(ValueError, match="rows are 0..4"):
        caches.copy_states([(0, 5)])
    with pytest.raises(ValueError, match="write one row twice"):
        caches.copy_states([(0, 3), (1, 3)])


# -- the SyntheticExecutor ---------------------------------------------------------

def synthetic_engine(prefix: bool, num_blocks=512, max_slots=16, snapshots=64, max_batch_size=16,
                     max_num_tokens=256, interval=S) -> LLMEngine:
    config = EngineConfig(num_blocks=num_blocks, max_slots=max_slots, block_size=BS, max_batch_size=max_batch_size,
                          max_num_tokens=max_num_tokens, prefix_cache=prefix, prefix_cache_interval=interval,
                          snapshot_slots=snapshots)
    ex = SyntheticExecutor(VOCAB, num_blocks, BS, max_slots, snapshot_slots=snapshots if prefix else 0)
    return LLMEngine(ex, config, eos_token_ids=(EOS,))


def sequential(engine: LLMEngine, prompts, params):
    results = []
    for p, s in zip(prompts, params):
        results += engine.generate([p], s)
        engine.scheduler.blocks.check([])
    return results


def test_synthetic_sequential_hits_are_what_the_hashes_predict():
    prompts, params = shared_prefix_workload(60, seed=3, vocab=VOCAB)
    off = sequential(synthetic_engine(False), prompts, params)
    engine = synthetic_engine(True, snapshots=256)  # room for every snapshot: none is evicted
    on = sequential(engine, prompts, params)
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    expect = [expected_hit(r.prompt_token_ids, [history(x) for x in on[:i]]) for i, r in enumerate(on)]
    assert [r.cached_tokens for r in on] == expect
    assert {e for e in expect} >= {0, S, 2 * S, 3 * S}  # misses, and hits one to three intervals deep
    assert any(S < len(p) < 2 * S and e == S for p, e in zip(prompts, expect))
    summary = engine.summary()["prefix_cache"]
    assert summary["cached_tokens"] == sum(expect) and summary["hits"] == sum(e > 0 for e in expect)
    assert summary["queries"] == len(prompts)
    assert summary["evicted_blocks"] == 0 and summary["evicted_snapshots"] == 0
    assert engine.stats.computed_tokens == synthetic_engine_tokens(off) - sum(expect)
    check_all_released(engine)


def synthetic_engine_tokens(results) -> int:
    return sum(len(history(r)) for r in results)


@pytest.mark.parametrize("num_blocks, snapshots", [(40, 6), (512, 64)], ids=["tight-pools", "roomy"])
def test_synthetic_arrivals_preemption_and_eviction_equal_no_cache(num_blocks, snapshots):
    prompts, params = shared_prefix_workload(120, seed=5, vocab=VOCAB, max_new=16)

    def run(engine):
        rng = random.Random(7)  # the same arrivals for both runs
        ids, done, nxt = {}, {}, 0
        while nxt < len(prompts) or engine.has_unfinished():
            for _ in range(rng.randint(0, 3)):
                if nxt < len(prompts):
                    ids[engine.add_request(prompts[nxt], params[nxt])] = nxt
                    nxt += 1
            for out in engine.step():
                if out.finished:
                    done[ids[out.request_id]] = engine.take_result(out.request_id)
            engine.scheduler.blocks.check(engine.scheduler.running)
        return [done[i] for i in range(len(prompts))]

    off = run(synthetic_engine(False, num_blocks=num_blocks, max_slots=8, max_batch_size=8, max_num_tokens=24))
    engine = synthetic_engine(True, num_blocks=num_blocks, max_slots=8, snapshots=snapshots, max_batch_size=8,
                              max_num_tokens=24)
    on = run(engine)
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    summary = engine.summary()
    assert summary["prefix_cache"]["hits"] > 10
    if num_blocks == 40:  # the pools are too small for the load: everything is exercised
        assert summary["preemptions"] > 0 and summary["prefix_cache"]["evicted_blocks"] > 0
        assert summary["prefix_cache"]["evicted_snapshots"] > 0
    check_all_released(engine)


def test_a_failed_step_leaves_no_snapshot_behind(monkeypatch):
    """A step that raises (the serve loop fails its requests and goes on) ran none of its saves:
    the rows it would have written must not be indexed, or a later request restores a row that
    holds nothing (the synthetic executor raises on such a restore)."""
    engine = synthetic_engine(prefix=True)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = [3 + i % 50 for i in range(S + 4)]  # its one snapshot position is S
    rid = engine.add_request(prompt, params)
    real = engine.runner.executor.execute
    monkeypatch.setattr(engine.runner.executor, "execute", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    engine.abort(rid)
    monkeypatch.setattr(engine.runner.executor, "execute", real)
    other = [3 + (7 * i) % 60 for i in range(S + 3)]
    first, = engine.generate([prompt], params)
    engine.generate([other], params)
    again, = engine.generate([prompt], params)
    assert again.output_token_ids == first.output_token_ids
    assert again.cached_tokens == expected_hit(prompt, [history(first)])
    engine.scheduler.blocks.check([])
    engine.scheduler.prefix.check()


def test_synthetic_executor_catches_a_wrong_restore():
    engine = synthetic_engine(True)
    rng = random.Random(1)
    a1, a2 = ([rng.randrange(3, VOCAB) for _ in range(2 * S + 1)] for _ in range(2))
    once = SamplingParams(max_new_tokens=1)
    engine.generate([a1, a2], once)
    prefix = engine.scheduler.prefix
    h1, h2 = (chain_hashes(make_seq(0, a), BS, 2 * S // BS)[-1] for a in (a1, a2))
    assert engine.generate([a1], once)[0].cached_tokens == 2 * S  # the right snapshot restores cleanly
    prefix._row_of[h1], prefix._row_of[h2] = prefix._row_of[h2], prefix._row_of[h1]  # sabotage the index
    engine.add_request(a1, once)
    with pytest.raises(ValueError, match="disagrees with state row"):
        engine.step()


# -- snapshots the prefill takes mid-chunk (KDA_CHUNK-aligned points) -----------------

def steps_of(engine: LLMEngine) -> list[tuple[int, bool]]:
    """Record (tokens, phase) of every step the engine's executor runs from now on."""
    ex, calls = engine.runner.executor, []
    run = ex.execute

    def execute(step, decode):
        calls.append((step.num_tokens, decode))
        return run(step, decode)

    ex.execute = execute
    return calls


def mid_chunk_engine(prefix: bool, interval: int, max_num_tokens: int, block_size: int = 16):
    config = EngineConfig(num_blocks=512, max_slots=4, block_size=block_size, max_batch_size=4,
                          max_num_tokens=max_num_tokens, prefix_cache=prefix, prefix_cache_interval=interval,
                          snapshot_slots=64)
    ex = SyntheticExecutor(VOCAB, 512, block_size, 4, snapshot_slots=64 if prefix else 0)
    return LLMEngine(ex, config, eos_token_ids=(EOS,))


@pytest.mark.parametrize("interval, budget, chunks", [
    (64, 4096, [1000]),  # every position is a chunk boundary of the prefill: one step
    (192, 4096, [1000]),
    (64, 300, [256, 256, 256, 232]),  # budget-cut chunks end on the 64-token grid, the next starts on it
    (48, 4096, [48] * 20 + [40]),  # positions off the grid: each ends its chunk (the fallback)
])
def test_synthetic_prefill_takes_its_snapshots_mid_chunk(interval, budget, chunks):
    """The SyntheticExecutor raises on a snapshot point the KDA prefill could not take and keeps
    the history at each one; tokens equal the uncached run, later hits are what the hashes say."""
    rng = random.Random(interval + budget)
    prompt = [rng.randrange(3, VOCAB) for _ in range(1000)]
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    off, = mid_chunk_engine(False, interval, budget).generate([prompt], params)
    engine = mid_chunk_engine(True, interval, budget)
    calls = steps_of(engine)
    first, = engine.generate([prompt], params)
    assert [n for n, decode in calls if not decode] == chunks
    assert first.output_token_ids == off.output_token_ids
    prefix = engine.scheduler.prefix
    assert prefix.snapshots_taken == 1000 // interval
    assert engine.runner.executor.copies == 0  # chunk ends too: the prefill takes them (point = its length)
    probe = prompt[:900] + [5, 6]
    hit, = engine.generate([probe], params)
    assert hit.cached_tokens == expected_hit(probe, [history(first)], interval) == 900 // interval * interval
    assert hit.output_token_ids == mid_chunk_engine(False, interval, budget).generate([probe], params)[0].output_token_ids
    check_all_released(engine)


def test_synthetic_decode_steps_take_their_snapshots_by_copy():
    """A position reached by a decode token: pure-decode steps copy the state row after the step
    (the decode ops take no points); a later request restores it."""
    engine = mid_chunk_engine(True, 64, 4096)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    first, = engine.generate([[3 + i % 50 for i in range(60)]], params)
    assert engine.runner.executor.copies == 1 and engine.scheduler.prefix.snapshots_taken == 1
    probe = history(first)[:64] + [7]
    assert engine.generate([probe], params)[0].cached_tokens == 64
    check_all_released(engine)


# -- the tiny K3 model, fp32 -------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return load_model(TINY_K3, dtype=torch.float32)


def k3_engine(model, prefix: bool, num_blocks=128, max_slots=8, snapshots=32, max_num_tokens=256) -> LLMEngine:
    caches = K3Caches.allocate(model.config, num_blocks, BS, max_slots, torch.float32,
                               snapshot_slots=snapshots if prefix else 0)
    config = EngineConfig(num_blocks=num_blocks, max_slots=max_slots, block_size=BS, max_batch_size=max_slots,
                          max_num_tokens=max_num_tokens, prefix_cache=prefix, prefix_cache_interval=S,
                          snapshot_slots=snapshots)
    return LLMEngine(TorchExecutor(model, caches, "cpu"), config, eos_token_ids=(model.config.eos_token_id,))


def waves(seed: int, vocab: int = 1024):
    """Wave 1 computes some texts; wave 2 shares prefixes of them of every length class."""
    rng = random.Random(seed)
    texts = [[rng.randrange(3, vocab) for _ in range(30)] for _ in range(3)]
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    wave1 = [texts[0][:30], texts[1][:17], texts[2][:8]]
    wave2 = [texts[0][:5] + [7, 8], texts[0][:8] + [9], texts[0][:9] + [10, 11], texts[0][:30],
             texts[1][:16] + [12] * 3, texts[1][:17] + [13], texts[2][:8] + [14] * 9, texts[2][:8]]
    return wave1, wave2, greedy


def run_waves(engine: LLMEngine, wave1, wave2, params):
    first = engine.generate(wave1, params)
    return first, engine.generate(wave2, params)


def test_tiny_k3_hits_of_every_length_equal_no_cache(model):
    wave1, wave2, params = waves(11)
    off = run_waves(k3_engine(model, False), wave1, wave2, params)
    engine = k3_engine(model, True)
    on = run_waves(engine, wave1, wave2, params)
    for a, b in zip(on, off):
        assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
    histories = [history(r) for r in on[0]]
    expect = [expected_hit(p, histories) for p in wave2]
    assert expect == [0, S, S, 3 * S, 2 * S, 2 * S, S, 0]  # the workload is what it means to be
    assert [r.cached_tokens for r in on[0]] == [0, 0, 0]
    assert [r.cached_tokens for r in on[1]] == expect
    assert engine.summary()["prefix_cache"]["cached_tokens"] == sum(expect)
    check_all_released(engine)


def test_tiny_k3_preemption_and_arrivals_while_decoding_equal_no_cache(model):
    wave1, wave2, _ = waves(12)
    prompts = wave1 + wave2
    params = [SamplingParams(max_new_tokens=5 + i % 4, ignore_eos=True) for i in range(len(prompts))]

    def run(engine):
        ids, done = {}, {}
        for step in range(10_000):
            if step % 2 == 0 and len(ids) < len(prompts):  # one arrival every second step
                i = len(ids)
                ids[engine.add_request(prompts[i], params[i])] = i
            elif len(ids) == len(prompts) and not engine.has_unfinished():
                break
            for out in engine.step():
                if out.finished:
                    done[ids[out.request_id]] = engine.take_result(out.request_id)
        return [done[i] for i in range(len(prompts))], engine

    # 12 blocks of 4 tokens for up to 8 running requests: preemption, and cached blocks evicted
    (off, _), (on, engine) = (run(k3_engine(model, p, num_blocks=12, max_num_tokens=12)) for p in (False, True))
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    summary = engine.summary()
    assert summary["preemptions"] > 0 and summary["prefix_cache"]["hits"] > 0
    assert summary["prefix_cache"]["evicted_blocks"] > 0
    assert summary["prefix_cache"]["queries"] > len(prompts)  # preempted requests were looked up again
    check_all_released(engine)


# -- world size 2 (gloo, CPU) ------------------------------------------------------

def test_world2_with_hits_gives_world1_tokens(ckpt_dir, monkeypatch):
    """Each rank restores its own heads' snapshots; the restores travel in the step broadcast (a hit
    costs no collective of its own: rank 0 broadcasts a header and a payload per step, nothing else)."""
    import k3_trtllm.runtime.distributed as distributed

    wave1, wave2, params = waves(13)
    common = dict(dtype=torch.float64, block_size=BS, num_blocks=96, max_slots=8, max_batch_size=8,
                  max_num_tokens=256, max_seq_len=64)
    world1 = build_engine(ckpt_dir("tiny"), **common)
    expected = run_waves(world1, wave1, wave2, params)
    engine = build_engine(ckpt_dir("tiny"), tp=2, prefix_cache=True, prefix_cache_interval=S, snapshot_slots=24,
                          **common)
    broadcasts, broadcast = [], distributed.dist.broadcast
    monkeypatch.setattr(distributed.dist, "broadcast", lambda *a, **k: broadcasts.append(1) or broadcast(*a, **k))
    try:
        steps = engine.runner.executor.steps
        got = run_waves(engine, wave1, wave2, params)
        assert len(broadcasts) == 2 * (engine.runner.executor.steps - steps)
        for a, b in zip(got, expected):
            assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
        histories = [history(r) for r in got[0]]
        assert [r.cached_tokens for r in got[1]] == [expected_hit(p, histories) for p in wave2]
        assert engine.summary()["prefix_cache"]["hits"] == 6
        check_all_released(engine)
    finally:
        engine.close()


# -- the segmented engine dir (EngineExecutor, CPU ONNX backend) ---------------------

def build_tiny_engine_dir(root: Path, *, max_num_tokens: int, max_seq_len: int, block_size: int) -> Path:
    """The tiny K3 converted (world 1) and built as a segmented fp32 engine dir (no plans)."""
    from click.testing import CliRunner

    from k3_trtllm.cli import main
    from k3_trtllm.convert import convert_checkpoint

    convert_checkpoint(TINY_K3, root / "ckpt", 1, 1, progress=False)
    result = CliRunner().invoke(main, ["build", str(root / "ckpt"), str(root / "engine"), "--layout",
                                       "segments", "--dtype", "float32", "--builder", "none", "--quiet",
                                       "--max-batch-size", "4", "--max-num-tokens", str(max_num_tokens),
                                       "--max-seq-len", str(max_seq_len), "--block-size", str(block_size)])
    assert result.exit_code == 0, result.output
    return root / "engine"


def test_engine_dir_executor_restores_snapshots_and_gives_the_uncached_tokens(tmp_path):
    from k3_trtllm.trt.engine_executor import EngineExecutor

    build_tiny_engine_dir(tmp_path, max_num_tokens=32, max_seq_len=64, block_size=BS)
    rng = random.Random(14)
    text = [rng.randrange(3, 1024) for _ in range(20)]
    wave1, wave2 = [text[:17]], [text[:17] + [5], text[:9] + [6, 7]]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)

    def run(prefix: bool):
        ex = EngineExecutor(tmp_path / "engine", num_blocks=32, max_slots=4, snapshot_slots=8 if prefix else 0)
        config = EngineConfig(num_blocks=32, max_slots=4, block_size=BS, max_batch_size=4, max_num_tokens=32,
                              prefix_cache=prefix, prefix_cache_interval=S, snapshot_slots=8)
        engine = LLMEngine(ex, config, eos_token_ids=(ex.cfg.eos_token_id,))
        return run_waves(engine, wave1, wave2, params), engine

    (off, _), (on, engine) = run(False), run(True)
    for a, b in zip(on, off):
        assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
    assert [r.cached_tokens for r in on[1]] == [2 * S, S]
    check_all_released(engine)


def pre_snapshot_engine_dir(engine: Path, out: Path) -> Path:
    """``engine`` as an engine dir built before the KDA segment took the snapshots: its graph's
    snapshot inputs become what that graph computed inside (-1 points, one zeroed stand-in row per
    pool) and its config lists none, as such dirs do."""
    import json
    import shutil

    import onnx
    from onnx import helper

    shutil.copytree(engine, out)
    path = out / "segments/kda_attention.onnx"
    graph_model = onnx.load(str(path))
    g = graph_model.graph
    taken = {"snapshot_offsets", "snapshot_rows", "snapshot_conv", "snapshot_recurrent"}
    pools = {i.name: i for i in g.input if i.name in ("snapshot_conv", "snapshot_recurrent")}
    nodes = [helper.make_node("Constant", [], ["_h1_zero"], value=helper.make_tensor("z", onnx.TensorProto.INT32,
                                                                                       [], [0])),
             helper.make_node("Constant", [], ["_h1_one"], value=helper.make_tensor("o", onnx.TensorProto.INT32,
                                                                                      [], [1])),
             helper.make_node("Constant", [], ["_h1_axis"], value=helper.make_tensor("a", onnx.TensorProto.INT64,
                                                                                       [1], [1])),
             helper.make_node("Mul", ["state_slots", "_h1_zero"], ["_h1_zeros"]),
             helper.make_node("Sub", ["_h1_zeros", "_h1_one"], ["_h1_minus"]),
             helper.make_node("Unsqueeze", ["_h1_minus", "_h1_axis"], ["snapshot_offsets"]),
             helper.make_node("Unsqueeze", ["_h1_zeros", "_h1_axis"], ["snapshot_rows"])]
    for name, value in pools.items():
        dims = [1] + [d.dim_value for d in value.type.tensor_type.shape.dim[1:]]
        nodes.append(helper.make_node("Constant", [], [f"_h1_{name}_shape"],
                                      value=helper.make_tensor("s", onnx.TensorProto.INT64, [len(dims)], dims)))
        nodes.append(helper.make_node("ConstantOfShape", [f"_h1_{name}_shape"], [name], value=helper.make_tensor(
            "v", value.type.tensor_type.elem_type, [1], [0])))
    kept_in = [i for i in g.input if i.name not in taken]
    kept_out = [o for o in g.output if o.name.removesuffix("_out") not in taken]
    del g.input[:], g.output[:]
    g.input.extend(kept_in)
    g.output.extend(kept_out)
    body = list(g.node)
    del g.node[:]
    g.node.extend(nodes + body)
    onnx.save(graph_model, str(path))
    config = json.loads((out / "config.json").read_text())
    for seg in config["segments"]:
        if seg["kind"] == "kda_attention":
            seg["inputs"] = [t for t in seg["inputs"] if t["name"] not in taken]
            seg["outputs"] = [t for t in seg["outputs"] if t["name"].removesuffix("_out") not in taken]
            seg["aliases"] = {k: v for k, v in seg["aliases"].items() if k not in taken}
            for phase in ("prefill", "decode"):
                seg["profiles"][phase] = {k: v for k, v in seg["profiles"][phase].items() if k not in taken}
    for key in ("max_snapshot_points", "max_snapshot_slots"):
        del config["limits"][key]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_engine_dir_prefill_writes_its_snapshots_mid_chunk_as_the_torch_executor(tmp_path, model):
    """The KDA segment takes the snapshot points and pools: a 200-token prompt (interval 64)
    prefills in one step as without the cache, its 3 snapshots written by the plugin's op, and a
    request on 150 of its tokens restores the one at 128: the tokens of the torch executor with
    and without the cache, and the cached tokens the hashes predict. An engine dir from before
    (no snapshot inputs) still runs, cutting the prefill at the snapshots and copying them."""
    from k3_trtllm.trt.engine_executor import EngineExecutor

    engine_dir = build_tiny_engine_dir(tmp_path, max_num_tokens=256, max_seq_len=256, block_size=16)
    rng = random.Random(8)
    prompt = [rng.randrange(3, 1024) for _ in range(200)]
    probe = prompt[:150] + [5, 6]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)

    def engine_for(executor, prefix):
        config = EngineConfig(num_blocks=40, max_slots=2, block_size=16, max_batch_size=2, max_num_tokens=256,
                              prefix_cache=prefix, prefix_cache_interval=64, snapshot_slots=6)
        return LLMEngine(executor, config, eos_token_ids=(model.config.eos_token_id,))

    caches = K3Caches.allocate(model.config, 40, 16, 2, torch.float32)
    expected = [r.output_token_ids for r in engine_for(TorchExecutor(model, caches, "cpu"), False).generate(
        [prompt, probe], params)]
    for directory, mid_chunk in ((engine_dir, True), (pre_snapshot_engine_dir(engine_dir, tmp_path / "old"), False)):
        ex = EngineExecutor(directory, num_blocks=40, max_slots=2, snapshot_slots=6)
        assert ex.writes_snapshots is mid_chunk
        engine = engine_for(ex, True)
        calls = steps_of(engine)
        first = engine.generate([prompt], params)[0]
        assert engine.scheduler.prefix.snapshots_taken == 3
        hit = engine.generate([probe], params)[0]
        prefills = [n for n, decode in calls if not decode]
        assert prefills == ([200, 152 - 128] if mid_chunk else [64, 64, 64, 8, 152 - 128]), directory
        assert hit.cached_tokens == 128 == expected_hit(probe, [history(first)], 64)
        assert [first.output_token_ids, hit.output_token_ids] == expected, directory
        check_all_released(engine)


def test_engine_dir_one_token_per_sequence_step_takes_its_snapshots_by_copy(tmp_path, model):
    """A step of one token per sequence that is no pure decode (a decode token ending at a
    snapshot position beside a 1-token prompt): the KDA plugin runs it as a decode, which takes no
    points, so the executor binds none and copies the state row the step leaves; the snapshot
    equals the torch executor's, written by its op."""
    from k3_trtllm.model import build_step
    from k3_trtllm.trt.engine_executor import EngineExecutor

    ex = EngineExecutor(build_tiny_engine_dir(tmp_path, max_num_tokens=32, max_seq_len=64, block_size=BS),
                        num_blocks=8, max_slots=2, snapshot_slots=2)
    ref = K3Caches.allocate(model.config, 8, BS, 2, torch.float32, snapshot_slots=2)
    prompt = list(range(3, 3 + S))
    steps = [build_step([(prompt[:-1], 0, 0, [0, 1])], BS),
             build_step([(prompt[-1:], S - 1, 0, [0, 1]), ([9], 0, 1, [2])], BS, snapshots=[[(1, 1)], []])]
    bound, run = [], ex.backend.run

    def spy(kind, feeds, outs, phase):
        if kind == "kda_attention":
            bound.append(feeds["snapshot_offsets"].clone())
        run(kind, feeds, outs, phase)

    ex.backend.run = spy
    for step in steps:
        torch.testing.assert_close(ex.execute(step, False), model(step, ref, decode=False), rtol=0, atol=2e-4)
    assert all((b == -1).all() for b in bound)  # the plugin was given no point
    for pool in ("snapshot_conv", "snapshot_recurrent"):
        for layer, t in getattr(ref, pool).items():
            assert t[1].abs().sum() > 0
            torch.testing.assert_close(getattr(ex.caches, pool)[layer][1], t[1], rtol=0, atol=2e-4)


def test_no_graph_or_step_makes_a_stand_in_snapshot_pool_per_call(tmp_path, model):
    """The KDA nodes of the segment graph and of the monolithic step graph take their snapshot
    pools straight from graph inputs (bound once by the executor), not from a zero-fill inside the
    graph run at every call; a torch step over caches built without snapshot pools makes the
    one-row stand-in once and binds the same rows at later steps."""
    import onnx

    from k3_trtllm.export.exporter import export_step_onnx
    from k3_trtllm.model import build_step
    from k3_trtllm.ops.contract import KDA_PREFILL

    pools = [i for i, t in enumerate(KDA_PREFILL.inputs) if t.name in ("snapshot_conv", "snapshot_recurrent")]
    engine_dir = build_tiny_engine_dir(tmp_path, max_num_tokens=32, max_seq_len=64, block_size=BS)
    export_step_onnx(model, tmp_path / "step.onnx", BS, log=lambda _: None)
    for path in (engine_dir / "segments/kda_attention.onnx", tmp_path / "step.onnx"):
        graph = onnx.load(str(path), load_external_data=False).graph
        names = {i.name for i in graph.input}
        nodes = [n for n in graph.node if n.op_type == KDA_PREFILL.plugin]
        assert nodes and all(n.input[i] in names for n in nodes for i in pools), path
    full = model.allocate_caches(4, BS, 2)
    caches = K3Caches(full.latent, full.conv, full.recurrent, BS)  # no snapshot pools
    seen = []
    for step in (build_step([([5, 6, 7], 0, 0, [0])], BS), build_step([([8], 3, 0, [0])], BS)):
        model(step, caches, decode=False)
        seen.append({i: t.data_ptr() for i, t in caches.snapshot_recurrent.items()})
    assert seen[0] == seen[1] and set(seen[0]) == set(model.config.kda_layer_indices)
    assert all(t.shape[0] == 1 and not t.any() for t in caches.snapshot_recurrent.values())


def test_tiny_k3_4k_prompt_prefills_in_one_step_and_takes_its_snapshots(model):
    """A 4000-token prompt with the cache on (interval 128) prefills in one step, as without it,
    and its 31 snapshots, written by the prefill op mid-chunk, restore exactly: the tokens of a
    request on 3900 of its tokens equal the uncached run's (fp32)."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1024) for _ in range(4000)]
    probe = prompt[:3900] + [5, 6]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)

    def engine_for(prefix):
        caches = K3Caches.allocate(model.config, 512, 16, 2, torch.float32, snapshot_slots=40 if prefix else 0)
        config = EngineConfig(num_blocks=512, max_slots=2, block_size=16, max_batch_size=2, max_num_tokens=4096,
                              prefix_cache=prefix, prefix_cache_interval=128, snapshot_slots=40)
        return LLMEngine(TorchExecutor(model, caches, "cpu"), config, eos_token_ids=(model.config.eos_token_id,))

    off = engine_for(False)
    off_first, off_probe = (off.generate([p], params)[0] for p in (prompt, probe))
    engine = engine_for(True)
    calls = steps_of(engine)
    first = engine.generate([prompt], params)[0]
    assert [n for n, decode in calls if not decode] == [4000]
    assert engine.scheduler.prefix.snapshots_taken == 31
    hit = engine.generate([probe], params)[0]
    assert hit.cached_tokens == 3840
    assert [n for n, decode in calls if not decode] == [4000, 3902 - 3840]
    assert first.output_token_ids == off_first.output_token_ids
    assert hit.output_token_ids == off_probe.output_token_ids
    check_all_released(engine)
