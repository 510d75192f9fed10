"""Inflight batching on the tiny K3 model (CPU, float32): batched, chunked, preempted
and interleaved runs give the same greedy tokens as each request run alone.

Token equality is exact. The logits are not bitwise equal across batch shapes (a
decode-only step takes the absorbed MLA / recurrent KDA path, a mixed step the prefill
path), but in float32 they agree to ~1e-6, far below the gap between the best and the
second-best logit that decides a greedy token."""
import pytest
import torch

from k3_trtllm.model import K3Caches, load_model
from k3_trtllm.runtime.engine import EngineConfig, LLMEngine
from k3_trtllm.runtime.executor import TorchExecutor
from k3_trtllm.runtime.sequence import SamplingParams

PROMPT_LENS = [1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 20, 24, 31, 33, 40]
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return load_model(ckpt_dir("tiny"), dtype=torch.float32)


def make_engine(model, num_blocks=256, max_slots=16, max_batch_size=16, max_num_tokens=512):
    caches = K3Caches.allocate(model.config, num_blocks, BLOCK_SIZE, max_slots, torch.float32)
    config = EngineConfig(num_blocks=num_blocks, max_slots=max_slots, block_size=BLOCK_SIZE,
                          max_batch_size=max_batch_size, max_num_tokens=max_num_tokens)
    return LLMEngine(TorchExecutor(model, caches, "cpu"), config, eos_token_ids=(model.config.eos_token_id,))


def prompts_and_params():
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = [SamplingParams(max_new_tokens=3 + i % 8) for i in range(len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def alone(model):
    """Each request on a fresh engine of its own."""
    prompts, params = prompts_and_params()
    return [make_engine(model, max_batch_size=1).generate([p], s)[0].output_token_ids
            for p, s in zip(prompts, params)]


def outputs(results):
    return [r.output_token_ids for r in results]


def test_16_mixed_requests_inflight_equal_each_alone(model, alone):
    prompts, params = prompts_and_params()
    engine = make_engine(model)
    assert outputs(engine.generate(prompts, params)) == alone
    assert engine.stats.peak_batch == 16


def test_chunked_prefill_gives_identical_outputs(model, alone):
    prompts, params = prompts_and_params()
    engine = make_engine(model, max_num_tokens=7)  # the 40-token prompt takes 6+ steps
    assert outputs(engine.generate(prompts, params)) == alone
    assert engine.stats.computed_tokens <= 7 * engine.stats.num_steps
    # Alone, its first five chunks run steps that ask for no logits at all.
    engine = make_engine(model, max_num_tokens=7)
    assert outputs(engine.generate(prompts[-1:], params[-1:])) == alone[-1:]
    assert engine.stats.num_steps == 6 + params[-1].max_new_tokens - 1


def test_tiny_pool_preempts_and_gives_identical_outputs(model, alone):
    prompts, params = prompts_and_params()
    # 14 blocks of 4 tokens: the largest request (40 + 10) fits alone, the batch does not.
    engine = make_engine(model, num_blocks=14, max_num_tokens=64)
    results = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert any(r.num_preemptions for r in results)
    assert outputs(results) == alone
    assert engine.scheduler.blocks.num_used == 0 and engine.scheduler.slots.num_used == 0


def test_requests_join_mid_flight_and_abort_frees_resources(model, alone):
    prompts, params = prompts_and_params()
    long_params = [SamplingParams(max_new_tokens=12) for _ in prompts]
    engine = make_engine(model)
    first = [engine.add_request(prompts[i], long_params[i]) for i in (13, 14)]
    for _ in range(3):
        engine.step()  # prefill, then decoding
    seq = engine._unfinished[first[1]]
    assert seq.num_output_tokens == 3
    late = [engine.add_request(prompts[i], params[i]) for i in (0, 5, 15)]
    engine.step()  # the newcomers join this step, next to two decodes
    assert all(engine._unfinished[r].num_output_tokens == 1 for r in late)
    blocks_before, held = engine.scheduler.blocks.num_used, len(seq.block_table)
    slots_before = engine.scheduler.slots.num_used
    assert engine.abort(first[1])
    assert engine.scheduler.blocks.num_used == blocks_before - held
    assert engine.scheduler.slots.num_used == slots_before - 1
    for _ in engine.follow(first + late):
        pass
    aborted = engine.take_result(first[1])
    assert aborted.finish_reason == "abort" and len(aborted.output_token_ids) == 4
    kept = engine.take_result(first[0]).output_token_ids
    reference = make_engine(model, max_batch_size=1).generate([prompts[13], prompts[14]], long_params[13:15])
    assert kept == reference[0].output_token_ids
    assert aborted.output_token_ids == reference[1].output_token_ids[:4]
    assert [engine.take_result(r).output_token_ids for r in late] == [alone[i] for i in (0, 5, 15)]
    assert engine.scheduler.blocks.num_used == 0 and engine.scheduler.slots.num_used == 0


def test_sampling_seeded_top_k_and_stop_ids(model, alone):
    prompts, params = prompts_and_params()
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=6, ignore_eos=True)
    target = prompts[9]
    solo = make_engine(model).generate([target], sampled)[0].output_token_ids
    assert make_engine(model).generate([target], sampled)[0].output_token_ids == solo
    # Same request between unseeded sampled neighbours, arriving in a different order.
    neighbours = [SamplingParams(temperature=1.0, max_new_tokens=4)] * 3
    mixed = make_engine(model).generate([prompts[2], prompts[12], target, prompts[7]],
                                        neighbours[:2] + [sampled] + neighbours[2:])
    assert mixed[2].output_token_ids == solo
    # top_k=1 at any temperature is greedy.
    top1 = [SamplingParams(temperature=1.3, top_k=1, max_new_tokens=s.max_new_tokens) for s in params]
    assert outputs(make_engine(model).generate(prompts, top1)) == alone
    # A stop id ends the request at its first occurrence and is kept in the ids.
    i = max(range(len(alone)), key=lambda j: len(alone[j]))
    stop = alone[i][2]
    stopped = make_engine(model).generate([prompts[i]], SamplingParams(
        max_new_tokens=params[i].max_new_tokens, stop_token_ids=(stop,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == alone[i][: alone[i].index(stop) + 1]
