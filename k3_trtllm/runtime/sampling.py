"""Per-request sampling parameters."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes a sampled request reproducible regardless of which other
    requests share its steps. A request ends on EOS (unless ``ignore_eos``), on any of
    ``stop_token_ids`` (kept in the output ids), or after ``max_new_tokens``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        # Accept any iterable from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
