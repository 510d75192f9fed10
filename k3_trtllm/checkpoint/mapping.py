"""HF K3 checkpoint → TensorRT-LLM-style tensors: the one transformation table.

Both the in-memory HF loader (world size 1) and ``k3-trt convert`` (streaming,
TP/EP-sharded) use this table, so a converted checkpoint holds exactly what the
model would have built from the HF files.

| target (TRT-LLM name, per layer ``transformer.layers.{i}.``) | HF sources (``model.layers.{i}.``) | transformation | TP / EP split |
| --- | --- | --- | --- |
| ``vocab_embedding.weight`` | ``model.embed_tokens.weight`` | — | rows (vocab) |
| ``input_layernorm.weight`` / ``post_layernorm.weight`` | ``input_layernorm`` / ``post_attention_layernorm`` | — | replicate |
| ``attn_res.attention_query`` / ``attn_res.mlp_query`` | ``self_attention_res_{norm,proj}`` / ``mlp_res_{norm,proj}`` | fp32(norm)·fp32(proj) of the bf16 parameters: the effective query of spec §4.7.1 (exact in fp32) | replicate |
| KDA ``attention.in_proj.weight`` | ``q_proj, k_proj, v_proj, g_proj, f_a_proj, b_proj`` | row concat | rows per part (``f_a_proj`` replicated) |
| KDA ``attention.conv1d.weight`` | ``{q,k,v}_conv1d.weight`` | ``[P,1,W]`` → ``[P,W]``, row concat, fp32 | rows per part |
| KDA ``attention.f_b.weight``, ``A_log``, ``dt_bias`` | same names | ``A_log`` → ``[H]``, fp32 | rows (heads) |
| KDA ``attention.o_norm.weight`` | ``o_norm.weight`` | rounded to bf16 (both reference stacks apply a bf16 gain, spec §7.10) | replicate |
| MLA ``attention.fused_a.weight`` | ``q_a_proj, kv_a_proj_with_mqa, g_proj`` | row concat (``q_a`` only with q-LoRA, ``g`` only with the output gate) | ``q_a``/``kv_a`` replicated, ``g`` rows |
| MLA ``attention.q_a_layernorm.weight``, ``kv_a_layernorm.weight`` | same names | — | replicate |
| MLA ``attention.q_b.weight`` (or ``attention.q.weight``) | ``q_b_proj`` (``q_proj``) | — | rows (heads) |
| MLA ``attention.w_uk`` / ``attention.w_uv`` | ``kv_b_proj.weight`` | view ``[H, Dn+Dv, R]``, split ``[Dn, Dv]``: the absorbed weights of §4.4.5 | rows (heads) |
| ``attention.dense.weight`` | ``o_proj.weight`` | — | columns |
| dense ``mlp.fc.weight`` / ``mlp.proj.weight`` | ``mlp.{gate,up}_proj`` / ``mlp.down_proj`` | row concat gate then up | rows per part / columns |
| MoE ``mlp.router.weight``, ``mlp.router.e_score_correction_bias`` | ``block_sparse_moe.gate.*`` | fp32 | replicate |
| MoE ``mlp.shared_experts.fc.weight`` / ``.proj.weight`` | ``shared_experts.{gate,up}_proj`` / ``down_proj`` | row concat | rows per part / columns |
| MoE ``mlp.latent_down.weight``, ``mlp.latent_norm.weight``, ``mlp.latent_up.weight`` | ``routed_expert_{down_proj,norm,up_proj}`` | — | replicate |
| MoE ``mlp.experts.w13.weight`` / ``w2.weight`` | ``experts.{e}.{w1,w3}.weight`` / ``w2.weight`` | stack over experts, ``[w1; w3]`` per expert | experts contiguous over EP; inside an expert w1/w3 rows, w2 columns over MoE-TP |
| MoE ``mlp.experts.w13.weight_packed``/``weight_scale``, ``w2.*`` | ``experts.{e}.{w}.weight_packed``/``weight_scale`` | the same, packed MXFP4 kept as is | the same (packed and scale columns split alike) |
| MoE ``mlp.experts.w13.weight`` / ``w2.weight`` (``--experts bf16`` from MXFP4) | ``experts.{e}.{w}.weight_packed`` + ``weight_scale`` | dequantised to bf16 (exact, spec §2.6), then as above | the same |
| ``ln_f.weight`` | ``model.norm.weight`` | — | replicate |
| ``attn_res_out.query`` | ``model.output_attn_res_{norm,proj}`` | fp32(norm)·fp32(proj) | replicate |
| ``lm_head.weight`` | ``lm_head.weight`` | — | rows (vocab) |

Files may store any float tensor in any float dtype (spec §5.4 erratum); every part is
cast to the dtype the model keeps it in (``to_kept``: exact upcasts, round-to-nearest-even
downcasts) before its transformation. Shapes and the MXFP4 bytes are checked strictly.

TP splits are over all ``tp`` ranks; routed experts are split contiguously over the
``moe_ep`` ranks and each expert's intermediate dimension over the ``moe_tp = tp / ep``
ranks (TensorRT-LLM's MoE mapping).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import K3Config
from ..mxfp4 import dequantize_mxfp4

# File dtypes each part accepts. The spec's dtype column is the dtype the model keeps, not
# a promise about the file (§5.4 erratum): a float tensor may be stored in any float dtype
# and is cast by ``to_kept``; the first entry is the dtype the spec's checkpoint holds (what
# synth writes). Only the MXFP4 bytes are fixed: packed values are U8, and scales U8 or
# F8_E8M0 (the same E8M0 bytes under their own name).
BF16 = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP32 = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
U8 = (torch.uint8,)
E8M0 = (torch.uint8, torch.float8_e8m0fnu)

# How a part is divided over ranks: along its first dimension (ROWS), its second (COLS),
# or not at all. A non-expert part is divided over the tp ranks; an expert part lives on
# the ranks of its expert-parallel group and is divided over their moe_tp ranks.
REPLICATE, ROWS, COLS = "replicate", "rows", "cols"

# Combine kinds whose output is the row concatenation of per-unit outputs, each computed
# row by row: a converter may build such a target unit by unit, and a unit in row chunks.
ROW_WISE = ("copy", "concat", "conv", "experts", "dequant_experts")
# Combine kinds whose unit output holds exactly the part's bytes when the part is stored
# in the target dtype (only the shape changes): a converter may copy the bytes file to file.
BYTE_COPY = ("copy", "concat", "conv", "experts")


@dataclass(frozen=True)
class Part:
    source: str  # canonical flat HF name, e.g. "model.layers.3.self_attn.q_a_proj.weight"
    shape: tuple[int, ...]  # expected HF shape
    dtypes: tuple[torch.dtype, ...]  # accepted file dtypes, the spec's first
    split: str = REPLICATE
    alt_shapes: tuple[tuple[int, ...], ...] = ()  # legacy shapes the loader also accepts (same layout)
    expert: int | None = None  # routed expert index


@dataclass(frozen=True)
class Target:
    """One output tensor. ``combine`` names how its parts become the tensor:
    ``copy`` (one part), ``concat`` (row concat), ``conv`` (reshape to [C, W] then concat),
    ``uk`` / ``uv`` (absorbed MLA weights), ``query`` (AttnRes effective query),
    ``experts`` (stack over experts; parts grouped per expert, concatenated within),
    ``dequant_experts`` (the same over dequantised (packed, scale) pairs)."""

    name: str
    parts: tuple[Part, ...]
    combine: str
    dtype: torch.dtype  # dtype written
    per_expert: int = 0  # experts: parts per expert

    @property
    def unit_size(self) -> int:
        """Parts per unit: 2 for (packed, scale) pairs, else 1; the whole target when not row-wise."""
        if self.combine not in ROW_WISE:
            return len(self.parts)
        return 2 if self.combine == "dequant_experts" else 1

    def units(self) -> list[tuple[Part, ...]]:
        """The parts grouped into units: the target is the row concatenation of
        ``unit_output`` over its units (reshaped per expert for expert stacks)."""
        k = self.unit_size
        return [self.parts[i: i + k] for i in range(0, len(self.parts), k)]


def _p(name: str, shape, dtypes, split=REPLICATE, alt=(), expert=None) -> Part:
    return Part(name, tuple(shape), dtypes, split, tuple(tuple(a) for a in alt), expert)


def targets(cfg: K3Config, dequantize_experts: bool = False) -> Iterator[Target]:
    """Every target tensor of the model in a fixed order (world size 1 shapes).
    ``dequantize_experts`` turns MXFP4 routed experts into bf16 ``weight`` targets."""
    d, V = cfg.hidden_size, cfg.vocab_size
    yield Target("transformer.vocab_embedding.weight",
                 (_p("model.embed_tokens.weight", (V, d), BF16, ROWS),), "copy", torch.bfloat16)
    for plan in cfg.layers:
        yield from _layer_targets(cfg, plan.index, plan.attention, plan.ffn, dequantize_experts)
    yield Target("transformer.ln_f.weight", (_p("model.norm.weight", (d,), BF16),), "copy", torch.bfloat16)
    if cfg.attn_res_block_size:
        yield Target("transformer.attn_res_out.query",
                     (_p("model.output_attn_res_norm.weight", (d,), BF16),
                      _p("model.output_attn_res_proj.weight", (1, d), BF16)), "query", torch.float32)
    yield Target("lm_head.weight", (_p("lm_head.weight", (V, d), BF16, ROWS),), "copy", torch.bfloat16)


def _layer_targets(cfg: K3Config, i: int, attention: str, ffn: str, dequantize_experts: bool) -> Iterator[Target]:
    d = cfg.hidden_size
    p, t = f"model.layers.{i}.", f"transformer.layers.{i}."
    yield Target(t + "input_layernorm.weight", (_p(p + "input_layernorm.weight", (d,), BF16),), "copy", torch.bfloat16)
    yield Target(t + "post_layernorm.weight", (_p(p + "post_attention_layernorm.weight", (d,), BF16),), "copy",
                 torch.bfloat16)
    if cfg.attn_res_block_size:
        for side, hf in (("attention", "self_attention"), ("mlp", "mlp")):
            yield Target(t + f"attn_res.{side}_query",
                         (_p(p + f"{hf}_res_norm.weight", (d,), BF16),
                          _p(p + f"{hf}_res_proj.weight", (1, d), BF16)), "query", torch.float32)
    a = p + "self_attn."
    if attention == "kda":
        yield from _kda_targets(cfg, a, t + "attention.")
    else:
        yield from _mla_targets(cfg, a, t + "attention.")
    if ffn == "dense":
        m, inter = p + "mlp.", cfg.intermediate_size
        yield Target(t + "mlp.fc.weight", (_p(m + "gate_proj.weight", (inter, d), BF16, ROWS),
                                           _p(m + "up_proj.weight", (inter, d), BF16, ROWS)), "concat", torch.bfloat16)
        yield Target(t + "mlp.proj.weight", (_p(m + "down_proj.weight", (d, inter), BF16, COLS),), "copy",
                     torch.bfloat16)
    else:
        yield from _moe_targets(cfg, p + "block_sparse_moe.", t + "mlp.", dequantize_experts)


def _kda_targets(cfg: K3Config, a: str, t: str) -> Iterator[Target]:
    k, d = cfg.kda, cfg.hidden_size
    P, H, Dk, W = k.proj_dim, k.num_heads, k.head_dim, k.conv_kernel_size
    yield Target(t + "in_proj.weight", (
        _p(a + "q_proj.weight", (P, d), BF16, ROWS), _p(a + "k_proj.weight", (P, d), BF16, ROWS),
        _p(a + "v_proj.weight", (P, d), BF16, ROWS), _p(a + "g_proj.weight", (P, d), BF16, ROWS),
        _p(a + "f_a_proj.weight", (Dk, d), BF16), _p(a + "b_proj.weight", (H, d), BF16, ROWS),
    ), "concat", torch.bfloat16)
    yield Target(t + "conv1d.weight", tuple(
        _p(a + f"{x}_conv1d.weight", (P, 1, W), FP32, ROWS, alt=[(P, W)]) for x in "qkv"
    ), "conv", torch.float32)
    yield Target(t + "f_b.weight", (_p(a + "f_b_proj.weight", (P, Dk), BF16, ROWS),), "copy", torch.bfloat16)
    yield Target(t + "A_log", (_p(a + "A_log", (H,), FP32, ROWS, alt=[(1, 1, H, 1)]),), "copy", torch.float32)
    yield Target(t + "dt_bias", (_p(a + "dt_bias", (P,), FP32, ROWS),), "copy", torch.float32)
    yield Target(t + "o_norm.weight", (_p(a + "o_norm.weight", (Dk,), FP32),), "copy", torch.bfloat16)
    yield Target(t + "dense.weight", (_p(a + "o_proj.weight", (d, P), BF16, COLS),), "copy", torch.bfloat16)


def _mla_targets(cfg: K3Config, a: str, t: str) -> Iterator[Target]:
    m, d = cfg.mla, cfg.hidden_size
    H, R = m.num_heads, m.kv_lora_rank
    fused = []
    if m.q_lora_rank:
        fused.append(_p(a + "q_a_proj.weight", (m.q_lora_rank, d), BF16))
    fused.append(_p(a + "kv_a_proj_with_mqa.weight", (R + m.qk_rope_head_dim, d), BF16))
    if m.use_output_gate:
        fused.append(_p(a + "g_proj.weight", (H * m.v_head_dim, d), BF16, ROWS))
    yield Target(t + "fused_a.weight", tuple(fused), "concat", torch.bfloat16)
    if m.q_lora_rank:
        yield Target(t + "q_a_layernorm.weight", (_p(a + "q_a_layernorm.weight", (m.q_lora_rank,), BF16),), "copy",
                     torch.bfloat16)
        yield Target(t + "q_b.weight", (_p(a + "q_b_proj.weight", (H * m.qk_head_dim, m.q_lora_rank), BF16, ROWS),),
                     "copy", torch.bfloat16)
    else:
        yield Target(t + "q.weight", (_p(a + "q_proj.weight", (H * m.qk_head_dim, d), BF16, ROWS),), "copy",
                     torch.bfloat16)
    yield Target(t + "kv_a_layernorm.weight", (_p(a + "kv_a_layernorm.weight", (R,), BF16),), "copy", torch.bfloat16)
    kv_b = _p(a + "kv_b_proj.weight", (H * (m.qk_nope_head_dim + m.v_head_dim), R), BF16, ROWS)
    yield Target(t + "w_uk", (kv_b,), "uk", torch.bfloat16)
    yield Target(t + "w_uv", (kv_b,), "uv", torch.bfloat16)
    yield Target(t + "dense.weight", (_p(a + "o_proj.weight", (d, H * m.v_head_dim), BF16, COLS),), "copy",
                 torch.bfloat16)


def _moe_targets(cfg: K3Config, b: str, t: str, dequantize_experts: bool) -> Iterator[Target]:
    moe, d = cfg.moe, cfg.hidden_size
    E, inter = moe.num_experts, moe.moe_intermediate_size
    lat = moe.latent_size or d
    yield Target(t + "router.weight", (_p(b + "gate.weight", (E, d), BF16),), "copy", torch.float32)
    yield Target(t + "router.e_score_correction_bias", (_p(b + "gate.e_score_correction_bias", (E,), FP32),),
                 "copy", torch.float32)
    if moe.num_shared_experts:
        s, si = b + "shared_experts.", moe.shared_intermediate_size
        yield Target(t + "shared_experts.fc.weight", (_p(s + "gate_proj.weight", (si, d), BF16, ROWS),
                                                      _p(s + "up_proj.weight", (si, d), BF16, ROWS)),
                     "concat", torch.bfloat16)
        yield Target(t + "shared_experts.proj.weight", (_p(s + "down_proj.weight", (d, si), BF16, COLS),), "copy",
                     torch.bfloat16)
    if moe.latent_size:
        yield Target(t + "latent_down.weight", (_p(b + "routed_expert_down_proj.weight", (lat, d), BF16),), "copy",
                     torch.bfloat16)
        if moe.latent_norm:
            yield Target(t + "latent_norm.weight", (_p(b + "routed_expert_norm.weight", (lat,), BF16),), "copy",
                         torch.bfloat16)
        yield Target(t + "latent_up.weight", (_p(b + "routed_expert_up_proj.weight", (d, lat), BF16),), "copy",
                     torch.bfloat16)
    x = b + "experts."
    # w1/w3 are [Im, in]: their rows are the intermediate dim; w2 is [lat, Im]: its columns.
    projections = {"w13": (("w1", "w3"), (inter, lat), ROWS), "w2": (("w2",), (lat, inter), COLS)}
    for fused, (names, (rows, cols), split) in projections.items():
        if not moe.mxfp4:
            yield Target(t + f"experts.{fused}.weight", tuple(
                _p(x + f"{e}.{w}.weight", (rows, cols), BF16, split, expert=e) for e in range(E) for w in names
            ), "experts", torch.bfloat16, per_expert=len(names))
            continue
        packed = {suffix: tuple(_p(x + f"{e}.{w}.{suffix}", (rows, cols // div), dtypes, split, expert=e)
                                for e in range(E) for w in names)
                  for suffix, div, dtypes in (("weight_packed", 2, U8), ("weight_scale", 32, E8M0))}
        if dequantize_experts:
            pairs = tuple(p for pair in zip(packed["weight_packed"], packed["weight_scale"]) for p in pair)
            yield Target(t + f"experts.{fused}.weight", pairs, "dequant_experts", torch.bfloat16,
                         per_expert=2 * len(names))
        else:
            for suffix, parts in packed.items():
                yield Target(t + f"experts.{fused}.{suffix}", parts, "experts", torch.uint8, per_expert=len(names))


def to_kept(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A part as stored in the file, in the dtype the model keeps it in: the one cast rule of
    the HF loader and the converter. Float to float: upcasts are exact; downcasts round to
    nearest, ties to even (``Tensor.to``), as vLLM's ``param.data.copy_`` does. E8M0 MXFP4
    scales are reinterpreted as their U8 bytes, not converted by value."""
    if tensor.dtype == torch.float8_e8m0fnu:
        return tensor.view(torch.uint8)
    return tensor.to(dtype)


def unit_output(target: Target, tensors: list[torch.Tensor], cfg: K3Config) -> torch.Tensor:
    """One unit's contribution (rank-local or whole, in canonical part shapes, any accepted dtype)."""
    kind = target.combine
    if kind in ("copy", "concat", "experts"):
        return to_kept(tensors[0], target.dtype).contiguous()
    if kind == "conv":
        x = tensors[0]
        return to_kept(x.reshape(x.shape[0], -1), target.dtype).contiguous()
    if kind == "dequant_experts":
        packed, scale = tensors
        return dequantize_mxfp4(packed, to_kept(scale, torch.uint8), target.dtype)
    if kind in ("uk", "uv"):
        m = cfg.mla
        kv_b = to_kept(tensors[0], target.dtype)
        per_head = kv_b.view(-1, m.qk_nope_head_dim + m.v_head_dim, kv_b.shape[-1])
        part = per_head[:, : m.qk_nope_head_dim] if kind == "uk" else per_head[:, m.qk_nope_head_dim:]
        return part.contiguous()
    if kind == "query":
        # The model keeps the norm and the projection as bf16 parameters (spec §5.3) whatever
        # the file holds; the fp32 product of two bf16 values is exact.
        norm, proj = (to_kept(x, torch.bfloat16).to(torch.float32) for x in tensors)
        return (norm * proj.reshape(-1)).contiguous()
    raise ValueError(f"unknown combine kind {kind!r} for {target.name}")


def unit_output_shape(target: Target, shapes: list[tuple[int, ...]], cfg: K3Config) -> tuple[int, ...]:
    """The shape ``unit_output`` gives for parts of these shapes (no data needed)."""
    kind, first = target.combine, tuple(shapes[0])
    if kind in ("copy", "concat", "experts"):
        return first
    if kind == "conv":
        return first[0], math.prod(first[1:])
    if kind == "dequant_experts":
        return first[0], 2 * first[1]
    if kind in ("uk", "uv"):
        m = cfg.mla
        width = m.qk_nope_head_dim if kind == "uk" else m.v_head_dim
        return first[0] // (m.qk_nope_head_dim + m.v_head_dim), width, first[1]
    if kind == "query":
        return first
    raise ValueError(f"unknown combine kind {kind!r} for {target.name}")


def combine(target: Target, tensors: list[torch.Tensor], cfg: K3Config) -> torch.Tensor:
    """Build the target from its (already rank-local, canonical-shape) part tensors."""
    k = target.unit_size
    outs = [unit_output(target, tensors[i: i + k], cfg) for i in range(0, len(tensors), k)]
    out = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
    if target.combine in ("experts", "dequant_experts"):
        units_per_expert = target.per_expert // k
        return out.view(len(outs) // units_per_expert, -1, *out.shape[1:])
    return out
