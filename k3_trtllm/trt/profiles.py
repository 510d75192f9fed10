"""Build limits and the two optimisation profiles (prefill-sized and decode-sized).

Pure Python: the build config records them, the builder turns them into TensorRT
profiles, the engine executor runs a step on the one of its phase (``decode``, which the
model runner decides on the host: ``model/step.py: is_pure_decode``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import K3Config
from ..export.engine_io import (LOGITS, MAX_BLOCKS, MAX_SLOTS, NUM_BLOCKS, SEQS, SEQS_PLUS_1, SNAPSHOT_POINTS,
                                SNAPSHOT_SLOTS, TOKENS, TensorIO)
from ..ops.contract import KDA_CHUNK

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class BuildLimits:
    max_batch_size: int = 8
    max_num_tokens: int = 512
    max_seq_len: int = 2048
    block_size: int = 64

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @property
    def max_num_blocks(self) -> int:
        """Pool blocks for every sequence of a full batch at full length."""
        return self.max_batch_size * self.max_blocks_per_seq

    @property
    def max_snapshot_points(self) -> int:
        """KDA snapshot points of one sequence in a step: at every KDA_CHUNK tokens of a chunk
        and at its end (contract KDA_PREFILL), a chunk being at most max_num_tokens."""
        return self.max_num_tokens // KDA_CHUNK + 1

    @property
    def max_snapshot_slots(self) -> int:
        """Snapshot rows an engine binds: a held snapshot is keyed by the last block of its prefix,
        a different block for every snapshot, so more rows than pool blocks are never all usable."""
        return self.max_num_blocks

    def validate(self, cfg: K3Config) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size "
                             f"({self.max_batch_size}): a decode step carries one token per sequence")
        max_pos = cfg.text_dict().get("max_position_embeddings")
        if max_pos is not None and self.max_seq_len > max_pos:
            raise ValueError(f"max_seq_len ({self.max_seq_len}) exceeds the model's max_position_embeddings "
                             f"({max_pos})")
        if self.max_num_tokens > self.max_batch_size * self.max_seq_len:
            raise ValueError(f"max_num_tokens ({self.max_num_tokens}) exceeds max_batch_size * max_seq_len "
                             f"({self.max_batch_size * self.max_seq_len}): no step can carry that many tokens")


def dim_ranges(limits: BuildLimits, phase: str) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every dynamic dim in one profile."""
    b = limits.max_batch_size
    tokens = (1, max(1, limits.max_num_tokens // 2), limits.max_num_tokens) if phase == PREFILL else (1, b, b)
    seqs = (1, b, b) if phase == DECODE else (1, max(1, b // 2), b)
    mb = limits.max_blocks_per_seq
    return {
        TOKENS: tokens, SEQS: seqs, SEQS_PLUS_1: tuple(s + 1 for s in seqs), LOGITS: seqs,
        MAX_BLOCKS: (1, mb, mb), NUM_BLOCKS: (1, limits.max_num_blocks, limits.max_num_blocks),
        MAX_SLOTS: (1, b, b),
        # decode steps take no snapshots (the runner copies their rows): one -1 column
        SNAPSHOT_POINTS: (1, 1, limits.max_snapshot_points if phase == PREFILL else 1),
        SNAPSHOT_SLOTS: (1, min(b, limits.max_snapshot_slots), limits.max_snapshot_slots),
    }


def profile_shapes(inputs: tuple[TensorIO, ...], limits: BuildLimits, phase: str,
                   extra: dict[str, tuple[int, int, int]] | None = None) -> dict[str, list[list[int]]]:
    """Input name -> [min shape, opt shape, max shape]; ``extra``: (min, opt, max) of dims
    that the limits do not fix (a segment's AttnRes block count)."""
    ranges = {**dim_ranges(limits, phase), **(extra or {})}
    out = {}
    for t in inputs:
        out[t.name] = [[d if isinstance(d, int) else ranges[d][k] for d in t.shape] for k in range(3)]
    return out
