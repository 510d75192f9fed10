"""Cache pools bound to every step (DESIGN §3): one paged latent cache per MLA layer,
one conv-state and one recurrent-state pool per KDA layer, indexed by layer index. Under
tensor parallelism (``tp_size``) a rank holds its KDA heads' states and the whole MLA latent
(the latent is replicated, not split by heads).

The prefix cache adds a snapshot pool per KDA layer (``snapshot_conv`` / ``snapshot_recurrent``,
rows shaped like the state rows); ``copy_states`` copies rows within one namespace: rows
``[0, max_slots)`` are the state pools the steps bind, ``[max_slots, max_slots + snapshot_slots)``
the snapshot pools. They are separate tensors so that the step pools keep their shapes.

``kv_cache_dtype`` (``--kv-cache-dtype``) picks the latent rows: ``auto`` (the activation
dtype: bf16 in production, fp32/fp64 in reference runs), ``bf16`` (the same, stated: needs
bf16 activations), or ``fp8``: one uint8 row of ``fp8_cache.row_bytes`` per token (E4M3
latents, an fp32 scale per ``scale_group_for(R)`` channels, bf16 rope; the layout is
``ops/mla/fp8_cache.py`` and contract ``MLA_*_FP8``), 0.57x the bytes of a bf16 row for K3."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import K3Config, MlaConfig
from ..ops.mla import fp8_cache

KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


def _state_dtype(act: torch.dtype) -> torch.dtype:
    # The delta-rule state is fp32 in production (spec §7.2); fp64 runs keep fp64 throughout.
    return torch.float64 if act == torch.float64 else torch.float32


def is_fp8_cache(kv_cache_dtype: str, act: torch.dtype) -> bool:
    """Whether ``kv_cache_dtype`` means fp8 latent rows; ValueError naming the value when it
    is none of KV_CACHE_DTYPES or asks for a bf16 cache beside other activations (the MLA
    contract reads the latents in the activation dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "bf16" and act != torch.bfloat16:
        raise ValueError(f"kv_cache_dtype bf16: the activations are {str(act).removeprefix('torch.')} and the "
                         "latent cache is in their dtype; use auto (the activation dtype) or fp8")
    return kv_cache_dtype == "fp8"


def latent_row(mla: MlaConfig, act: torch.dtype, kv_cache_dtype: str = "auto") -> tuple[torch.dtype, int]:
    """(dtype, last dim) of a latent pool: ``[R+Dr]`` activations, or ``row_bytes`` uint8
    (contract ``MLA_*_FP8``: ``R+4*R/Q+2*Dr``) for the fp8 cache."""
    if is_fp8_cache(kv_cache_dtype, act):
        R = mla.kv_lora_rank
        return torch.uint8, fp8_cache.row_bytes(R, mla.qk_rope_head_dim, fp8_cache.scale_group_for(R))
    return act, mla.latent_dim


def kv_cache_label(kv_cache_dtype: str, act: torch.dtype) -> str:
    """What the latent rows hold, for configs and reports: ``fp8`` or the activation dtype's name."""
    return "fp8" if is_fp8_cache(kv_cache_dtype, act) else str(act).removeprefix("torch.")


@dataclass
class K3Caches:
    latent: dict[int, torch.Tensor]  # MLA layer -> [num_blocks, block_size, R+Dr]
    conv: dict[int, torch.Tensor]  # KDA layer -> [max_slots, 3P, W-1]
    recurrent: dict[int, torch.Tensor]  # KDA layer -> [max_slots, H, K, V]
    block_size: int
    snapshot_conv: dict[int, torch.Tensor] = field(default_factory=dict)  # KDA layer -> [snapshot_slots, 3P, W-1]
    snapshot_recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # KDA layer -> [snapshot_slots, H, K, V]

    @staticmethod
    def allocate(cfg: K3Config, num_blocks: int, block_size: int, max_slots: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 tp_size: int = 1, snapshot_slots: int = 0, kv_cache_dtype: str = "auto") -> "K3Caches":
        latent, conv, rec = {}, {}, {}
        if cfg.mla is not None:
            row_dtype, row = latent_row(cfg.mla, dtype, kv_cache_dtype)
        for i in cfg.mla_layer_indices:
            latent[i] = torch.zeros(num_blocks, block_size, row, dtype=row_dtype, device=device)
        if cfg.kda is not None:
            k, heads = cfg.kda, cfg.kda.num_heads // tp_size
            for i in cfg.kda_layer_indices:
                conv[i] = torch.zeros(max_slots, 3 * heads * k.head_dim, k.conv_kernel_size - 1, dtype=dtype,
                                      device=device)
                rec[i] = torch.zeros(max_slots, heads, k.head_dim, k.head_dim,
                                     dtype=_state_dtype(dtype), device=device)
        caches = K3Caches(latent, conv, rec, block_size)
        caches.allocate_snapshots(snapshot_slots)
        return caches

    def allocate_snapshots(self, snapshot_slots: int) -> None:
        """(Re)allocate the snapshot pools: ``snapshot_slots`` rows per KDA layer, zeroed."""
        if snapshot_slots < 0:
            raise ValueError(f"snapshot_slots must be >= 0, got {snapshot_slots}")
        self.snapshot_conv = {i: t.new_zeros((snapshot_slots, *t.shape[1:])) for i, t in self.conv.items()}
        self.snapshot_recurrent = {i: t.new_zeros((snapshot_slots, *t.shape[1:])) for i, t in self.recurrent.items()}

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """For each ``(src, dst)``: state row ``dst`` becomes a copy of row ``src``, in every KDA
        layer (conv and recurrent). All sources are read before any destination is written."""
        if not self.conv or not copies:
            return
        first = next(iter(self.conv))
        slots, snaps = self.conv[first].shape[0], self.snapshot_conv[first].shape[0] if self.snapshot_conv else 0
        rows = slots + snaps
        for src, dst in copies:
            if not (0 <= src < rows and 0 <= dst < rows):
                raise ValueError(f"state copy {src} -> {dst}: rows are 0..{rows - 1} "
                                 f"({slots} slots, {snaps} snapshots)")
        if len({dst for _, dst in copies}) != len(copies):
            raise ValueError(f"state copies {copies} write one row twice")

        def row(pools: tuple[torch.Tensor, torch.Tensor | None], r: int) -> torch.Tensor:
            return pools[1][r - slots] if r >= slots else pools[0][r]

        if not {src for src, _ in copies} & {dst for _, dst in copies}:
            # no row is both read and written (the prefix cache's restores, snapshot -> slot, and its
            # copies after a step, slot -> snapshot): row views copied directly, every layer in one fused
            # launch per pool kind on CUDA (one dtype per list: the fast path); no index tensors to
            # stage, no gathered temporaries
            for running, snapshot in ((self.conv, self.snapshot_conv), (self.recurrent, self.snapshot_recurrent)):
                dsts, srcs = [], []
                for i in running:
                    pools = (running[i], snapshot.get(i))
                    for src, dst in copies:
                        dsts.append(row(pools, dst))
                        srcs.append(row(pools, src))
                torch._foreach_copy_(dsts, srcs)
            return
        device = self.conv[first].device
        # one index_select / index_copy_ per (source pool, destination pool) and tensor,
        # not one per copy: K3 has dozens of KDA layers
        groups: dict[tuple[bool, bool], tuple[list[int], list[int]]] = {}
        for src, dst in copies:
            s_idx, d_idx = groups.setdefault((src >= slots, dst >= slots), ([], []))
            s_idx.append(src - slots if src >= slots else src)
            d_idx.append(dst - slots if dst >= slots else dst)
        plans = [(from_snap, to_snap, torch.tensor(s, device=device), torch.tensor(d, device=device))
                 for (from_snap, to_snap), (s, d) in groups.items()]
        for running, snapshot in ((self.conv, self.snapshot_conv), (self.recurrent, self.snapshot_recurrent)):
            for i in running:
                pools = (running[i], snapshot.get(i))  # no snapshot pool: only slot-to-slot copies
                reads = [pools[f].index_select(0, s) for f, _, s, _ in plans]
                for (_, to_snap, _, d), values in zip(plans, reads):
                    pools[to_snap].index_copy_(0, d, values)

    @staticmethod
    def bytes_per_block(cfg: K3Config, block_size: int, dtype: torch.dtype = torch.bfloat16,
                        kv_cache_dtype: str = "auto") -> int:
        if not cfg.mla:
            return 0
        row_dtype, row = latent_row(cfg.mla, dtype, kv_cache_dtype)
        return len(cfg.mla_layer_indices) * block_size * row * torch.empty((), dtype=row_dtype).element_size()

    @staticmethod
    def bytes_per_slot(cfg: K3Config, dtype: torch.dtype = torch.bfloat16, tp_size: int = 1) -> int:
        if cfg.kda is None:
            return 0
        k, heads = cfg.kda, cfg.kda.num_heads // tp_size
        item = torch.empty((), dtype=dtype).element_size()
        state_item = torch.empty((), dtype=_state_dtype(dtype)).element_size()
        per_layer = 3 * heads * k.head_dim * (k.conv_kernel_size - 1) * item + heads * k.head_dim ** 2 * state_item
        return len(cfg.kda_layer_indices) * per_layer
