"""Turns the logits of the sampling sequences into one token each.

The logit processing is TensorRT-LLM's (its penalty kernel, ``batchApplyPenalty``, and
its bad-words kernel), so that a request sent to a TensorRT-LLM server and to k3-trt
is sampled from the same distribution: logit bias, then temperature, then the
repetition / presence / frequency penalties over every token of the sequence so far
(prompt and output: TensorRT-LLM counts both, and its ``prompt_ignore_length`` exists
to exclude the prompt), then ``min_tokens`` masking the end ids and ``bad_words``
masking their last token; top-k and top-p filter what is left. Log-probabilities are
those of the raw logits (TensorRT-LLM's default ``LogprobMode.RAW``), so that they do
not depend on the sampling settings.
"""
from __future__ import annotations

import torch

from k3_trtllm.runtime.sequence import SamplingParams, Sequence


class Sampler:
    """Greedy rows take the argmax of their processed logits. Sampled rows draw from
    the processed distribution after top-k and top-p filtering, with the request's own
    ``torch.Generator``, seeded from ``SamplingParams.seed`` (from the OS when None).
    Each row uses only its own logits, tokens and generator, so a seeded request yields
    the same tokens whatever else shares its steps. ``eos_token_ids`` are the ids that
    ``min_tokens`` holds back (with the request's ``stop_token_ids``)."""

    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def check(self, params: SamplingParams, vocab_size: int) -> None:
        """Refuse parameters this vocabulary cannot honour (ValueError naming them)."""
        outside = sorted({t for t in params.token_ids_used() if t >= vocab_size})
        if outside:
            raise ValueError(f"token ids {outside[:5]} in the sampling parameters are outside the vocabulary "
                             f"[0, {vocab_size})")
        banned = {w[0] for w in params.bad_words if len(w) == 1}
        if params.min_tokens > 0:
            banned |= set(self._end_ids(params))
        if sum(1 for t in banned if t < vocab_size) >= vocab_size:
            raise ValueError("bad_words (with the end ids that min_tokens holds back) ban every token of the "
                             "vocabulary")

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [{len(seqs)}, vocab], got {tuple(logits.shape)}")
        if not seqs:
            return []
        tokens = logits.argmax(dim=-1).tolist()  # plain greedy rows need nothing else
        for i, seq in enumerate(seqs):
            params = seq.sampling
            if params.argmax_only:
                continue
            if params.processes_logits or not params.is_greedy:
                row = self.processed_logits(logits[i], seq)
                tokens[i] = int(row.argmax()) if params.is_greedy else self._draw(row, seq)
            if params.logprobs:
                seq.output_logprobs.append(float(torch.log_softmax(logits[i].float(), dim=-1)[tokens[i]]))
        return tokens

    def processed_logits(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """One row of logits (fp32) after bias, temperature, penalties, min_tokens and
        bad words, for the next token of ``seq``: what top-k/top-p and the draw see."""
        params = seq.sampling
        x = row.float().clone()
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], device=x.device)
            x.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], device=x.device))
        if not params.is_greedy:
            x = x / params.temperature
        if params.has_penalties:
            counts = _token_counts(seq, x.shape[0], x.device)
            seen = counts > 0
            penalized = torch.where(x < 0, x * params.repetition_penalty, x / params.repetition_penalty)
            x = torch.where(seen, penalized, x)
            x = x - params.presence_penalty * seen.float() - params.frequency_penalty * counts
        masked: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            masked += self._end_ids(params)
        for word in params.bad_words:
            prefix = word[:-1]
            if not prefix or tuple(seq.token_ids[-len(prefix):]) == prefix:
                masked.append(word[-1])
        masked = [t for t in masked if t < x.shape[0]]
        if masked:
            x[torch.tensor(masked, device=x.device)] = float("-inf")
        return x

    def _end_ids(self, params: SamplingParams) -> list[int]:
        return [*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)]

    def _draw(self, row: torch.Tensor, seq: Sequence) -> int:
        params = seq.sampling
        if seq.generator is None:
            seq.generator = torch.Generator(device=row.device)
            if params.seed is None:
                seq.generator.seed()
            else:
                seq.generator.manual_seed(params.seed)
        probs = top_k_top_p_probs(row, params.top_k, params.top_p)
        return int(torch.multinomial(probs, 1, generator=seq.generator))


def _token_counts(seq: Sequence, vocab_size: int, device) -> torch.Tensor:
    """How often each id occurs in ``seq.token_ids`` (fp32, on ``device``), kept on the
    sequence and updated with only the tokens added since the last call."""
    if seq.token_counts is None:
        seq.token_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        seq.num_counted_tokens = 0
    new = seq.token_ids[seq.num_counted_tokens:]
    if new:
        ids = torch.tensor(new, device=device)
        seq.token_counts.index_add_(0, ids, torch.ones(len(new), device=device))
        seq.num_counted_tokens = len(seq.token_ids)
    return seq.token_counts


def top_k_top_p_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities of one row of fp32 logits after top-k and top-p filtering."""
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already does. The top token is always kept.
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs
