"""The rank layout of a sharded checkpoint, following TensorRT-LLM's ``Mapping``:
world size = tp (pp 1); routed experts use ``moe_ep = ep`` expert-parallel groups of
``moe_tp = tp / ep`` ranks, with ``moe_ep_rank = rank % ep`` and
``moe_tp_rank = rank // ep``. Which slice of an HF part each rank holds lives here, so
the converter and the reassembler cannot disagree about it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError
from .mapping import REPLICATE, ROWS, Part
from ..config import K3Config
from ..mxfp4 import GROUP_SIZE


@dataclass(frozen=True)
class Holder:
    """One rank holding (a slice of) a part: slice ``index`` of ``count`` along the split."""

    rank: int
    index: int
    count: int


@dataclass(frozen=True)
class RankLayout:
    """A world of ``tp`` ranks with ``ep`` expert-parallel groups; which rank holds what."""

    tp: int = 1
    ep: int = 1
    num_experts: int = 0  # 0: no routed experts

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def moe_ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def moe_tp_rank(self, rank: int) -> int:
        return rank // self.ep

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    def holders(self, part: Part) -> list[Holder]:
        """The ranks holding ``part``, each with its slice of the part's split."""
        if part.expert is None:
            count = 1 if part.split == REPLICATE else self.tp
            return [Holder(r, 0 if count == 1 else r, count) for r in range(self.tp)]
        owner = part.expert // self.experts_per_rank
        count = 1 if part.split == REPLICATE else self.moe_tp
        return [Holder(r, 0 if count == 1 else self.moe_tp_rank(r), count)
                for r in range(self.tp) if self.moe_ep_rank(r) == owner]

    def mapping_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "tp_size": self.tp, "pp_size": 1, "cp_size": 1,
                "moe_tp_size": self.moe_tp, "moe_ep_size": self.ep, "moe_cluster_size": 1}

    @classmethod
    def from_mapping_json(cls, mapping: dict[str, Any], cfg: K3Config, where: str) -> "RankLayout":
        try:
            tp, ep, world = int(mapping["tp_size"]), int(mapping["moe_ep_size"]), int(mapping["world_size"])
            moe_tp, pp = int(mapping["moe_tp_size"]), int(mapping.get("pp_size", 1))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: field `mapping` = {mapping!r}: expected world_size, tp_size, "
                               "moe_tp_size and moe_ep_size") from e
        if pp != 1 or world != tp or moe_tp * ep != tp:
            raise CheckpointError(f"{where}: field `mapping` = {mapping!r}: expected pp_size 1, world_size = tp_size "
                               "and moe_tp_size * moe_ep_size = tp_size")
        return cls(tp, ep, cfg.moe.num_experts if cfg.moe else 0)


def slice_range(length: int, index: int, count: int) -> tuple[int, int]:
    step = length // count
    return index * step, (index + 1) * step


def local_shape(part: Part, holder: Holder) -> tuple[int, ...]:
    shape = list(part.shape)
    if holder.count > 1:
        shape[0 if part.split == ROWS else 1] //= holder.count
    return tuple(shape)


def rank_layout_for(cfg: K3Config, tp: int, ep: int, mxfp4_experts: bool) -> RankLayout:
    """Validate ``--tp``/``--ep`` against the model; every violated dimension in one error."""
    if tp % ep:
        raise CheckpointError(f"--tp {tp} is not divisible by --ep {ep} (expert parallelism subdivides the "
                           "tensor-parallel ranks: moe_tp_size = tp / ep)")
    moe = cfg.moe
    if moe is None and ep > 1:
        raise CheckpointError(f"--ep {ep}: the model has no routed experts (use --ep 1)")
    problems = []

    def need(name: str, value: int, flag: str, by: int) -> None:
        if value % by:
            problems.append(f"{name} = {value} is not divisible by {flag} {by}")

    if cfg.kda is not None:
        need("linear_attn_config.num_heads", cfg.kda.num_heads, "--tp", tp)
    if cfg.mla is not None:
        need("num_attention_heads", cfg.mla.num_heads, "--tp", tp)
    if any(p.ffn == "dense" for p in cfg.layers):
        need("intermediate_size", cfg.intermediate_size, "--tp", tp)
    need("vocab_size", cfg.vocab_size, "--tp", tp)
    if moe is not None:
        if moe.num_shared_experts:
            need("shared expert intermediate size (moe_intermediate_size * num_shared_experts)",
                 moe.shared_intermediate_size, "--tp", tp)
        need("num_experts", moe.num_experts, "--ep", ep)
        moe_tp = tp // ep
        if moe_tp > 1:
            inter = moe.moe_intermediate_size
            need("moe_intermediate_size", inter, f"moe_tp_size (--tp {tp} / --ep {ep}) =", moe_tp)
            if mxfp4_experts and inter % moe_tp == 0 and (inter // moe_tp) % GROUP_SIZE:
                problems.append(
                    f"moe_intermediate_size = {inter} split over moe_tp_size {moe_tp} (--tp {tp} / --ep {ep}) "
                    f"gives {inter // moe_tp} per rank, not a multiple of {GROUP_SIZE} (MXFP4 scale groups)")
    if problems:
        raise CheckpointError(f"cannot shard the model with --tp {tp} --ep {ep}:\n  " + "\n  ".join(problems))
    return RankLayout(tp, ep, moe.num_experts if moe else 0)
