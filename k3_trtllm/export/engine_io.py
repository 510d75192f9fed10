"""The engine's I/O, by name (DESIGN §3): step tensors, then the cache pools, which are
inputs and also outputs (``<pool>_out``), so the same device buffer can be bound to both.

This one list is what the exporter names the ONNX graph's I/O after, what the build
config records, and what an executor binds by name; tests compare it with the graph."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import K3Config
from ..model.caches import K3Caches, latent_row
from ..model.step import StepInputs

# Dims named here are dynamic in the graph and get a range in every optimisation profile.
TOKENS, SEQS, SEQS_PLUS_1, LOGITS, MAX_BLOCKS, NUM_BLOCKS, MAX_SLOTS = (
    "num_tokens", "num_seqs", "num_seqs+1", "num_logits", "max_blocks", "num_blocks", "max_slots")
# the prefix cache's KDA snapshots (contract KDA_PREFILL's N and Ns): points per sequence in a
# step, and rows of the snapshot pools
SNAPSHOT_POINTS, SNAPSHOT_SLOTS = "snapshot_points", "snapshot_slots"


@dataclass(frozen=True)
class TensorIO:
    name: str
    dtype: torch.dtype
    shape: tuple[int | str, ...]  # ints are fixed by the config, strings are dynamic dims
    # "latent" | "conv" | "recurrent" | "snapshot_conv" | "snapshot_recurrent" for cache pools (the
    # K3Caches field), "" for step tensors
    pool: str = ""
    layer: int = -1

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype).removeprefix("torch."), "shape": list(self.shape),
                **({"pool": self.pool, "layer": self.layer} if self.pool else {})}


STEP_INPUTS: tuple[TensorIO, ...] = tuple(TensorIO(n, torch.int32, s) for n, s in (
    ("input_ids", (TOKENS,)),
    ("positions", (TOKENS,)),
    ("cu_seqlens", (SEQS_PLUS_1,)),
    ("context_lens", (SEQS,)),
    ("logits_indices", (LOGITS,)),
    ("block_tables", (SEQS, MAX_BLOCKS)),
    ("slot_mapping", (TOKENS,)),
    ("state_slots", (SEQS,)),
    ("has_initial_state", (SEQS,)),
))


def pool_dtype(pool: str, act: torch.dtype) -> torch.dtype:
    """Latent and conv pools hold activations; the delta-rule state is fp32 (fp64 in fp64 runs)."""
    if pool == "recurrent":
        return torch.float64 if act == torch.float64 else torch.float32
    return act


def latent_pool_type(cfg: K3Config, act: torch.dtype, kv_cache_dtype: str = "auto") -> tuple[torch.dtype, int]:
    """(graph dtype, row width) of a latent pool (``model/caches.py: latent_row``): the fp8
    cache's uint8 rows are typed INT8 in the graphs, as every contract-"uint8" tensor is
    (``schemas.BYTES_ONNX_TYPE``, the same bytes); the executors bind the uint8 pools."""
    dtype, width = latent_row(cfg.mla, act, kv_cache_dtype)
    return (torch.int8 if dtype == torch.uint8 else dtype), width


def cache_pools(cfg: K3Config, act: torch.dtype, block_size: int, kv_cache_dtype: str = "auto") -> tuple[TensorIO, ...]:
    """Pools in layer order; within a KDA layer conv before recurrent, then the prefix cache's
    snapshot pools of the same shapes (graph inputs, so that the graph allocates none per call;
    the step graph takes no snapshot points, so it never writes them)."""
    pools = []
    for layer in sorted(cfg.mla_layer_indices + cfg.kda_layer_indices):
        if layer in cfg.mla_layer_indices:
            dtype, width = latent_pool_type(cfg, act, kv_cache_dtype)
            pools.append(TensorIO(f"latent_cache_{layer}", dtype, (NUM_BLOCKS, block_size, width), "latent", layer))
        else:
            k = cfg.kda
            conv, rec = (3 * k.proj_dim, k.conv_kernel_size - 1), (k.num_heads, k.head_dim, k.head_dim)
            for name, pool, rows, shape in (("conv_state", "conv", MAX_SLOTS, conv),
                                            ("recurrent_state", "recurrent", MAX_SLOTS, rec),
                                            ("snapshot_conv", "snapshot_conv", SNAPSHOT_SLOTS, conv),
                                            ("snapshot_recurrent", "snapshot_recurrent", SNAPSHOT_SLOTS, rec)):
                dtype = pool_dtype(pool.removeprefix("snapshot_"), act)
                pools.append(TensorIO(f"{name}_{layer}", dtype, (rows, *shape), pool, layer))
    return tuple(pools)


def engine_inputs(cfg: K3Config, act: torch.dtype, block_size: int,
                  kv_cache_dtype: str = "auto") -> tuple[TensorIO, ...]:
    return STEP_INPUTS + cache_pools(cfg, act, block_size, kv_cache_dtype)


def engine_outputs(cfg: K3Config, act: torch.dtype, block_size: int,
                   kv_cache_dtype: str = "auto") -> tuple[TensorIO, ...]:
    logits = TensorIO("logits", torch.float64 if act == torch.float64 else torch.float32, (LOGITS, cfg.vocab_size))
    return (logits,) + tuple(TensorIO(f"{p.name}_out", p.dtype, p.shape, p.pool, p.layer)
                             for p in cache_pools(cfg, act, block_size, kv_cache_dtype))


def pool_tensor(caches: K3Caches, pool: TensorIO) -> torch.Tensor:
    return getattr(caches, pool.pool)[pool.layer]


def flatten_step(step: StepInputs) -> list[torch.Tensor]:
    return [getattr(step, t.name) for t in STEP_INPUTS]


def step_from_flat(tensors) -> StepInputs:
    return StepInputs(**{t.name: x for t, x in zip(STEP_INPUTS, tensors)})
