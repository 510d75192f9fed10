"""Cache pools bound to every step (DESIGN §3): one paged latent cache per MLA layer,
one conv-state and one recurrent-state pool per KDA layer, indexed by layer index. Under
tensor parallelism (``tp_size``) a rank holds its KDA heads' states and the whole MLA latent
(the latent is replicated, not split by heads)."""
from __future__ import annotations

from dataclasses import dataclass

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

    @staticmethod
    def allocate(cfg: K3Config, num_blocks: int, block_size: int, max_slots: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 tp_size: int = 1) -> "K3Caches":
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
        return K3Caches(latent, conv, rec, block_size)

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
