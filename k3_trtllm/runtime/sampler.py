"""Turns the logits of the sampling sequences into one token each."""
from __future__ import annotations

import torch

from k3_trtllm.runtime.sampling import SamplingParams
from k3_trtllm.runtime.sequence import Sequence


class Sampler:
    """Greedy rows take the argmax. Sampled rows draw from the temperature-scaled
    distribution after top-k and top-p filtering, with the request's own
    ``torch.Generator``, seeded from ``SamplingParams.seed`` (from the OS when None).
    Each row uses only its own logits and generator, so a seeded request yields the
    same tokens whatever else shares its steps."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [{len(seqs)}, vocab], got {tuple(logits.shape)}")
        if not seqs:
            return []
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            if not seq.sampling.is_greedy:
                tokens[i] = self._sample_row(logits[i], seq)
        return tokens

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> int:
        params = seq.sampling
        if seq.generator is None:
            seq.generator = torch.Generator(device=row.device)
            if params.seed is None:
                seq.generator.seed()
            else:
                seq.generator.manual_seed(params.seed)
        probs = filtered_probs(row.float(), params)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

def filtered_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of one row of fp32 logits after temperature, top-k and top-p."""
    scaled = row / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already does. The top token is always kept.
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs
