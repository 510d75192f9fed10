"""Cache pools bound to every step (DESIGN §3): one paged latent cache per MLA layer,
one conv-state and one recurrent-state pool per KDA layer, indexed by layer index. Under
tensor parallelism (``tp_size``) a rank holds its KDA heads' states and the whole MLA latent
(the latent is replicated, not split by heads).

The prefix cache adds a snapshot pool per KDA layer (``snapshot_conv`` / ``snapshot_recurrent``,
rows shaped like the state rows); ``copy_states`` copies rows within one namespace: rows
``[0, max_slots)`` are the state pools the steps bind, ``[max_slots, max_slots + snapshot_slots)``
the snapshot pools. They are separate tensors so that the step pools keep their shapes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import K3Config


def _state_dtype(act: torch.dtype) -> torch.dtype:
    # The delta-rule state is fp32 in production (spec §7.2); fp64 runs keep fp64 throughout.
    return torch.float64 if act == torch.float64 else torch.float32


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
                 tp_size: int = 1, snapshot_slots: int = 0) -> "K3Caches":
        latent, conv, rec = {}, {}, {}
        for i in cfg.mla_layer_indices:
            latent[i] = torch.zeros(num_blocks, block_size, cfg.mla.latent_dim, dtype=dtype, device=device)
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
    def bytes_per_block(cfg: K3Config, block_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return len(cfg.mla_layer_indices) * block_size * cfg.mla.latent_dim * item if cfg.mla else 0

    @staticmethod
    def bytes_per_slot(cfg: K3Config, dtype: torch.dtype = torch.bfloat16, tp_size: int = 1) -> int:
        if cfg.kda is None:
            return 0
        k, heads = cfg.kda, cfg.kda.num_heads // tp_size
        item = torch.empty((), dtype=dtype).element_size()
        state_item = torch.empty((), dtype=_state_dtype(dtype)).element_size()
        per_layer = 3 * heads * k.head_dim * (k.conv_kernel_size - 1) * item + heads * k.head_dim ** 2 * state_item
        return len(cfg.kda_layer_indices) * per_layer
