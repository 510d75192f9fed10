"""Sampler: filters and TensorRT-LLM's logit processing against hand-computed formulas,
seeds, batch independence, log-probabilities."""
import torch

import pytest

from k3_trtllm.runtime.sampler import Sampler, top_k_top_p_probs
from k3_trtllm.runtime.sequence import SamplingParams, Sequence


def seqs_for(params_list):
    return [Sequence(i, [5], p, 0.0) for i, p in enumerate(params_list)]


def random_logits(rows, vocab, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = random_logits(32, 100)
    expected = [max(range(100), key=lambda j: float(row[j])) for row in logits]
    greedy = Sampler().sample(logits, seqs_for([SamplingParams()] * 32))
    top1 = Sampler().sample(logits, seqs_for([SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(32)]))
    assert greedy == expected and top1 == expected


def test_top_k_keeps_the_k_largest_renormalized():
    row = random_logits(1, 50, seed=1)[0]
    params = SamplingParams(temperature=0.7, top_k=5)
    probs = top_k_top_p_probs(row / params.temperature, params.top_k, params.top_p)
    top = sorted(range(50), key=lambda j: -float(row[j]))[:5]
    weights = {j: torch.exp(row[j].double() / 0.7) for j in top}
    total = sum(weights.values())
    expected = torch.tensor([float(weights[j] / total) if j in weights else 0.0 for j in range(50)])
    # fp32 softmax vs fp64 formula: a few ulps.
    torch.testing.assert_close(probs, expected.float(), rtol=1e-5, atol=1e-7)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    row = random_logits(1, 40, seed=2)[0]
    for top_p in (0.05, 0.3, 0.75, 0.999):
        probs = top_k_top_p_probs(row, 0, top_p)
        full = torch.softmax(row.double(), 0)
        order = sorted(range(40), key=lambda j: -float(full[j]))
        kept, mass = [], 0.0
        for j in order:
            kept.append(j)
            mass += float(full[j])
            if mass >= top_p:
                break
        assert set(torch.nonzero(probs).flatten().tolist()) == set(kept)
        torch.testing.assert_close(probs[kept].double(), full[kept] / full[kept].sum(), rtol=1e-5, atol=1e-7)


def test_sampled_frequencies_follow_the_distribution():
    row = torch.tensor([0.0, 1.0, 2.0, -1.0])
    params = SamplingParams(temperature=1.0, seed=7)
    seq = seqs_for([params])[0]
    sampler = Sampler()
    n = 20000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sampler.sample(row[None], [seq])[0]] += 1
    # Binomial std is at most 0.0035 at n=20000; 0.015 is > 4 sigma.
    torch.testing.assert_close(counts / n, torch.softmax(row, 0), rtol=0, atol=0.015)


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    vocab, steps = 30, 20
    logits = random_logits(steps, vocab, seed=3)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def draw(with_neighbours):
        sampler = Sampler()
        target = seqs_for([params])[0]
        others = seqs_for([SamplingParams(temperature=2.0), SamplingParams(temperature=0.5, seed=5)])
        out = []
        for t in range(steps):
            if with_neighbours:
                # Neighbours sample before and after the target in the same call.
                batch = torch.stack([logits[(t + 1) % steps], logits[t], logits[(t + 2) % steps]])
                out.append(sampler.sample(batch, [others[0], target, others[1]])[1])
            else:
                out.append(sampler.sample(logits[t][None], [target])[0])
        return out

    alone = draw(False)
    assert draw(False) == alone
    assert draw(True) == alone
    # A different seed gives a different stream (20 draws from ~10 likely tokens).
    seq = seqs_for([SamplingParams(temperature=1.0, top_p=0.9, seed=4321)])[0]
    sampler = Sampler()
    assert [sampler.sample(logits[t][None], [seq])[0] for t in range(steps)] != alone


def seq_with(params, prompt, output=()):
    seq = Sequence(0, list(prompt), params, 0.0)
    seq.token_ids += list(output)
    return seq


ROW = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # Tokens 0 (logit 2) and 1 (logit -1) occur in the prompt, token 4 (-2) in the output.
    seq = seq_with(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[4, 4])
    got = Sampler().processed_logits(ROW, seq)
    assert got.tolist() == [1.0, -2.0, 0.5, 3.0, -4.0, 1.0]  # once per token, however often it occurs
    seq = seq_with(SamplingParams(repetition_penalty=0.5), prompt=[3], output=[1])
    assert Sampler().processed_logits(ROW, seq).tolist() == [2.0, -0.5, 0.5, 6.0, -2.0, 1.0]


def test_presence_and_frequency_penalties_count_prompt_and_output_after_temperature():
    # Token 0 once in the prompt and once in the output, token 2 once, token 5 three times.
    params = SamplingParams(temperature=0.5, presence_penalty=0.25, frequency_penalty=0.125)
    seq = seq_with(params, prompt=[0, 5, 2], output=[5, 0, 5])
    counts = [2, 0, 1, 0, 0, 3]
    expected = [x / 0.5 - (0.25 if c else 0.0) - 0.125 * c for x, c in zip(ROW.tolist(), counts)]
    assert Sampler().processed_logits(ROW, seq).tolist() == expected
    # Temperature first, as TensorRT-LLM does: (x / T) - p, not (x - p) / T.
    assert expected[2] == 0.5 / 0.5 - 0.25 - 0.125


def test_penalty_counts_follow_the_sequence_as_it_grows():
    params = SamplingParams(frequency_penalty=1.0)
    seq = seq_with(params, prompt=[1])
    sampler = Sampler()
    assert sampler.processed_logits(ROW, seq).tolist() == [2.0, -2.0, 0.5, 3.0, -2.0, 1.0]
    seq.token_ids += [3, 3]
    assert sampler.processed_logits(ROW, seq).tolist() == [2.0, -2.0, 0.5, 1.0, -2.0, 1.0]


def test_logit_bias_is_added_before_temperature():
    seq = seq_with(SamplingParams(temperature=2.0, logit_bias=((1, 3.0), (1, 1.0), (4, -1.0))), prompt=[0])
    assert Sampler().processed_logits(ROW, seq).tolist() == [1.0, 1.5, 0.25, 1.5, -1.5, 0.5]


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    eos = 3  # the argmax of ROW
    sampler = Sampler(eos_token_ids=(eos,))
    params = SamplingParams(min_tokens=2, stop_token_ids=(0,))
    seq = seq_with(params, prompt=[1])
    picked = []
    for _ in range(3):
        token = sampler.sample(ROW[None], [seq])[0]
        picked.append(token)
        seq.token_ids.append(token)
    assert picked == [5, 5, eos]  # 3 (eos) and 0 (stop id) are masked for the first two tokens
    ignoring = seq_with(SamplingParams(min_tokens=2, ignore_eos=True), prompt=[1])
    assert sampler.sample(ROW[None], [ignoring]) == [eos]  # with ignore_eos, eos is no end id


def test_bad_words_are_never_produced():
    sampler = Sampler()
    # A single-token bad word: never drawn, even though it is the most likely token.
    params = SamplingParams(temperature=1.0, seed=3, bad_words=((3,),))
    seq = seq_with(params, prompt=[0])
    draws = [sampler.sample(ROW[None], [seq])[0] for _ in range(500)]
    assert 3 not in draws and len(set(draws)) > 2
    # A two-token bad word [5, 3]: 3 is banned right after 5 only.
    params = SamplingParams(bad_words=((5, 3),))
    assert sampler.sample(ROW[None], [seq_with(params, prompt=[0, 5])]) == [0]
    assert sampler.sample(ROW[None], [seq_with(params, prompt=[5, 0])]) == [3]


def test_log_probs_are_log_softmax_of_the_raw_logits():
    logits = random_logits(3, 40, seed=9)
    params = [SamplingParams(logprobs=True), SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=True,
                                                          repetition_penalty=1.3),
              SamplingParams(temperature=1.0, seed=2)]
    seqs = [seq_with(p, prompt=[1, 2]) for p in params]
    tokens = Sampler().sample(logits, seqs)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i in (0, 1):
        assert seqs[i].output_logprobs == pytest.approx([float(reference[i, tokens[i]])], abs=1e-6)
    assert seqs[2].output_logprobs == []  # not asked for


@pytest.mark.parametrize("params, message", [
    (SamplingParams(bad_words=((7,),)), r"token ids \[7\] in the sampling parameters are outside"),
    (SamplingParams(bad_words=tuple((t,) for t in range(5)), min_tokens=1), "ban every token"),
])
def test_check_refuses_what_the_vocabulary_cannot_honour(params, message):
    with pytest.raises(ValueError, match=message):
        Sampler(eos_token_ids=(5,)).check(params, vocab_size=6)


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 0.0), ("presence_penalty", float("nan")), ("min_tokens", -1), ("bad_words", ((),)),
    ("logit_bias", ((1, float("inf")),)),
])
def test_sampling_params_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_engine_returns_each_tokens_log_prob_of_the_logits_it_was_drawn_from():
    from pathlib import Path

    from k3_trtllm.runtime.engine import build_engine

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny-k3"
    engine = build_engine(str(tiny), dtype=torch.float32, max_batch_size=4, max_seq_len=64, num_blocks=16,
                          max_slots=4)
    seen = {}  # request id -> the logits rows it sampled from, in order
    sample = engine.sampler.sample

    def recording(logits, seqs):
        for row, seq in zip(logits, seqs):
            seen.setdefault(seq.seq_id, []).append(row.clone())
        return sample(logits, seqs)

    engine.sampler.sample = recording
    params = [SamplingParams(max_new_tokens=5, logprobs=True),
              SamplingParams(max_new_tokens=4, temperature=0.9, seed=3, repetition_penalty=1.5, logprobs=True),
              SamplingParams(max_new_tokens=3)]
    streamed = {}
    ids = [engine.add_request(p, s) for p, s in zip(["ab", "hello", "xyz"], params)]
    for out in engine.follow(ids):
        streamed.setdefault(out.request_id, []).extend(out.new_log_probs or [])
    results = [engine.take_result(rid) for rid in ids]
    for rid, result in zip(ids[:2], results[:2]):
        reference = [float(torch.log_softmax(row.double(), -1)[t]) for row, t in zip(seen[rid], result.output_token_ids)]
        assert result.output_log_probs == pytest.approx(reference, abs=1e-6) == streamed[rid]
        assert len(reference) == len(result.output_token_ids)
    assert results[2].output_log_probs is None and streamed[ids[2]] == []  # not asked for
