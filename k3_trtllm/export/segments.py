"""The step graph cut into segments (DESIGN §10): one ONNX graph per segment *kind*, every
weight a graph input, exported once however many layers and ranks use it.

Kinds, in the order a step runs them (the runtime, ``trt/engine_executor.py``, does the
collectives between them):

- ``embed``: the rank's vocabulary rows (``vocab_start`` is an input) -> all-reduce;
- ``kda_attention`` / ``mla_attention``: AttnRes mix of the visible blocks and the partial
  sum -> RMSNorm -> the attention op over its layer's cache pools -> the row-parallel
  ``dense`` partial product -> all-reduce;
- ``dense_mlp``: mix -> RMSNorm -> the MLP's partial product -> all-reduce;
- ``moe``: mix -> RMSNorm -> latent down-projection, router and this rank's experts
  (``expert_offset`` is an input) and the shared-expert slice; the routed and the shared
  partial sums leave as one tensor ``[T, L + D]`` so that one all-reduce adds both;
- ``moe_combine``: the summed routed part through the latent norm and ``latent_up``, plus
  the shared part (the latent norm needs the whole routed sum, hence its own segment);
- ``head``: the final mix of the rows that want logits -> ``ln_f`` -> this rank's
  ``lm_head`` rows -> all-gather of the vocab shards.

The AttnRes blocks are one stacked input ``[num_attn_res_blocks, T, d]`` whose first
dim is dynamic (0 for the first layer's attention), so a kind's graph serves every
layer. The segments call the model's own sub-layer modules (``model/layers.py``) with
the weights swapped for graph inputs (``torch.func.functional_call``); only the glue the
model keeps inline (the mix over a stacked tensor, the split MoE, embedding and head with
tensor offsets) is written here, and tests compare the segments against the model.

The graphs depend on the config and the *world* (local head counts are plugin
attributes), not on the rank: everything rank-specific is an input. They are traced on
meta tensors, so exporting K3 reads no weights and holds none in memory."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch
from torch import nn
from torch.export import Dim
from torch.func import functional_call
from torch.nn.functional import embedding, linear

from ..config import K3Config
from ..checkpoint.errors import CheckpointError
from ..checkpoint.rank_layout import rank_layout_for
from ..model.caches import K3Caches
from ..model.k3 import K3ForCausalLM
from ..model.parallel import Parallel
from ..model.step import StepInputs
from ..ops import attn_res
from ..ops import contract as C
from ..ops.common import compute_dtype, rms_norm
from ..ops.moe.naive import SCORING
from ..ops.registry import call
from .engine_io import (LOGITS, MAX_BLOCKS, MAX_SLOTS, NUM_BLOCKS, SEQS, SEQS_PLUS_1, SNAPSHOT_POINTS, SNAPSHOT_SLOTS,
                        TOKENS, latent_pool_type, pool_dtype)
from .exporter import OPSET, _retype_byte_graph_io, _strip_metadata
from .schemas import DOMAIN, DOMAIN_VERSION, register_schemas
from .translations import translation_table

ATTN_BLOCKS = "num_attn_res_blocks"
KINDS = ("embed", "kda_attention", "mla_attention", "dense_mlp", "moe", "moe_combine", "head")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float64: "float64", torch.int32: "int32", torch.int8: "int8", torch.uint8: "uint8"}
DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}

# Sample sizes of the dynamic dims while tracing: all different from each other and from
# 0/1, which torch.export would specialise or unify (see exporter._sample_inputs).
_SAMPLE = {TOKENS: 7, SEQS: 3, SEQS_PLUS_1: 4, LOGITS: 2, MAX_BLOCKS: 5, NUM_BLOCKS: 11, MAX_SLOTS: 6,
           ATTN_BLOCKS: 9, SNAPSHOT_POINTS: 8, SNAPSHOT_SLOTS: 10}


class SegmentError(ValueError):
    """A config or world the segments cannot express; names the field."""


@dataclass(frozen=True)
class World:
    """The mapping an engine is built for (TensorRT-LLM's, as ``k3-trt convert`` writes it)."""

    tp: int = 1
    ep: int = 1

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def parallel(self, rank: int = 0) -> Parallel:
        return Parallel(self.tp, rank, self.ep, rank % self.ep, self.moe_tp, rank // self.ep)

    def mapping_json(self) -> dict:
        return {"world_size": self.tp, "tp_size": self.tp, "moe_tp_size": self.moe_tp, "moe_ep_size": self.ep}

    def validate(self, cfg: K3Config) -> None:
        """The converter's rules for this world (``checkpoint.rank_layout.rank_layout_for``): an engine
        can be built exactly for the worlds a checkpoint can be converted to."""
        if self.tp < 1 or self.ep < 1:
            raise SegmentError(f"tp ({self.tp}) and ep ({self.ep}) must be positive")
        try:
            rank_layout_for(cfg, self.tp, self.ep, cfg.moe is not None and cfg.moe.mxfp4)
        except CheckpointError as e:  # it lists one violated dimension per line; errors here are one line
            raise SegmentError(" ".join(line.strip() for line in str(e).splitlines())) from e
        groups = cfg.moe.num_expert_group or 1 if cfg.moe is not None else 1
        if groups > 1:
            # the expert offset rolls the router's rows (MoeSegment); that keeps the expert
            # groups whole only when every rank's offset starts a group
            per_group, per_rank = cfg.moe.num_experts // groups, cfg.moe.num_experts // self.ep
            if per_rank % per_group:
                raise SegmentError(f"num_expert_group {groups}: {per_rank} experts per EP rank do not start on "
                                   f"group boundaries ({per_group} experts per group)")


@dataclass(frozen=True)
class SegmentIO:
    name: str
    dtype: torch.dtype
    shape: tuple[int | str, ...]  # ints are fixed by config and world, strings are dynamic dims
    role: str  # "step" | "stream" (between segments) | "weight" | "pool" | "rank" (offsets of the rank)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": _DTYPE_NAMES[self.dtype], "shape": list(self.shape), "role": self.role}


@dataclass(frozen=True)
class SegmentSpec:
    kind: str
    inputs: tuple[SegmentIO, ...]
    outputs: tuple[SegmentIO, ...]
    blocks: tuple[int, int] | None = None  # (fewest, most) AttnRes blocks among its layers
    aliases: dict = field(default_factory=dict)  # pool input -> its updated output

    @property
    def weights(self) -> tuple[SegmentIO, ...]:
        return tuple(t for t in self.inputs if t.role == "weight")

    def to_json(self) -> dict:
        return {"kind": self.kind, "inputs": [t.to_json() for t in self.inputs],
                "outputs": [t.to_json() for t in self.outputs], "aliases": dict(self.aliases),
                "attn_res_blocks": list(self.blocks) if self.blocks else None}


def weight_dtype(stored: torch.dtype, act: torch.dtype) -> torch.dtype:
    """The engine's type of a checkpoint tensor: the rule ``model_from_state_dict`` applies
    (bf16 -> the activation dtype, fp32 -> its compute dtype); MXFP4 bytes are bound as
    INT8 views (``schemas.BYTES_ONNX_TYPE``: TensorRT-RTX widens UINT8 to INT32)."""
    if stored == torch.bfloat16:
        return act
    if stored == torch.float32:
        return compute_dtype(act)
    return torch.int8 if stored == torch.uint8 else stored


def rank_model(cfg: K3Config, world: World) -> K3ForCausalLM:
    """Rank 0's module tree on the meta device: names, local shapes and checkpoint dtypes of
    every weight, no memory. Its sub-layers compute partial products (``_partials_only``)."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, world.parallel(0))
    for module in model.modules():
        if isinstance(getattr(module, "par", None), Parallel):
            # the layers' only use of ``par`` after construction is the all-reduce closing a
            # row-parallel product; a segment ends there, the runtime does the collective
            module.par = Parallel()
    return model


# ---------------------------------------------------------------------------------------
# The segment modules: forward(*flat inputs in SegmentSpec order) -> flat outputs.
# ---------------------------------------------------------------------------------------
def mix_stacked(blocks: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """``attn_res.mix(list(blocks) + [partial], query, eps)`` over a stacked ``[S, T, d]``
    block tensor (S may be 0: then exactly ``partial`` in the compute dtype), fp32 out."""
    sources = torch.cat([blocks, partial.unsqueeze(0)], 0)
    weights = torch.softmax(attn_res.source_logits(sources, query, eps), 0)
    return (weights.unsqueeze(-1) * sources.to(compute_dtype(sources.dtype))).sum(0)


def _weights(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}{n}": b for n, b in module.named_buffers()}


class _Segment(nn.Module):
    """Holds the names of its flat inputs; ``self.args(tensors)`` maps them back."""

    def __init__(self, names: list[str]):
        super().__init__()
        self.names = names

    def args(self, tensors) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, tensors))


class _Mixed(_Segment):
    """A layer segment whose input is the AttnRes mix (or the plain residual)."""

    def __init__(self, names, attn_res_on: bool, query: str, norm: str, eps: float, act: torch.dtype):
        super().__init__(names)
        self.attn_res_on, self.query, self.norm, self.eps, self.act = attn_res_on, query, norm, eps, act

    def normed_input(self, a: dict[str, torch.Tensor]) -> torch.Tensor:
        h = mix_stacked(a["blocks"], a["partial"], a[self.query], self.eps) if self.attn_res_on else a["partial"]
        return rms_norm(h, a[self.norm], self.eps).to(self.act)


class AttentionSegment(_Mixed):
    def __init__(self, names, layer, attn_res_on, eps, act, pools: tuple[str, ...]):
        super().__init__(names, attn_res_on, "attn_res.attention_query", "input_layernorm.weight", eps, act)
        self.attention, self.pools = layer.attention, pools
        self.kda = pools[0] == "conv_state"

    def forward(self, *tensors):
        a = self.args(tensors)
        x = self.normed_input(a)
        fields = {f: a.get(f) for f in StepInputs.__dataclass_fields__}
        step = StepInputs(**fields)
        i = self.attention.layer
        if self.kda:
            caches = K3Caches({}, {i: a["conv_state"]}, {i: a["recurrent_state"]}, 0,
                              {i: a["snapshot_conv"]}, {i: a["snapshot_recurrent"]})
        else:
            caches = K3Caches({i: a["latent_cache"]}, {}, {}, a["latent_cache"].shape[1])
        weights = {n.removeprefix("attention."): t for n, t in a.items() if n.startswith("attention.")}
        out = functional_call(self.attention, weights, (x, step, caches, False))
        # the pools were written in place by the ops' export twins; returning them is what
        # makes the updates graph outputs (DESIGN §9)
        return (out, *(a[p] for p in self.pools))


class DenseMlpSegment(_Mixed):
    def __init__(self, names, layer, attn_res_on, eps, act):
        super().__init__(names, attn_res_on, "attn_res.mlp_query", "post_layernorm.weight", eps, act)
        self.mlp = layer.mlp

    def forward(self, *tensors):
        a = self.args(tensors)
        weights = {n.removeprefix("mlp."): t for n, t in a.items() if n.startswith("mlp.")}
        return functional_call(self.mlp, weights, (self.normed_input(a),))


class MoeSegment(_Mixed):
    """LatentMoE.forward up to its all-reduce, with the expert offset as an input: the
    router's rows are rolled by ``expert_offset`` so that this rank's experts are the
    op's experts 0..El-1 (the op's ``expert_offset`` attribute stays 0, so one plan
    serves every EP rank). Top-k, renormalisation and the combine are permutation-
    invariant over experts; the expert groups stay whole (``World.validate``)."""

    def __init__(self, names, layer, cfg: K3Config, attn_res_on, act):
        super().__init__(names, attn_res_on, "attn_res.mlp_query", "post_layernorm.weight", cfg.rms_norm_eps, act)
        self.moe, self.cfg = layer.mlp, cfg

    def forward(self, *tensors):
        a = self.args(tensors)
        moe, cfg, m = self.moe, self.cfg, self.cfg.moe
        x = self.normed_input(a)
        z = linear(x, a["mlp.latent_down.weight"]) if m.latent_size else x
        rows = (torch.arange(m.num_experts, device=x.device) + a["expert_offset"].long()) % m.num_experts
        router, bias = a["mlp.router.weight"][rows], a["mlp.router.e_score_correction_bias"][rows]
        attrs = (m.num_experts, m.top_k, m.num_expert_group, m.topk_group, 0,
                 SCORING[m.scoring], int(m.renormalize), m.routed_scaling_factor,
                 cfg.activation_id, cfg.situ_beta, cfg.situ_linear_beta or 0.0)
        if m.mxfp4:
            experts = [a[f"mlp.experts.{w}.{p}"] for w in ("w13", "w2") for p in ("weight_packed", "weight_scale")]
            r = call(C.SITU_MOE_MXFP4, x, z, router, bias, *experts, *attrs)
        else:
            r = call(C.SITU_MOE, x, z, router, bias, a["mlp.experts.w13.weight"], a["mlp.experts.w2.weight"], *attrs)
        if not m.num_shared_experts:
            return r
        shared = {n.removeprefix("mlp.shared_experts."): t for n, t in a.items()
                  if n.startswith("mlp.shared_experts.")}
        return torch.cat([r, functional_call(moe.shared_experts, shared, (x,))], -1)


class MoeCombineSegment(_Segment):
    """The rest of LatentMoE.forward once the routed (and shared) sums are whole."""

    def __init__(self, names, cfg: K3Config, routed: int):
        super().__init__(names)
        self.cfg, self.routed = cfg, routed

    def forward(self, *tensors):
        a = self.args(tensors)
        m, eps = self.cfg.moe, self.cfg.rms_norm_eps
        reduced = a["moe_partial"]
        r, shared = reduced[:, : self.routed], reduced[:, self.routed:]
        if m.latent_size:
            if m.latent_norm:
                r = rms_norm(r, a["mlp.latent_norm.weight"], eps)
            r = linear(r, a["mlp.latent_up.weight"])
        return r + shared if m.num_shared_experts else r


class EmbedSegment(_Segment):
    """``parallel.embed`` with the rank's first row as an input: ids outside the rank's
    rows give zero rows, and the all-reduce adds the one non-zero row of each token."""

    def forward(self, *tensors):
        a = self.args(tensors)
        weight = a["transformer.vocab_embedding.weight"]
        local = a["input_ids"].long() - a["vocab_start"].long()
        outside = (local < 0) | (local >= weight.shape[0])
        return embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[:, None], 0)


class HeadSegment(_Segment):
    """K3ForCausalLM.forward's tail over the rows that want logits (the mix is per token,
    so selecting the rows first gives the same values): this rank's vocab columns."""

    def __init__(self, names, cfg: K3Config, attn_res_on: bool, act: torch.dtype):
        super().__init__(names)
        self.cfg, self.attn_res_on, self.act = cfg, attn_res_on, act

    def forward(self, *tensors):
        a = self.args(tensors)
        cfg, rows = self.cfg, a["logits_indices"].long()
        if self.attn_res_on:
            h = mix_stacked(a["blocks"][:, rows], a["partial"][rows], a["transformer.attn_res_out.query"],
                            cfg.rms_norm_eps).to(self.act)
        else:
            h = a["partial"][rows]
        y = rms_norm(h, a["transformer.ln_f.weight"], cfg.rms_norm_eps)
        cd = compute_dtype(y.dtype)
        logits = y.to(cd) @ a["lm_head.weight"].to(cd).T
        return logits * cfg.logit_scale if cfg.logit_scale != 1.0 else logits


# ---------------------------------------------------------------------------------------
# Specs: the I/O of every kind, the layers using each kind, what feeds every weight.
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSegments:
    index: int
    attention: str  # segment kind
    ffn: str  # "dense_mlp" | "moe" (then "moe_combine" follows)
    block_write: bool
    attn_sources: int
    mlp_sources: int

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.attention, self.ffn) + (("moe_combine",) if self.ffn == "moe" else ())


class SegmentPlan:
    """Every segment kind of ``cfg`` under ``world`` in activation dtype ``act``, with the
    modules to export and the checkpoint tensor of every weight input of every layer."""

    def __init__(self, cfg: K3Config, world: World, act: torch.dtype, block_size: int, kv_cache_dtype: str = "auto"):
        world.validate(cfg)
        self.cfg, self.world, self.act, self.block_size = cfg, world, act, block_size
        self.kv_cache_dtype = kv_cache_dtype  # the latent rows (model/caches.py); fp8: the MLA nodes' _fp8 ops
        self.attn_res_on = bool(cfg.attn_res_block_size)
        self.model = rank_model(cfg, world)
        self.layers = tuple(LayerSegments(p.index, f"{p.attention}_attention",
                                          "dense_mlp" if p.ffn == "dense" else "moe",
                                          p.block_write, p.attn_sources, p.mlp_sources) for p in cfg.layers)
        self.specs: dict[str, SegmentSpec] = {}
        self.modules: dict[str, nn.Module] = {}
        self._build()

    # -- per layer: which checkpoint tensor feeds each weight input ------------------
    def layer_weights(self, layer: int, kind: str) -> dict[str, str]:
        """Weight input name -> checkpoint tensor name, for one layer's segment of ``kind``."""
        prefix = f"transformer.layers.{layer}."
        return {t.name: prefix + t.name for t in self.specs[kind].weights}

    def global_weights(self, kind: str) -> dict[str, str]:
        return {t.name: t.name for t in self.specs[kind].weights}

    def layers_json(self) -> list[dict]:
        out = []
        for ls in self.layers:
            out.append({"index": ls.index, "block_write": ls.block_write, "attn_sources": ls.attn_sources,
                        "mlp_sources": ls.mlp_sources,
                        "segments": [{"kind": k, "weights": self.layer_weights(ls.index, k)} for k in ls.kinds]})
        return out

    # -- construction --------------------------------------------------------------
    def _io(self, name, dtype, shape, role) -> SegmentIO:
        return SegmentIO(name, dtype, tuple(shape), role)

    def _weight_ios(self, named: dict[str, torch.Tensor]) -> list[SegmentIO]:
        return [self._io(n, weight_dtype(b.dtype, self.act), b.shape, "weight") for n, b in named.items()]

    def _stream_inputs(self, query: str | None, layer) -> list[SegmentIO]:
        d, io = self.cfg.hidden_size, []
        if self.attn_res_on:
            io.append(self._io("blocks", self.act, (ATTN_BLOCKS, TOKENS, d), "stream"))
        io.append(self._io("partial", self.act, (TOKENS, d), "stream"))
        if self.attn_res_on and query is not None:
            io += self._weight_ios({query: getattr(layer.attn_res, query.split(".")[1])})
        return io

    def _blocks(self, kind: str) -> tuple[int, int] | None:
        if not self.attn_res_on or kind in ("embed", "moe_combine"):
            return None
        if kind == "head":
            n = self.cfg.num_attn_res_blocks
            return (n, n)
        counts = [ls.attn_sources if kind == ls.attention else ls.mlp_sources for ls in self.layers if kind in ls.kinds]
        return (min(counts), max(counts))

    def _add(self, kind, cls, inputs, outputs, *args, aliases=None):
        self.specs[kind] = SegmentSpec(kind, tuple(inputs), tuple(outputs), self._blocks(kind), aliases or {})
        self.modules[kind] = cls([t.name for t in inputs], *args).eval()

    def _build(self) -> None:
        cfg, act, d, tr = self.cfg, self.act, self.cfg.hidden_size, self.model.transformer
        i32 = torch.int32
        tok = (TOKENS,)
        emb = _weights(tr.vocab_embedding, "transformer.vocab_embedding.")
        self._add("embed", EmbedSegment,
                  [self._io("input_ids", i32, tok, "step"), self._io("vocab_start", i32, (1,), "rank"),
                   *self._weight_ios(emb)],
                  [self._io("hidden", act, (TOKENS, d), "stream")])
        first = {}
        for ls in self.layers:
            for kind in ls.kinds:
                first.setdefault(kind, tr.layers[ls.index])
        for kind, layer in first.items():
            getattr(self, f"_add_{kind}")(layer)
        head_w = {**_weights(tr.ln_f, "transformer.ln_f."), **_weights(self.model.lm_head, "lm_head.")}
        inputs = self._stream_inputs(None, None)
        if self.attn_res_on:
            inputs += self._weight_ios(_weights(tr.attn_res_out, "transformer.attn_res_out."))
        inputs += [self._io("logits_indices", i32, (LOGITS,), "step"), *self._weight_ios(head_w)]
        self._add("head", HeadSegment, inputs,
                  [self._io("logits", compute_dtype(act), (LOGITS, self.model.lm_head.weight.shape[0]), "stream")],
                  cfg, self.attn_res_on, act)
        self._check_layers_share_kinds()

    def _layer_inputs(self, layer, query, norm, sub) -> list[SegmentIO]:
        named = {norm: getattr(layer, norm.split(".")[0]).weight, **_weights(getattr(layer, sub), f"{sub}.")}
        return self._stream_inputs(query, layer) + self._weight_ios(named)

    def _add_kda_attention(self, layer) -> None:
        cfg, act = self.cfg, self.act
        k, heads = cfg.kda, layer.attention.num_heads
        i32 = torch.int32
        conv, rec = (3 * heads * k.head_dim, k.conv_kernel_size - 1), (heads, k.head_dim, k.head_dim)
        # the prefix cache's snapshot pools and points (contract KDA_PREFILL): the plugin writes the
        # snapshots mid-prefill, as the torch executor's op does; a step taking none binds -1 points
        pools = [self._io("conv_state", pool_dtype("conv", act), (MAX_SLOTS, *conv), "pool"),
                 self._io("recurrent_state", pool_dtype("recurrent", act), (MAX_SLOTS, *rec), "pool"),
                 self._io("snapshot_conv", pool_dtype("conv", act), (SNAPSHOT_SLOTS, *conv), "pool"),
                 self._io("snapshot_recurrent", pool_dtype("recurrent", act), (SNAPSHOT_SLOTS, *rec), "pool")]
        step = [self._io(n, i32, s, "step") for n, s in (("cu_seqlens", (SEQS_PLUS_1,)), ("state_slots", (SEQS,)),
                                                         ("has_initial_state", (SEQS,)),
                                                         ("snapshot_offsets", (SEQS, SNAPSHOT_POINTS)),
                                                         ("snapshot_rows", (SEQS, SNAPSHOT_POINTS)))]
        inputs = self._layer_inputs(layer, "attn_res.attention_query", "input_layernorm.weight", "attention")
        self._add_attention("kda_attention", layer, inputs + step + pools, pools)

    def _add_mla_attention(self, layer) -> None:
        cfg, act = self.cfg, self.act
        i32 = torch.int32
        dtype, width = latent_pool_type(cfg, act, self.kv_cache_dtype)
        pools = [self._io("latent_cache", dtype, (NUM_BLOCKS, self.block_size, width), "pool")]
        names = [("cu_seqlens", (SEQS_PLUS_1,)), ("context_lens", (SEQS,)), ("block_tables", (SEQS, MAX_BLOCKS)),
                 ("slot_mapping", (TOKENS,))]
        if not cfg.mla.use_nope:
            names.insert(0, ("positions", (TOKENS,)))
        step = [self._io(n, i32, s, "step") for n, s in names]
        inputs = self._layer_inputs(layer, "attn_res.attention_query", "input_layernorm.weight", "attention")
        self._add_attention("mla_attention", layer, inputs + step + pools, pools)

    def _add_attention(self, kind, layer, inputs, pools) -> None:
        out = [self._io("attn_partial", self.act, (TOKENS, self.cfg.hidden_size), "stream")]
        out += [self._io(f"{p.name}_out", p.dtype, p.shape, "pool") for p in pools]
        self._add(kind, AttentionSegment, inputs, out, layer, self.attn_res_on, self.cfg.rms_norm_eps, self.act,
                  tuple(p.name for p in pools), aliases={p.name: f"{p.name}_out" for p in pools})

    def _add_dense_mlp(self, layer) -> None:
        inputs = self._layer_inputs(layer, "attn_res.mlp_query", "post_layernorm.weight", "mlp")
        self._add("dense_mlp", DenseMlpSegment, inputs,
                  [self._io("mlp_partial", self.act, (TOKENS, self.cfg.hidden_size), "stream")],
                  layer, self.attn_res_on, self.cfg.rms_norm_eps, self.act)

    def _moe_widths(self) -> tuple[int, int]:
        m = self.cfg.moe
        return m.latent_size or self.cfg.hidden_size, self.cfg.hidden_size if m.num_shared_experts else 0

    def _add_moe(self, layer) -> None:
        moe = layer.mlp
        named = {n: b for n, b in _weights(moe, "mlp.").items()
                 if not n.startswith(("mlp.latent_up.", "mlp.latent_norm."))}
        norm = {"post_layernorm.weight": layer.post_layernorm.weight}
        inputs = self._stream_inputs("attn_res.mlp_query", layer) + self._weight_ios({**norm, **named})
        inputs.append(self._io("expert_offset", torch.int32, (1,), "rank"))
        routed, shared = self._moe_widths()
        self._add("moe", MoeSegment, inputs, [self._io("moe_partial", self.act, (TOKENS, routed + shared), "stream")],
                  layer, self.cfg, self.attn_res_on, self.act)

    def _add_moe_combine(self, layer) -> None:
        moe = layer.mlp
        named = {n: b for n, b in _weights(moe, "mlp.").items() if n.startswith(("mlp.latent_up.", "mlp.latent_norm."))}
        routed, shared = self._moe_widths()
        inputs = [self._io("moe_partial", self.act, (TOKENS, routed + shared), "stream"), *self._weight_ios(named)]
        self._add("moe_combine", MoeCombineSegment, inputs,
                  [self._io("mlp_out", self.act, (TOKENS, self.cfg.hidden_size), "stream")], self.cfg, routed)

    def _check_layers_share_kinds(self) -> None:
        """Every layer of a kind has the weights that kind's graph takes, same shapes and
        types (true by construction; a config that broke it would bind wrong tensors)."""
        tr = self.model.transformer
        for ls in self.layers:
            layer = tr.layers[ls.index]
            own = {n: weight_dtype(b.dtype, self.act) for n, b in layer.named_buffers()}
            shapes = {n: tuple(b.shape) for n, b in layer.named_buffers()}
            for kind in ls.kinds:
                for t in self.specs[kind].weights:
                    if own.get(t.name) != t.dtype or shapes.get(t.name) != t.shape:
                        raise SegmentError(f"layer {ls.index}: {t.name} does not fit segment {kind}")

    def expert_offset(self, rank: int) -> int:
        return self.world.parallel(rank).moe_ep_rank * (self.cfg.moe.num_experts // self.world.ep)

    def vocab_start(self, rank: int) -> int:
        return self.world.parallel(rank).tp_rank * (self.cfg.vocab_size // self.world.tp)


# ---------------------------------------------------------------------------------------
# Export and checks
# ---------------------------------------------------------------------------------------
def _dims(spec: SegmentSpec) -> dict[str, Dim]:
    dims = {TOKENS: Dim(TOKENS, min=1), SEQS: Dim(SEQS, min=1), LOGITS: Dim(LOGITS, min=1),
            MAX_BLOCKS: Dim(MAX_BLOCKS, min=1), NUM_BLOCKS: Dim(NUM_BLOCKS, min=1), MAX_SLOTS: Dim(MAX_SLOTS, min=1),
            ATTN_BLOCKS: Dim(ATTN_BLOCKS, min=0), SNAPSHOT_POINTS: Dim(SNAPSHOT_POINTS, min=1),
            SNAPSHOT_SLOTS: Dim(SNAPSHOT_SLOTS, min=1)}
    dims[SEQS_PLUS_1] = dims[SEQS] + 1
    return dims


def _sample(t: SegmentIO) -> torch.Tensor:
    shape = [d if isinstance(d, int) else _SAMPLE[d] for d in t.shape]
    # MXFP4 bytes are traced as the uint8 the ops take, retyped to INT8 after export
    dtype = torch.uint8 if t.dtype == torch.int8 else t.dtype
    return torch.empty(shape, dtype=dtype, device="meta")


def export_segment(plan: SegmentPlan, kind: str, path: str | Path) -> Path:
    """One kind's graph to ``path`` (weightless: no external data)."""
    register_schemas()
    spec, module, path = plan.specs[kind], plan.modules[kind], Path(path)
    dims = _dims(spec)
    dynamic = tuple({ax: dims[d] for ax, d in enumerate(t.shape) if isinstance(d, str)} for t in spec.inputs)
    args = tuple(_sample(t) for t in spec.inputs)
    # the meta device is the default while tracing, so that tensors the model code creates
    # (e.g. rotary tables) live beside the meta inputs
    with torch.no_grad(), torch.device("meta"):
        program = torch.onnx.export(
            module, args, dynamo=True, opset_version=OPSET, optimize=True,
            input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
            dynamic_shapes=(dynamic,), custom_translation_table=translation_table(), verbose=False)
    _strip_metadata(program.model)
    _retype_byte_graph_io(program.model)
    program.model.opset_imports[DOMAIN] = DOMAIN_VERSION
    names = [v.name for v in program.model.graph.inputs]
    if names != [t.name for t in spec.inputs]:
        raise RuntimeError(f"segment {kind}: the exporter changed the inputs to {names}")
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=False)
    return path


def check_segment(path: str | Path) -> onnx.ModelProto:
    """``check_model(full_check=True)`` and strict shape inference; returns the inferred graph."""
    register_schemas()
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def export_segments(plan: SegmentPlan, out_dir: str | Path, log=None) -> dict[str, Path]:
    log = log or (lambda msg: print(msg, file=sys.stderr))
    paths = {}
    for n, kind in enumerate(plan.specs, 1):
        log(f"export: segment {n}/{len(plan.specs)} {kind}")
        paths[kind] = export_segment(plan, kind, Path(out_dir) / f"{kind}.onnx")
        check_segment(paths[kind])
    return paths
