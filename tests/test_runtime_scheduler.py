"""Scheduler, block manager and state slots, driven by hand (no model)."""
import pytest

from k3_trtllm.runtime.block_manager import BlockManager, StateSlots
from k3_trtllm.runtime.sequence import SamplingParams, Sequence, SequenceStatus
from k3_trtllm.runtime.scheduler import Scheduler

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_slots=8, max_batch_size=8, max_num_tokens=64):
    return Scheduler(BlockManager(num_blocks, block_size), StateSlots(max_slots), max_batch_size,
                     max_num_tokens, eos_token_ids=(EOS,))


def seq(seq_id, prompt_len, max_new_tokens=8, **sampling):
    return Sequence(seq_id, list(range(10, 10 + prompt_len)),
                    SamplingParams(max_new_tokens=max_new_tokens, **sampling), arrival_time=0.0)


def run_step(sched, token=7):
    """One schedule + postprocess where every sampling sequence draws ``token``."""
    batch = sched.schedule()
    plan = [(s.seq_id, n) for s, n in batch.entries]
    sched.postprocess(batch, [token] * len(batch.sampling), now=0.0)
    return plan


def test_block_manager_allocates_grows_and_frees():
    bm = BlockManager(num_blocks=5, block_size=4)
    s = seq(0, 6)
    bm.allocate(s, 6)
    assert len(s.block_table) == 2 and bm.num_free == 3
    s.num_cached_tokens = 6
    bm.allocate(s, 2)  # 8 tokens still fit in 2 blocks
    assert len(s.block_table) == 2
    bm.allocate(s, 3)  # 9 tokens need a third
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.capacity(s) == 5 * 4 - 6
    with pytest.raises(ValueError, match="needs"):
        bm.allocate(s, 100)
    bm.free(s)
    assert s.block_table == [] and bm.num_free == 5


def test_state_slots_free_list():
    slots = StateSlots(2)
    a, b = slots.acquire(), slots.acquire()
    assert {a, b} == {0, 1} and slots.num_free == 0
    with pytest.raises(ValueError, match="in use"):
        slots.acquire()
    slots.release(a)
    with pytest.raises(ValueError, match="not in use"):
        slots.release(a)
    assert slots.acquire() == a


def test_decodes_first_then_prefill_within_token_budget():
    sched = make_scheduler(max_num_tokens=10)
    sched.add(seq(0, 3))
    sched.add(seq(1, 3))
    assert run_step(sched) == [(0, 3), (1, 3)]
    sched.add(seq(2, 20))
    # Two decodes of one token each, then 8 tokens of the new prompt.
    assert run_step(sched) == [(0, 1), (1, 1), (2, 8)]
    # Decodes stay first; the chunked prompt continues where it stopped.
    assert run_step(sched) == [(0, 1), (1, 1), (2, 8)]
    s2 = sched.running[2]
    assert s2.num_cached_tokens == 16 and s2.num_output_tokens == 0
    assert run_step(sched) == [(0, 1), (1, 1), (2, 4)]
    assert s2.num_output_tokens == 1  # only the chunk that ends the prompt samples
    assert run_step(sched) == [(0, 1), (1, 1), (2, 1)]


def test_chunk_bookkeeping_covers_every_token_once():
    sched = make_scheduler(max_num_tokens=3, block_size=2)
    s = seq(0, 10, max_new_tokens=2)
    sched.add(s)
    covered = []
    while sched.has_unfinished():
        batch = sched.schedule()
        (got, n), = batch.entries
        covered.extend(range(got.num_cached_tokens, got.num_cached_tokens + n))
        assert len(got.block_table) * 2 >= got.num_cached_tokens + n
        sched.postprocess(batch, [5] * len(batch.sampling), now=0.0)
    # 10 prompt tokens + the first sampled one; the last sampled token never runs.
    assert covered == list(range(11))
    assert s.output_token_ids == [5, 5] and s.finish_reason == "length"


def test_finish_reasons_and_resources_freed():
    sched = make_scheduler()
    a, b, c = seq(0, 2, stop_token_ids=(9,)), seq(1, 2), seq(2, 2, ignore_eos=True, max_new_tokens=2)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    sched.postprocess(batch, [9, EOS, EOS], now=1.0)
    assert (a.finish_reason, b.finish_reason, c.finish_reason) == ("stop", "eos", None)
    assert a.output_token_ids == [9] and a.block_table == [] and a.state_slot is None
    assert [s.seq_id for s in sched.running] == [2]
    run_step(sched)
    assert c.finish_reason == "length" and c.output_token_ids == [EOS, 7]
    assert sched.blocks.num_used == 0 and sched.slots.num_used == 0


def test_preemption_recomputes_newest_sequence():
    # 6 blocks of 2 tokens; two prompts of 4 use 4 blocks, decoding fills the rest.
    sched = make_scheduler(num_blocks=6, block_size=2)
    old, new = seq(0, 4, max_new_tokens=6), seq(1, 4, max_new_tokens=6)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefilled (4 blocks), one token sampled each
    run_step(sched)  # position 4 of both opens a third block each: 6 used
    run_step(sched)  # position 5 fits
    assert sched.blocks.num_free == 0 and sched.num_preemptions == 0
    plan = run_step(sched)  # the old one needs a block for position 6: the new one goes
    assert plan == [(0, 1)]
    assert sched.num_preemptions == 1 and new.num_preemptions == 1
    assert new.status is SequenceStatus.WAITING and sched.waiting[0] is new
    assert new.num_cached_tokens == 0 and new.block_table == [] and new.state_slot is None
    assert new.output_token_ids == [7, 7, 7]  # generated tokens are kept and recomputed
    while sched.has_unfinished():
        run_step(sched)
    assert old.output_token_ids == [7] * 6 and new.output_token_ids == [7] * 6
    assert sched.blocks.num_used == 0 and sched.slots.num_used == 0


def test_sequence_preempts_itself_when_everything_else_is_scheduled():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_tokens=16)
    a, b = seq(0, 3, max_new_tokens=3), seq(1, 4, max_new_tokens=3)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # 2 blocks each; a has room for position 3, b is full
    # a is scheduled first; b needs a block and the only other sequence already runs
    # in this step, so b preempts itself (and is not readmitted in the same step).
    assert run_step(sched) == [(0, 1)]
    assert b.num_preemptions == 1 and sched.waiting[0] is b and sched.blocks.num_free == 2
    assert run_step(sched) == [(0, 1)]  # b waits: a takes one of the two free blocks...
    assert a.is_finished
    assert run_step(sched) == [(1, 5)]  # ...then b recomputes prompt + its first token
    while sched.has_unfinished():
        run_step(sched)
    assert b.output_token_ids == [7, 7, 7]


def test_slots_limit_admission_without_preemption():
    sched = make_scheduler(max_slots=2, max_batch_size=8)
    for i in range(3):
        sched.add(seq(i, 2))
    assert [i for i, _ in run_step(sched)] == [0, 1]
    assert len(sched.waiting) == 1 and sched.num_preemptions == 0
    assert [i for i, _ in run_step(sched)] == [0, 1]


def test_max_batch_size_bounds_running_sequences():
    sched = make_scheduler(max_slots=8, max_batch_size=3)
    for i in range(5):
        sched.add(seq(i, 2))
    assert len(run_step(sched)) == 3 and len(sched.running) == 3


def test_add_rejects_requests_larger_than_the_pool():
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="latent cache holds 16"):
        sched.add(seq(0, 10, max_new_tokens=7))
    sched.add(seq(1, 10, max_new_tokens=6))


def test_abort_frees_running_and_waiting():
    sched = make_scheduler(max_slots=1)
    a, b = seq(0, 5), seq(1, 5)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert sched.blocks.num_used == 2 and sched.slots.num_used == 1
    sched.abort(a, now=1.0)
    sched.abort(b, now=1.0)
    assert a.finish_reason == b.finish_reason == "abort"
    assert sched.blocks.num_used == 0 and sched.slots.num_used == 0 and not sched.has_unfinished()
