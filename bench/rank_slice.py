#!/usr/bin/env python3
"""One K3 rank on one GPU, against its floors (issue 20; DESIGN §11 measured an earlier form).

    python bench/rank_slice.py --config ../shared/k3/config.json --tp 8 --ep 8 --layers 8 \\
        --out bench/results/rank_slice_h200.json
    python bench/rank_slice.py --repeat-check --out repeat.json      # determinism (issue 23)
    python bench/rank_slice.py --device cpu --config examples/tiny-k3/config.json --tp 2 --ep 2 \\
        --layers 4 --batches 1,2 --contexts 16 --prefill-tokens 32   # the same code at tiny dims

The slice is the first ``--layers`` layers of the config, in K3's own KDA/MLA and dense/MoE
pattern (8 layers: KDA KDA KDA MLA KDA KDA KDA MLA; layer 0 dense, the rest MoE), at the
dims of one rank of ``--tp``/``--ep`` (the converter's sharding rules): local heads,
intermediates, vocabulary and experts, MXFP4 routed experts. Weights are random, made in place
on the device at the dtypes the checkpoint loader produces (bf16; fp32 router, conv, gates and
AttnRes queries; uint8 MXFP4 codes and scales); the caches are filled with random values instead
of being prefilled. The rank runs at world size 1: its all-reduces are not part of the step
(a single GPU has no peers), so every figure is the rank's own on-chip work.

Steps are built as ``ModelRunner`` builds them (``build_step``) and run through
``TorchExecutor``. Decode is reported against the bytes it must read (every weight, the
routed experts the batch's routing touches, counted from the router's choices, the KDA states
read and written, the latent cache read) at the device-to-device copy bandwidth measured in the
same run; prefill against its FLOPs at the bf16 GEMM rate measured in the same run. Decode is
timed eager (the executor) and with the whole step captured into one CUDA graph. Per-layer-kind
times (each sub-layer captured alone) extrapolate the step to all of the config's layers, at
these dims and, with ``--extrapolate-tp/--extrapolate-ep``, at a second rank shape.

``--repeat-check`` runs the same decode steps (batch 1, 8, 64), a prefill step and a mixed
prefill+decode step twice from the same caches (pools snapshot and restored) and compares the
logits and every cache pool bitwise; decode steps are also replayed from a CUDA graph and
compared with the eager step the same way.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from k3_trtllm.config import ConfigError, K3Config, parse_config  # noqa: E402
from k3_trtllm.checkpoint.errors import CheckpointError  # noqa: E402
from k3_trtllm.checkpoint.rank_layout import rank_layout_for  # noqa: E402
from k3_trtllm.model import K3Caches, K3ForCausalLM, Parallel, build_step, prepare_weights_  # noqa: E402
from k3_trtllm.model.step import is_pure_decode  # noqa: E402
from k3_trtllm.model.k3 import DecoderLayer, head_logits  # noqa: E402
from k3_trtllm.model.layers import LatentMoE  # noqa: E402
from k3_trtllm.model.parallel import gather_columns  # noqa: E402
from k3_trtllm.ops.norm import rms_norm  # noqa: E402
from k3_trtllm.ops.moe.naive import SCORING, route  # noqa: E402
from k3_trtllm.runtime.executor import TorchExecutor, pad_block_tables, padded_width  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT.parent / "shared" / "k3" / "config.json"
SGLANG_B300_TP8_TPOT_MS = 8.56  # SGLang, K3 on B300 at TP8, batch 1 (issue 20)
MEMORY_HEADROOM = 0.9  # of the device's free memory; the rest is activations and workspaces


class BenchError(Exception):
    """Bad input (config, flags) or a slice that cannot run here; printed as one line."""


# ---------------------------------------------------------------------------
# the rank
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RankShard(Parallel):
    """One rank's shapes at world size 1: ``tp_local`` splits heads, dense and shared
    intermediates and the vocabulary ``shard`` ways (as on a rank of ``--tp shard``), while
    ``tp_size`` stays 1 so the model calls no collective (a single GPU has no peers)."""

    shard: int = 1

    def tp_local(self, n: int) -> int:
        return n // self.shard


def slice_config(data: dict, layers: int, source: str) -> K3Config:
    """The config of the first ``layers`` layers (K3's own layer pattern), validated."""
    data = copy.deepcopy(data)
    text = data.get("text_config") if data.get("model_type") == "kimi_k3" else data
    if not isinstance(text, dict):
        raise BenchError(f"{source}: no text config (field `text_config`)")
    total = text.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= layers <= total:
        raise BenchError(f"--layers {layers}: expected 1 .. num_hidden_layers = {total} of {source}")
    text["num_hidden_layers"] = layers
    lac = text.get("linear_attn_config")
    if isinstance(lac, dict):
        for key in ("kda_layers", "full_attn_layers"):
            if isinstance(lac.get(key), list):
                lac[key] = [i for i in lac[key] if isinstance(i, int) and i <= layers]
    try:
        return parse_config(data, source)
    except ConfigError as e:
        raise BenchError(str(e)) from None


def rank_parallel(cfg: K3Config, tp: int, ep: int) -> RankShard:
    """Rank 0 of ``--tp/--ep`` by the converter's rules (it checks every divisibility)."""
    if tp < 1 or ep < 1:
        raise BenchError(f"--tp {tp} --ep {ep}: expected positive integers")
    try:
        layout = rank_layout_for(cfg, tp, ep, cfg.moe is not None and cfg.moe.mxfp4)
    except CheckpointError as e:
        raise BenchError(str(e).replace("\n  ", "; ")) from None
    return RankShard(tp_size=1, tp_rank=0, moe_ep_size=layout.ep, moe_ep_rank=0, moe_tp_size=layout.moe_tp,
                     moe_tp_rank=0, shard=tp)


def _fill_random_(name: str, buf: torch.Tensor) -> None:
    """Random values of the scale each tensor has in a trained model, so activations stay
    finite through the layers: unit-variance activations, weights ~ 1/sqrt(fan-in), MXFP4
    scales of 2**-8..2**-7 (uniform E2M1 codes have RMS 2.9)."""
    leaf = name.rsplit(".", 1)[-1]
    if buf.dtype == torch.uint8:
        if leaf == "weight_scale":
            buf.random_(119, 121)
        else:
            buf.random_(0, 256)
    elif leaf == "A_log":
        buf.uniform_(0.0, math.log(16.0))
    elif leaf == "dt_bias":
        buf.normal_(0.0, 0.5)
    elif leaf == "e_score_correction_bias":
        buf.normal_(0.0, 0.01)
    elif leaf in ("attention_query", "mlp_query", "query"):
        buf.normal_(0.0, 0.05)
    elif buf.dim() == 1:  # RMSNorm weights
        buf.normal_(1.0, 0.1)
    else:
        buf.normal_(0.0, buf.shape[-1] ** -0.5)


def model_bytes(cfg: K3Config, par: Parallel) -> int:
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, par)
    return sum(b.numel() * b.element_size() for b in model.buffers())


@dataclass
class PoolLayout:
    """Sequence i uses state slot i and latent blocks [i*blocks_per_seq, (i+1)*blocks_per_seq)."""

    max_seqs: int
    max_tokens_per_seq: int
    block_size: int

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_tokens_per_seq // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.max_seqs * self.blocks_per_seq

    def cache_bytes(self, cfg: K3Config, tp: int) -> int:
        return (K3Caches.bytes_per_block(cfg, self.block_size) * self.num_blocks
                + K3Caches.bytes_per_slot(cfg, torch.bfloat16, tp) * self.max_seqs)


def check_fits(need: int, device: torch.device, what: str) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if need > MEMORY_HEADROOM * free:
        raise BenchError(f"{what} needs {need / 2**30:.1f} GiB; the device has {free / 2**30:.1f} GiB free "
                         "(use fewer --layers, a larger --tp/--ep or smaller --batches/--contexts)")


def build_rank(cfg: K3Config, par: RankShard, layout: PoolLayout, device: torch.device, seed: int):
    """The model and its cache pools, random, on ``device``; checks the sizes first."""
    weights = model_bytes(cfg, par)
    check_fits(weights + layout.cache_bytes(cfg, par.shard), device,
               f"the slice ({weights / 2**30:.1f} GiB of weights + caches for {layout.max_seqs} sequences of "
               f"{layout.max_tokens_per_seq} tokens)")
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, par)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            _fill_random_(name, buf)
    caches = K3Caches.allocate(cfg, layout.num_blocks, layout.block_size, layout.max_seqs, torch.bfloat16,
                               device, tp_size=par.shard)
    fill_caches_(caches)
    return prepare_weights_(model).eval(), caches  # the kernels' layout, as a loaded model has it


def fill_caches_(caches: K3Caches) -> None:
    """Random cache contents stand in for prefilled contexts: latent rows are RMS-normalised
    c_kv (unit scale) and k_pe; recurrent states are sums of decayed k v^T outer products."""
    for t in caches.latent.values():
        t.normal_(0.0, 1.0)
    for t in caches.conv.values():
        t.normal_(0.0, 0.5)
    for t in caches.recurrent.values():
        t.normal_(0.0, 0.05)


def make_step(entries: list[tuple[int, int]], layout: PoolLayout, vocab_local: int, gen: torch.Generator):
    """A step of sequences ``(new_tokens, context_len)`` and its phase (pure decode or not),
    built and decided as ModelRunner does (on the host: the executor moves the step)."""
    seqs = []
    for i, (n, ctx) in enumerate(entries):
        if ctx + n > layout.max_tokens_per_seq or i >= layout.max_seqs:
            raise BenchError(f"sequence {i} of {ctx}+{n} tokens does not fit the pools "
                             f"({layout.max_seqs} x {layout.max_tokens_per_seq} tokens)")
        blocks = -(-(ctx + n) // layout.block_size)
        table = list(range(i * layout.blocks_per_seq, i * layout.blocks_per_seq + blocks))
        ids = torch.randint(0, vocab_local, (n,), generator=gen).tolist()
        seqs.append((ids, ctx, i, table))
    return build_step(seqs, layout.block_size), is_pure_decode(seqs)


# ---------------------------------------------------------------------------
# what a step must do: routed experts, bytes, FLOPs
# ---------------------------------------------------------------------------
def _route_ids(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """The router's top-k choices for ``x``: the CUDA router where it runs the step, else
    the reference router."""
    m = moe.moe
    args = (x, moe.router.weight, moe.router.e_score_correction_bias, m.top_k, m.num_expert_group,
            m.topk_group, SCORING[m.scoring], m.renormalize,
            m.routed_scaling_factor)
    if x.is_cuda and x.dtype == torch.bfloat16:
        from k3_trtllm.ops.moe import cuda as cuda_moe
        return cuda_moe.route(*args)[0]
    return route(*args)[0]


class RoutingRecorder:
    """Forward hooks on every MoE layer: which local experts the step's tokens chose."""

    def __init__(self, model: K3ForCausalLM):
        self.touched: dict[int, int] = {}  # layer -> distinct local experts chosen
        self.pairs: dict[int, int] = {}  # layer -> (token, local expert) choices
        self._handles = []
        for i, layer in enumerate(model.transformer.layers):
            if isinstance(layer.mlp, LatentMoE):
                self._handles.append(layer.mlp.register_forward_hook(self._hook(i)))

    def _hook(self, index: int):
        def hook(module: LatentMoE, args, _out):
            ids = _route_ids(module, args[0]).long()
            local = module.experts.w13.weight_packed.shape[0] if module.moe.mxfp4 else \
                module.experts.w13.weight.shape[0]
            mine = ids[(ids >= module.expert_offset) & (ids < module.expert_offset + local)]
            self.touched[index] = int(mine.unique().numel())
            self.pairs[index] = int(mine.numel())
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def record_routing(executor: TorchExecutor, step, decode: bool) -> RoutingRecorder:
    """Runs ``step`` once with the hooks (outside any timing) and returns the choices."""
    rec = RoutingRecorder(executor.model)
    try:
        executor.execute(step, decode)
    finally:
        rec.remove()
    return rec


def _is_expert(name: str) -> bool:
    return ".experts." in name


EMBEDDING = "transformer.vocab_embedding.weight"
LM_HEAD = "lm_head.weight"


def expert_bytes_per_layer(model: K3ForCausalLM, index: int) -> int:
    """Bytes of one local routed expert of layer ``index`` (codes and scales of w13 and w2)."""
    mlp = model.transformer.layers[index].mlp
    tensors = list(mlp.experts.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) // tensors[0].shape[0]


def decode_floor_bytes(model: K3ForCausalLM, cfg: K3Config, tp: int,
                       rec: RoutingRecorder, batch: int, context: int, distinct_tokens: int) -> dict[str, int]:
    """Bytes a decode step of ``batch`` sequences at ``context`` cached tokens must move:
    every weight once (the embedding only at the looked-up rows), the routed experts the
    routing touched, each KDA state row read and written, each latent-cache row read, the new
    latent rows written. Activations (kilobytes per token) are left out."""
    d = cfg.hidden_size
    emb = model.transformer.vocab_embedding.weight
    dense = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                if not _is_expert(n) and n != EMBEDDING)
    experts = sum(rec.touched[i] * expert_bytes_per_layer(model, i) for i in rec.touched)
    row = cfg.mla.latent_dim * 2 if cfg.mla else 0
    n_mla = len(cfg.mla_layer_indices)
    out = {
        "weights_dense": dense,
        "embedding_rows": distinct_tokens * d * emb.element_size(),
        "experts_touched": experts,
        "kda_states_read_written": 2 * batch * K3Caches.bytes_per_slot(cfg, torch.bfloat16, tp),
        "latent_read": n_mla * batch * context * row,
        "latent_written": n_mla * batch * row,
    }
    out["total"] = sum(out.values())
    return out


def floor_by_kind(model: K3ForCausalLM, cfg: K3Config, tp: int, rec: RoutingRecorder, batch: int, context: int,
                  total: int) -> dict[str, float]:
    """``decode_floor_bytes``'s total split by layer kind (mean bytes per layer of each kind,
    its norms and AttnRes queries with its attention) and the head (everything else: LM head,
    final norm, embedding rows), so the whole model's floor follows from its layer counts."""
    def nbytes(named, skip=()):
        return sum(b.numel() * b.element_size() for n, b in named if not n.startswith(skip))
    kinds: dict[str, list[int]] = {}
    state = K3Caches.bytes_per_slot(cfg, torch.bfloat16, tp) // max(1, len(cfg.kda_layer_indices))
    row = cfg.mla.latent_dim * 2 if cfg.mla else 0
    for i, layer in enumerate(model.transformer.layers):
        attention = nbytes(layer.attention.named_buffers()) + nbytes(layer.named_buffers(), ("attention.", "mlp."))
        attention += 2 * batch * state if layer.plan.attention == "kda" else batch * (context + 1) * row
        kinds.setdefault(f"{layer.plan.attention}_attention", []).append(attention)
        ffn = nbytes(layer.mlp.named_buffers(), ("experts.",))
        if layer.plan.ffn == "moe":
            ffn += rec.touched[i] * expert_bytes_per_layer(model, i)
        kinds.setdefault(f"{layer.plan.ffn}_ffn", []).append(ffn)
    out = {k: sum(v) / len(v) for k, v in kinds.items()}
    out["head"] = total - sum(sum(v) for v in kinds.values())
    return out


def prefill_flops(model: K3ForCausalLM, cfg: K3Config, entries: list[tuple[int, int]], rec: RoutingRecorder,
                  logits_rows: int) -> dict[str, int]:
    """FLOPs (2 per multiply-add) a prefill step must do: every dense product (each 2-D weight
    times every token; the LM head only for the logits rows; the embedding is a lookup), the
    routed experts for the (token, local expert) choices, MLA attention in the cheaper of its
    two exact forms (expanded: keys up-projected once; absorbed: attention over the latent),
    KDA's recurrence (3 rank-1 products of K x V per token and head). Element-wise work is left out."""
    tokens = sum(n for n, _ in entries)
    linear = sum(2 * tokens * b.numel() for n, b in model.named_buffers()
                 if b.dim() == 2 and b.is_floating_point() and not _is_expert(n) and n not in (EMBEDDING, LM_HEAD))
    head = 2 * logits_rows * model.lm_head.weight.numel()
    experts = 0
    if cfg.moe is not None:
        inter = cfg.moe.moe_intermediate_size // model.parallel.moe_tp_size
        per_expert = 3 * inter * (cfg.moe.latent_size or cfg.hidden_size)  # w1, w3 and w2
        experts = sum(2 * p * per_expert for p in rec.pairs.values())
    mla = 0
    if cfg.mla is not None:
        m = cfg.mla
        layer = next(layer for layer in model.transformer.layers if layer.plan.attention == "mla")
        h = layer.attention.num_heads
        r, dr = m.kv_lora_rank, m.qk_rope_head_dim
        per_layer = 0
        for n, ctx in entries:
            pairs = n * ctx + n * (n + 1) // 2
            expanded = 2 * h * pairs * (m.qk_head_dim + m.v_head_dim) + 2 * (ctx + n) * r * h * (
                m.qk_nope_head_dim + m.v_head_dim)
            absorbed = 2 * h * pairs * (2 * r + dr) + 2 * n * h * r * (m.qk_nope_head_dim + m.v_head_dim)
            per_layer += min(expanded, absorbed)
        mla = per_layer * len(cfg.mla_layer_indices)
    kda = 0
    if cfg.kda is not None:
        layer = next(layer for layer in model.transformer.layers if layer.plan.attention == "kda")
        kda = 6 * tokens * layer.attention.num_heads * cfg.kda.head_dim ** 2 * len(cfg.kda_layer_indices)
    out = {"dense_products": linear, "lm_head": head, "experts": experts, "mla_attention": mla, "kda_recurrence": kda}
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int, warmup: int) -> dict[str, float]:
    """Per-call times of ``fn`` after ``warmup`` calls: CUDA events around each call on a GPU
    (wall clock on CPU); median, mean, min."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "min_ms": min(times),
            "iters": iters}


def host_ms(fn, device: torch.device, iters: int) -> float:
    """Host time to issue one call (median), the device drained before each so queueing and
    syncs wait on nothing: what a step costs the CPU when the GPU is never behind."""
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(times)


def host_iters(args) -> int:
    """Calls behind each host-time median: at least 10. Three (session 17's) left the figures at the
    noise: a B128 graph replay read 0.74 ms at 2k tokens of context and 0.48 ms at 8k."""
    return max(10, args.iters)


class Graph:
    """``fn`` captured into one CUDA graph after warm-up calls on a side stream."""

    def __init__(self, fn, device: torch.device, warmup: int = 2):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.out = fn()

    def replay(self):
        self.graph.replay()
        return self.out


def graph_host_parts(executor: TorchExecutor, step, device: torch.device, iters: int) -> dict[str, float]:
    """Where a replayed decode step's host time goes (median ms, as ``host_ms``): the whole
    ``_DecodeGraph.run`` (the step copied into the pinned staging buffer, the replay, whose graph
    copies it to the device, the output clone) and the bare ``CUDAGraph.replay`` inside it; empty
    when the shape was not captured."""
    graph = executor.graphs.get((step.num_seqs, padded_width(step.block_tables.shape[1])))
    if graph is None:
        return {}
    with torch.inference_mode():  # as the executor replays: its buffers are inference tensors
        return {"run": host_ms(lambda: graph.run(step), device, iters),
                "replay": host_ms(graph.graph.replay, device, iters)}


def profile_step(fn, device: torch.device, steps: int = 3, top: int = 25) -> dict:
    """GPU kernels of ``steps`` calls of ``fn`` (torch profiler): launches and kernel time per
    call, and the ``top`` kernels by time (per call), so the report says where a step's time goes."""
    fn()
    _sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in by_name.values()) / steps
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"launches_per_step": sum(len(v) for v in by_name.values()) / steps, "kernel_us_per_step": total,
            "top_kernels": [{"name": n[:160], "us_per_step": sum(v) / steps, "launches_per_step": len(v) / steps}
                            for n, v in ranked]}


def per_layer(profile: dict, cfg: K3Config) -> dict:
    """``profile`` with its launches per decoder layer (the step's, head and embedding included,
    over the slice's layers: issue 20 asks for fewer than ~20)."""
    return {**profile, "launches_per_layer": profile["launches_per_step"] / cfg.num_hidden_layers}


def measure_copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> dict[str, float]:
    """Device-to-device copy, bytes read plus bytes written over the time (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), device, iters, 3)
    return {"bytes": nbytes, "median_ms": t["median_ms"], "GBps": 2 * nbytes / (t["median_ms"] * 1e-3) / 1e9}


def measure_gemm_peak(device: torch.device, n: int, iters: int) -> dict[str, float]:
    """bf16 n x n x n matrix product on random data (median)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t = time_ms(lambda: a @ b, device, iters, 3)
    return {"n": n, "median_ms": t["median_ms"], "TFLOPs": 2 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12}


# ---------------------------------------------------------------------------
# per-layer-kind times and the extrapolation to the whole model
# ---------------------------------------------------------------------------
def _first_layer(model: K3ForCausalLM, attention: str | None = None, ffn: str | None = None) -> DecoderLayer | None:
    for layer in model.transformer.layers:
        if (attention is None or layer.plan.attention == attention) and (ffn is None or layer.plan.ffn == ffn):
            return layer
    return None


def _head(model: K3ForCausalLM, h: torch.Tensor, step) -> torch.Tensor:
    """The step's tail as K3ForCausalLM.forward runs it: final norm of the logits rows, fp32 LM head."""
    y = rms_norm(h[step.logits_indices.long()], model.transformer.ln_f.weight, model.config.rms_norm_eps)
    return gather_columns(head_logits(y, model.lm_head.weight), model.parallel)


def layer_parts(model: K3ForCausalLM, caches: K3Caches, step) -> dict[str, callable]:
    """One callable per layer kind's sub-layer (the first such layer of the slice), on
    unit-scale normalised inputs, plus the head."""
    d, t = model.config.hidden_size, step.num_tokens
    x = torch.randn(t, d, device=step.input_ids.device, dtype=torch.bfloat16)
    parts = {}

    def infer(fn):
        def run():
            with torch.inference_mode():
                return fn()
        return run
    for kind in ("kda", "mla"):
        layer = _first_layer(model, attention=kind)
        if layer is not None:
            parts[f"{kind}_attention"] = infer(lambda a=layer.attention: a(x, step, caches, True))
    for kind in ("dense", "moe"):
        layer = _first_layer(model, ffn=kind)
        if layer is not None:
            parts[f"{kind}_ffn"] = infer(lambda m=layer.mlp: m(x))
    parts["head"] = infer(lambda: _head(model, x, step))
    return parts


def layer_counts(cfg: K3Config) -> dict[str, int]:
    plans = cfg.layers
    return {"kda_attention": sum(p.attention == "kda" for p in plans),
            "mla_attention": sum(p.attention == "mla" for p in plans),
            "dense_ffn": sum(p.ffn == "dense" for p in plans), "moe_ffn": sum(p.ffn == "moe" for p in plans),
            "layers": len(plans)}


def extrapolate(parts_ms: dict[str, float], step_ms: float, slice_counts: dict[str, int],
                full_counts: dict[str, int], parts_floor_ms: dict[str, float] | None = None) -> dict[str, float]:
    """step(L layers) = head + sum over layers of (attention + FFN of its kind) + L * rest, where
    ``rest`` (AttnRes mixes, norms, residual adds, embedding) is what the measured slice step
    leaves over its parts, per layer. The same model at ``full_counts`` gives the whole model."""
    kinds = ("kda_attention", "mla_attention", "dense_ffn", "moe_ffn")
    sub = sum(slice_counts[k] * parts_ms.get(k, 0.0) for k in kinds)
    rest = (step_ms - parts_ms["head"] - sub) / slice_counts["layers"]
    total = parts_ms["head"] + sum(full_counts[k] * parts_ms.get(k, 0.0) for k in kinds) + full_counts["layers"] * rest
    out = {"rest_per_layer_ms": rest, "whole_model_ms": total, "layers": full_counts["layers"]}
    if parts_floor_ms is not None:  # kinds the slice lacks (none for K3's first 4+ layers) count 0
        floor = parts_floor_ms["head"] + sum(full_counts[k] * parts_floor_ms.get(k, 0.0) for k in kinds)
        out.update(whole_model_floor_ms=floor, pct_of_floor=100 * floor / total)
    return out


# ---------------------------------------------------------------------------
# repeat check: the same step twice from the same caches, bitwise
# ---------------------------------------------------------------------------
def pool_tensors(caches: K3Caches) -> dict[str, torch.Tensor]:
    out = {f"latent[{i}]": t for i, t in caches.latent.items()}
    out.update({f"conv[{i}]": t for i, t in caches.conv.items()})
    out.update({f"recurrent[{i}]": t for i, t in caches.recurrent.items()})
    return out


def snapshot(caches: K3Caches) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in pool_tensors(caches).items()}


def restore(caches: K3Caches, snap: dict[str, torch.Tensor]) -> None:
    for k, t in pool_tensors(caches).items():
        t.copy_(snap[k])


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[dict]:
    """Every tensor of ``a`` whose bits differ from ``b``'s: how many elements and by how much
    (NaN bits count as differing when they differ)."""
    out = []
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append({"tensor": name, "error": f"{tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"})
            continue
        bits = _BITS.get(x.element_size())
        differ = (x.view(bits) != y.view(bits)) if bits is not None else (x != y)
        count = int(differ.sum())
        if count:
            delta = (x.double() - y.double()).abs()[differ]
            scale = torch.maximum(x.double().abs(), y.double().abs())[differ]
            out.append({"tensor": name, "elements_differing": count, "elements": x.numel(),
                        "max_abs_diff": float(delta.nan_to_num(nan=float("inf")).max()),
                        "max_abs_value": float(x.double().abs().max()),
                        "max_rel_diff": float((delta / scale.clamp_min(1e-30)).nan_to_num(nan=float("inf")).max())})
    return out


def repeat_case(executor: TorchExecutor, caches: K3Caches, step, decode: bool,
                graph_executor: TorchExecutor | None = None) -> dict:
    """Runs ``step`` twice from the same caches through the (eager) executor and compares
    the two runs bitwise. With ``graph_executor`` (a decode step on a GPU) it also runs the
    step as a CUDA-graph replay (the executor's first call of a shape captures, the second
    replays) and compares that with the eager step at the same padded block-table width, and
    the padded eager step with the unpadded one. Leaves the caches as it found them."""
    before = snapshot(caches)
    first = {"logits": executor.execute(step, decode).clone(), **snapshot(caches)}
    restore(caches, before)
    second = {"logits": executor.execute(step, decode), **pool_tensors(caches)}
    result = {"tokens": step.num_tokens, "seqs": step.num_seqs, "repeat_diffs": bitwise_diffs(first, second)}
    if graph_executor is not None:
        padded = pad_block_tables(step, padded_width(step.block_tables.shape[1]))
        restore(caches, before)
        eager_padded = {"logits": executor.execute(padded, decode).clone(), **snapshot(caches)}
        restore(caches, before)
        graph_executor.execute(step, decode)  # eager + capture
        restore(caches, before)
        replays = graph_executor.graph_replays
        replayed = {"logits": graph_executor.execute(step, decode), **pool_tensors(caches)}
        if graph_executor.graph_replays != replays + 1:
            raise BenchError("the graph executor did not replay a graph for a decode step")
        result["graph_vs_eager_diffs"] = bitwise_diffs(eager_padded, replayed)
        result["padded_vs_unpadded_eager_diffs"] = bitwise_diffs(first, eager_padded)
    restore(caches, before)
    return result


def describe_diffs(diffs: list[dict]) -> str:
    if not diffs:
        return "bitwise equal"
    parts = [f"{d['tensor']} ({d['elements_differing']}/{d['elements']} differ, max |d| {d['max_abs_diff']:.3g} "
             f"of {d['max_abs_value']:.3g})" if "error" not in d else f"{d['tensor']} ({d['error']})" for d in diffs]
    return f"{len(diffs)} tensors differ: " + ", ".join(parts)


def run_repeat_check(cfg, par, device, args) -> dict:
    ctx = args.repeat_context
    batches = args.repeat_batches
    prefill_n = args.repeat_prefill_tokens
    mixed = [(1, ctx)] * 7 + [(prefill_n, 0)]  # seven decodes beside one prefill chunk
    cases = {f"decode_b{b}": [(1, ctx)] * b for b in batches}
    cases["prefill"] = [(prefill_n, 0)]
    cases["mixed_prefill_decode"] = mixed
    layout = PoolLayout(max(len(e) for e in cases.values()), ctx + prefill_n + 1, args.block_size)
    model, caches = build_rank(cfg, par, layout, device, args.seed)
    executor = TorchExecutor(model, caches, device, cuda_graphs=False)
    graphs = not args.no_graph and device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    report = {}
    for name, entries in cases.items():
        step, decode = make_step(entries, layout, par.tp_local(cfg.vocab_size), gen)
        executor.execute(step, decode)  # warm-up (kernel load, workspaces)
        graph_executor = TorchExecutor(model, caches, device, cuda_graphs=True) if graphs and decode else None
        report[name] = repeat_case(executor, caches, step, decode, graph_executor)
        del graph_executor
        line = (f"repeat-check {name:22s} ({step.num_tokens} tokens): "
                f"repeat: {describe_diffs(report[name]['repeat_diffs'])}")
        if "graph_vs_eager_diffs" in report[name]:
            line += (f"; graph vs eager (same padded tables): {describe_diffs(report[name]['graph_vs_eager_diffs'])}"
                     f"; padded vs unpadded eager: {describe_diffs(report[name]['padded_vs_unpadded_eager_diffs'])}")
        print(line, flush=True)
    equal = all(not r["repeat_diffs"] and not r.get("graph_vs_eager_diffs") for r in report.values())
    print("REPEAT-CHECK:", "ALL BITWISE EQUAL" if equal else "DIFFERENCES FOUND", flush=True)
    return {"all_equal": equal, "context": ctx, "cases": report}


# ---------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------
def decode_case(executor, caches, model, cfg, par, layout, batch, ctx, copy_bw, gen, args) -> dict:
    """One decode step: floor, eager executor, the executor's CUDA-graph path, per-kind parts."""
    device = executor.device
    step, decode = make_step([(1, ctx)] * batch, layout, par.tp_local(cfg.vocab_size), gen)
    rec = record_routing(executor, step, decode)
    floor = decode_floor_bytes(model, cfg, par.shard, rec, batch, ctx,
                               int(step.input_ids.unique().numel()))
    floor_ms = floor["total"] / (copy_bw * 1e9) * 1e3
    kinds = floor_by_kind(model, cfg, par.shard, rec, batch, ctx, floor["total"])
    eager = time_ms(lambda: executor.execute(step, decode), device, args.iters, args.warmup)
    out = {"batch": batch, "context": ctx, "floor_bytes": floor, "floor_ms": floor_ms,
           "parts_floor_ms": {k: v / (copy_bw * 1e9) * 1e3 for k, v in kinds.items()},
           "experts_touched_per_moe_layer": rec.touched, "eager": eager,
           "eager_pct_of_floor": 100 * floor_ms / eager["median_ms"],
           "host_ms_eager": host_ms(lambda: executor.execute(step, decode), device, host_iters(args))}
    profiled = device.type == "cuda" and batch in args.profile_batches and ctx == args.contexts[0]
    if profiled:
        out["profile_eager"] = per_layer(profile_step(lambda: executor.execute(step, decode), device), cfg)
    parts = layer_parts(model, caches, step.to(device))
    out["parts_eager_ms"] = {k: time_ms(fn, device, args.iters, args.warmup)["median_ms"] for k, fn in parts.items()}
    if device.type == "cuda" and not args.no_graph:
        graph_executor = TorchExecutor(model, caches, device, cuda_graphs=True)
        out["graph"] = time_ms(lambda: graph_executor.execute(step, decode), device, args.iters, max(2, args.warmup))
        out["graph_pct_of_floor"] = 100 * floor_ms / out["graph"]["median_ms"]
        out["host_ms_graph"] = host_ms(lambda: graph_executor.execute(step, decode), device, host_iters(args))
        out["host_ms_graph_parts"] = graph_host_parts(graph_executor, step, device, host_iters(args))
        out["graph_replays"] = graph_executor.graph_replays
        if profiled:
            out["profile_graph"] = per_layer(profile_step(lambda: graph_executor.execute(step, decode), device), cfg)
        del graph_executor
        graphs = {k: Graph(fn, device) for k, fn in parts.items()}
        out["parts_graph_ms"] = {k: time_ms(g.replay, device, args.iters, args.warmup)["median_ms"]
                                 for k, g in graphs.items()}
        del graphs
    return out


def prefill_case(executor, model, cfg, par, layout, entries, peak_tflops, gen, args) -> dict:
    device = executor.device
    step, decode = make_step(entries, layout, par.tp_local(cfg.vocab_size), gen)
    rec = record_routing(executor, step, decode)
    if device.type == "cuda" and entries == [(args.prefill_tokens, 0)]:
        profile = profile_step(lambda: executor.execute(step, decode), device, steps=1)
    else:
        profile = None
    flops = prefill_flops(model, cfg, entries, rec, step.num_seqs)
    t = time_ms(lambda: executor.execute(step, decode), device, args.prefill_iters, 1)
    floor_ms = flops["total"] / (peak_tflops * 1e12) * 1e3
    return {"batch": len(entries), "new_tokens_per_seq": entries[0][0], "context": entries[0][1],
            "tokens": step.num_tokens, "flops": flops, "floor_ms": floor_ms, "eager": t,
            "pct_of_peak": 100 * floor_ms / t["median_ms"],
            "TFLOPs": flops["total"] / (t["median_ms"] * 1e-3) / 1e12, **({"profile": profile} if profile else {})}


def slice_description(cfg: K3Config, par: RankShard, tp: int, ep: int) -> dict:
    kinds = [f"{p.attention}/{p.ffn}" for p in cfg.layers]
    moe = cfg.moe.num_experts if cfg.moe else 0
    return {"tp": tp, "ep": ep, "layers": cfg.num_hidden_layers, "layer_kinds": kinds,
            "layer_pattern": f"K3's first {cfg.num_hidden_layers} layers", "moe_tp": par.moe_tp_size,
            "local_heads_mla": cfg.mla.num_heads // tp if cfg.mla else 0,
            "local_heads_kda": cfg.kda.num_heads // tp if cfg.kda else 0,
            "local_experts": moe // ep if moe else 0, "vocab_local": cfg.vocab_size // tp,
            "hidden": cfg.hidden_size, "collectives": "none (world size 1: the rank's all-reduces are not timed)"}


def run_bench(data: dict, source: str, device: torch.device, args) -> dict:
    cfg = slice_config(data, args.layers, source)
    full = slice_config(data, _num_layers(data), source)
    par = rank_parallel(cfg, args.tp, args.ep)
    on_gpu = device.type == "cuda"
    report = {"meta": meta(device, args, source), "slice": slice_description(cfg, par, args.tp, args.ep)}
    copy_bytes = args.copy_mib * 2 ** 20
    report["copy_bandwidth"] = measure_copy_bandwidth(device, copy_bytes, 20 if on_gpu else 3)
    report["gemm_peak"] = measure_gemm_peak(device, args.gemm_n, 10 if on_gpu else 2)
    bw, peak = report["copy_bandwidth"]["GBps"], report["gemm_peak"]["TFLOPs"]
    print(f"copy {bw:.0f} GB/s, bf16 GEMM {peak:.0f} TFLOP/s", flush=True)
    if on_gpu:
        torch.cuda.empty_cache()  # the sizing check reads the device's free memory
    max_ctx = max(args.contexts + [0])
    layout = PoolLayout(max(args.batches), max_ctx + max(args.prefill_tokens, 1) + 1, args.block_size)
    model, caches = build_rank(cfg, par, layout, device, args.seed)
    executor = TorchExecutor(model, caches, device, cuda_graphs=False)
    gen = torch.Generator().manual_seed(args.seed)
    counts, full_counts = layer_counts(cfg), layer_counts(full)
    report["decode"] = []
    for ctx in args.contexts:
        for b in args.batches:
            r = decode_case(executor, caches, model, cfg, par, layout, b, ctx, bw, gen, args)
            _add_extrapolations(r, counts, full_counts)
            report["decode"].append(r)
            print(_decode_line(r), flush=True)
    report["prefill"] = []
    if args.prefill_tokens:
        cases = [[(args.prefill_tokens, 0)]]
        cases += [[(max(1, args.prefill_tokens // b), ctx)] * b for ctx in args.contexts for b in args.batches]
        for entries in cases:
            r = prefill_case(executor, model, cfg, par, layout, entries, peak, gen, args)
            report["prefill"].append(r)
            print(_prefill_line(r), flush=True)
    del executor, model, caches
    if on_gpu:
        torch.cuda.empty_cache()
    if args.extrapolate_tp:
        report["extrapolation_rank"] = extrapolation_rank(data, source, device, args, bw, full_counts)
    return report


def _add_extrapolations(r: dict, counts: dict[str, int], full_counts: dict[str, int]) -> None:
    """A decode case's eager (and, when captured, graph) step extrapolated to the whole model."""
    for mode in ("eager", "graph"):
        if mode in r:
            r[f"extrapolated_{mode}"] = extrapolate(r[f"parts_{mode}_ms"], r[mode]["median_ms"], counts, full_counts,
                                                    r["parts_floor_ms"])


def extrapolation_rank(data, source, device, args, copy_bw, full_counts) -> dict:
    """A second slice at ``--extrapolate-tp/--extrapolate-ep`` dims: batch-1 decode per layer
    kind, extrapolated to the whole model (TPOT without the collectives)."""
    tp, ep = args.extrapolate_tp, args.extrapolate_ep
    cfg = slice_config(data, args.layers, source)
    par = rank_parallel(cfg, tp, ep)
    layout = PoolLayout(1, max(args.contexts + [0]) + 2, args.block_size)
    model, caches = build_rank(cfg, par, layout, device, args.seed)
    executor = TorchExecutor(model, caches, device, cuda_graphs=False)
    gen = torch.Generator().manual_seed(args.seed)
    out = {"slice": slice_description(cfg, par, tp, ep), "batch_1": [],
           "published": {"sglang_b300_tp8_batch1_tpot_ms": SGLANG_B300_TP8_TPOT_MS}}
    counts = layer_counts(cfg)
    for ctx in args.contexts:
        r = decode_case(executor, caches, model, cfg, par, layout, 1, ctx, copy_bw, gen, args)
        _add_extrapolations(r, counts, full_counts)
        out["batch_1"].append(r)
        print(f"TP{tp}/EP{ep} " + _decode_line(r), flush=True)
    del executor, model, caches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _num_layers(data: dict) -> int:
    text = data.get("text_config") if data.get("model_type") == "kimi_k3" else data
    n = text.get("num_hidden_layers") if isinstance(text, dict) else None
    if not isinstance(n, int) or n < 1:
        raise BenchError("config: field `num_hidden_layers` missing or not a positive integer")
    return n


def _decode_line(r: dict) -> str:
    s = (f"decode B={r['batch']:4d} ctx={r['context']:6d}: floor {r['floor_ms']:7.3f} ms, eager "
         f"{r['eager']['median_ms']:7.3f} ms ({r['eager_pct_of_floor']:5.1f}%), host {r['host_ms_eager']:6.2f} ms")
    if "graph" in r:
        s += f", graph {r['graph']['median_ms']:7.3f} ms ({r['graph_pct_of_floor']:5.1f}%)"
        s += f"; {r['extrapolated_graph']['layers']} layers (graph) {r['extrapolated_graph']['whole_model_ms']:.2f} ms"
    return s


def _prefill_line(r: dict) -> str:
    return (f"prefill B={r['batch']:4d} x {r['new_tokens_per_seq']:5d} tokens ctx={r['context']:6d}: "
            f"floor {r['floor_ms']:8.3f} ms, eager {r['eager']['median_ms']:8.3f} ms ({r['pct_of_peak']:5.1f}% of "
            f"peak, {r['TFLOPs']:.0f} TFLOP/s)")


def commit_id() -> str:
    """The commit a result was measured at: ``K3_COMMIT`` when set (a device copy has no git
    history), else the checkout's HEAD, else "unknown"."""
    commit = os.environ.get("K3_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                    timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    return commit or "unknown"


def meta(device: torch.device, args, source: str) -> dict:
    return {"commit": commit_id(),
            "tree": os.environ.get("K3_TREE", "working tree as sent (may hold uncommitted changes)"),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "config": source,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "command": " ".join(sys.argv)}


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        self.exit(2, f"rank_slice.py: {message}\n")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {minimum}")
        return v
    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def parse_args(argv=None):
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="K3 config.json (default ../shared/k3/config.json)")
    p.add_argument("--tp", type=_positive, default=8)
    p.add_argument("--ep", type=_positive, default=8)
    p.add_argument("--layers", type=_positive, default=8, help="the config's first N layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=_int_list, default=[1, 8, 32, 128])
    p.add_argument("--contexts", type=_int_list, default=[2048, 8192])
    p.add_argument("--prefill-tokens", type=_non_negative, default=4096,
                   help="tokens of each prefill step, split over each batch (0: no prefill)")
    p.add_argument("--block-size", type=_positive, default=64)
    p.add_argument("--iters", type=_positive, default=20)
    p.add_argument("--warmup", type=_non_negative, default=3)
    p.add_argument("--prefill-iters", type=_positive, default=3)
    p.add_argument("--copy-mib", type=_positive, default=2048, help="size of the bandwidth copy")
    p.add_argument("--gemm-n", type=_positive, default=8192, help="size of the peak-rate GEMM")
    p.add_argument("--extrapolate-tp", type=_non_negative, default=16, help="0: no second rank shape")
    p.add_argument("--extrapolate-ep", type=_positive, default=16)
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph timing or comparison")
    p.add_argument("--profile-batches", type=_int_list, default=[1, 32],
                   help="decode batches profiled (kernels by time) at the first context, on a GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-invariant", action="store_true",
                   help="run with k3_trtllm.ops.batch_invariant on (issue 23's mode), to time its cost")
    p.add_argument("--repeat-check", action="store_true",
                   help="run each step twice from the same caches and compare bitwise (no timing)")
    p.add_argument("--repeat-batches", type=_int_list, default=[1, 8, 64])
    p.add_argument("--repeat-context", type=_positive, default=2048)
    p.add_argument("--repeat-prefill-tokens", type=_positive, default=512)
    p.add_argument("--out", help="JSON report (written whole or not at all)")
    return p.parse_args(argv)


def write_json(path: str, report: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise



def read_config_json(path: Path) -> dict:
    """``--config``: the HF config.json the slice takes its dims from, as a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"--config {path}: {e}") from None
    if not isinstance(data, dict):
        raise BenchError(f"--config {path}: expected a JSON object")
    return data


def bench_device(name: str) -> torch.device:
    """``--device``: cpu, or cuda with the kernel library installed (without it the slice would
    time the fp32 reference ops, which says nothing about the kernels)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BenchError(f"--device {name}: expected cpu or cuda") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BenchError(f"--device {name}: CUDA is not available")
        from k3_trtllm.ops.cuda_library import library_path, register_cuda_kernels
        if not register_cuda_kernels():
            raise BenchError(f"{library_path()} not built (build_scripts/build_kernels.sh): the slice would "
                             "run the fp32 reference ops")
    elif device.type != "cpu":
        raise BenchError(f"--device {name}: expected cpu or cuda")
    return device


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = bench_device(args.device)
        if args.batch_invariant:
            try:
                from k3_trtllm.ops.batch_invariant import set_batch_invariant
            except ImportError as e:
                raise BenchError(f"--batch-invariant: {e}") from None
            set_batch_invariant(True)
        path = Path(args.config)
        data = read_config_json(path)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if args.repeat_check:
                cfg = slice_config(data, args.layers, str(path))
                par = rank_parallel(cfg, args.tp, args.ep)
                report = {"meta": meta(device, args, str(path)),
                          "slice": slice_description(cfg, par, args.tp, args.ep),
                          "repeat_check": run_repeat_check(cfg, par, device, args)}
            else:
                report = run_bench(data, str(path), device, args)
        # a kernel falling back to the reference op would make every figure meaningless: say so
        report["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in seen})
        for w in report["warnings"]:
            print("warning:", w, file=sys.stderr)
    except BenchError as e:
        print(f"rank_slice.py: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
