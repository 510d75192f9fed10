"""Per-request state: sampling parameters, tokens, cache placement and timing."""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes a sampled request reproducible regardless of which other
    requests share its steps. A request ends on EOS (unless ``ignore_eos``), on any of
    ``stop_token_ids`` (kept in the output ids), or after ``max_new_tokens``.

    The logit processing follows TensorRT-LLM's sampler (see runtime/sampler.py):
    ``logit_bias`` ((token id, bias) pairs, summed per id), then temperature, then for
    every token that occurs in the prompt or the output so far: ``repetition_penalty``
    (a positive logit divided by it, a negative one multiplied), ``presence_penalty``
    (subtracted once) and ``frequency_penalty`` (subtracted once per occurrence). Until
    ``min_tokens`` tokens are generated, EOS and ``stop_token_ids`` cannot be drawn.
    ``bad_words`` are token sequences that are never completed: the last token of each
    is banned wherever the sequence so far ends with the others. ``logprobs`` asks for
    each generated token's log-probability under the model's raw logits.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 16
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    bad_words: tuple[tuple[int, ...], ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be finite and > 0 (1 disables it), "
                             f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite (0 disables it), got {getattr(self, name)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        # Accept any iterables from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bad = tuple(tuple(int(t) for t in word) for word in self.bad_words)
        if any(not word or min(word) < 0 for word in bad):
            raise ValueError(f"bad_words must be non-empty sequences of non-negative ids, got {bad}")
        object.__setattr__(self, "bad_words", bad)
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(t < 0 or not math.isfinite(b) for t, b in bias):
            raise ValueError(f"logit_bias must pair non-negative ids with finite biases, got {bias}")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature/top-k/top-p touches this request's logits."""
        return self.has_penalties or bool(self.bad_words) or bool(self.logit_bias) or self.min_tokens > 0

    @functools.cached_property  # kept in the instance's __dict__: the fields never change
    def argmax_only(self) -> bool:
        """Whether a row's token is its raw logits' argmax and nothing else is asked of it (the
        sampler reads this for every row of every step)."""
        return self.is_greedy and not self.processes_logits and not self.logprobs

    def token_ids_used(self) -> list[int]:
        """Every token id these parameters name (the engine checks them against its vocabulary)."""
        return [*self.stop_token_ids, *(t for w in self.bad_words for t in w), *(t for t, _ in self.logit_bias)]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request.

    ``token_ids`` is the prompt followed by everything generated so far. The first
    ``num_cached_tokens`` of them are in the caches (latent-cache blocks of
    ``block_table`` and KDA state row ``state_slot``); the rest still have to run
    through the model. With the prefix cache, the first blocks of ``block_table`` may be
    shared with other sequences and ``num_cached_tokens`` start at a restored snapshot. A decoding sequence has exactly one uncached token (the last
    one sampled); after preemption everything is uncached again, so prompt and
    generated tokens are recomputed as one prefill.
    """

    __slots__ = (
        "seq_id", "sampling", "num_prompt_tokens", "token_ids", "num_cached_tokens",
        "block_table", "state_slot", "status", "finish_reason", "num_preemptions",
        "arrival_time", "first_token_time", "finish_time", "generator", "output_logprobs",
        "token_counts", "num_counted_tokens", "block_hashes", "prefix_cached_tokens",
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
        # Chain hashes of the full blocks of token_ids so far (block_manager.chain_hashes).
        self.block_hashes: list[bytes] = []
        # Prompt tokens the first admission found in the prefix cache and did not compute.
        self.prefix_cached_tokens = 0

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
