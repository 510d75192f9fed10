"""Per-request state: tokens, cache placement and timing."""
from __future__ import annotations

import enum
from typing import Any

from k3_trtllm.runtime.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request.

    ``token_ids`` is the prompt followed by everything generated so far. The first
    ``num_cached_tokens`` of them are in the caches (latent-cache blocks of
    ``block_table`` and KDA state row ``state_slot``); the rest still have to run
    through the model. A decoding sequence has exactly one uncached token (the last
    one sampled); after preemption everything is uncached again, so prompt and
    generated tokens are recomputed as one prefill.
    """

    __slots__ = (
        "seq_id", "sampling", "num_prompt_tokens", "token_ids", "num_cached_tokens",
        "block_table", "state_slot", "status", "finish_reason", "num_preemptions",
        "arrival_time", "first_token_time", "finish_time", "generator", "output_logprobs",
        "token_counts", "num_counted_tokens",
    )

    def __init__(self, seq_id: int, prompt_token_ids: list[int], sampling: SamplingParams,
                 arrival_time: float) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token")
        self.seq_id = seq_id
        self.sampling = sampling
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.state_slot: int | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # The sampler's per-request RNG (a torch.Generator); opaque to everything else.
        self.generator: Any = None
        # Log-probability of each output token, when ``sampling.logprobs`` asks for them.
        self.output_logprobs: list[float] = []
        # The sampler's running count of each token id in token_ids (for the penalties)
        # and how many of token_ids it covers; opaque to everything else.
        self.token_counts: Any = None
        self.num_counted_tokens = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two)."""
        n = self.num_output_tokens
        if n < 2 or self.finish_time is None or self.first_token_time is None:
            return None
        return (self.finish_time - self.first_token_time) / (n - 1)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, tokens={len(self.token_ids)}, "
                f"cached={self.num_cached_tokens}, blocks={len(self.block_table)}, slot={self.state_slot})")
