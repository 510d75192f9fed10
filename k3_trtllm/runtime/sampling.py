"""Per-request sampling parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass


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

    def token_ids_used(self) -> list[int]:
        """Every token id these parameters name (the engine checks them against its vocabulary)."""
        return [*self.stop_token_ids, *(t for w in self.bad_words for t in w), *(t for t, _ in self.logit_bias)]
