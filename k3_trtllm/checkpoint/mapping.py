"""HF K3 checkpoint → TensorRT-LLM-style tensors: the one transformation table.

Both the in-memory HF loader (world size 1) and ``k3-trt convert`` (streaming,
TP/EP-sharded) use this table, so a converted checkpoint holds exactly what the
model would have built from the HF files.

| target (TRT-LLM name, per layer ``transformer.layers.{i}.``) | HF sources (``model.layers.{i}.``) | transformation | TP / EP split |
| --- | --- | --- | --- |
| ``vocab_embedding.weight`` | ``model.embed_tokens.weight`` | — | rows (vocab) |
| ``input_layernorm.weight`` / ``post_layernorm.weight`` | ``input_layernorm`` / ``post_attention_layernorm`` | — | replicate |
| ``attn_res.attention_query`` / ``attn_res.mlp_query`` | ``self_attention_res_{norm,proj}`` / ``mlp_res_{norm,proj}`` | fp32(norm)·fp32(proj): the effective query of spec §4.7.1 (exact in fp32) | replicate |
| KDA ``attention.in_proj.weight`` | ``q_proj, k_proj, v_proj, g_proj, f_a_proj, b_proj`` | row concat | rows per part (``f_a_proj`` replicated) |
| KDA ``attention.conv1d.weight`` | ``{q,k,v}_conv1d.weight`` | ``[P,1,W]`` → ``[P,W]``, row concat, fp32 | rows per part |
| KDA ``attention.f_b.weight``, ``A_log``, ``dt_bias`` | same names | ``A_log`` → ``[H]``, fp32 | rows (heads) |
| KDA ``attention.o_norm.weight`` | ``o_norm.weight`` | rounded to bf16 (both reference stacks apply a bf16 gain, spec §7.10) | replicate |
| MLA ``attention.fused_a.weight`` | ``q_a_proj, kv_a_proj_with_mqa, g_proj`` | row concat (``q_a`` only with q-LoRA, ``g`` only with the output gate) | ``q_a``/``kv_a`` replicated, ``g`` rows |
| MLA ``attention.q_b.weight`` (or ``attention.q.weight``) | ``q_b_proj`` (``q_proj``) | — | rows (heads) |
| MLA ``attention.w_uk`` / ``attention.w_uv`` | ``kv_b_proj.weight`` | view ``[H, Dn+Dv, R]``, split ``[Dn, Dv]``: the absorbed weights of §4.4.5 | rows (heads) |
| ``attention.dense.weight`` | ``o_proj.weight`` | — | columns |
| dense ``mlp.fc.weight`` / ``mlp.proj.weight`` | ``mlp.{gate,up}_proj`` / ``mlp.down_proj`` | row concat gate then up | rows per part / columns |
| MoE ``mlp.router.weight``, ``mlp.router.e_score_correction_bias`` | ``block_sparse_moe.gate.*`` | fp32 | replicate |
| MoE ``mlp.shared_experts.fc.weight`` / ``.proj.weight`` | ``shared_experts.{gate,up}_proj`` / ``down_proj`` | row concat | rows per part / columns |
| MoE ``mlp.latent_down.weight``, ``mlp.latent_norm.weight``, ``mlp.latent_up.weight`` | ``routed_expert_{down_proj,norm,up_proj}`` | — | replicate |
| MoE ``mlp.experts.w13.weight`` / ``w2.weight`` | ``experts.{e}.{w1,w3}.weight`` / ``w2.weight`` | stack over experts, ``[w1; w3]`` per expert | experts (contiguous) |
| MoE ``mlp.experts.w13.weight_packed``/``weight_scale``, ``w2.*`` | ``experts.{e}.{w}.weight_packed``/``weight_scale`` | the same, packed MXFP4 kept as is | experts (contiguous) |
| ``ln_f.weight`` | ``model.norm.weight`` | — | replicate |
| ``attn_res_out.query`` | ``model.output_attn_res_{norm,proj}`` | fp32(norm)·fp32(proj) | replicate |
| ``lm_head.weight`` | ``lm_head.weight`` | — | rows (vocab) |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import K3Config

BF16 = (torch.bfloat16,)
FP32 = (torch.float32,)
FLOAT = (torch.bfloat16, torch.float32)  # file dtype not fixed by the spec (§5.5 router, §5.4 o_norm)
U8 = (torch.uint8,)

# How a part (or a whole target) is divided over ranks.
REPLICATE, ROWS, COLS, EXPERTS = "replicate", "rows", "cols", "experts"


@dataclass(frozen=True)
class Part:
    source: str  # canonical flat HF name, e.g. "model.layers.3.self_attn.q_a_proj.weight"
    shape: tuple[int, ...]  # expected HF shape
    dtypes: tuple[torch.dtype, ...]  # accepted HF dtypes
    split: str = REPLICATE
    alt_shapes: tuple[tuple[int, ...], ...] = ()  # legacy shapes the loader also accepts


@dataclass(frozen=True)
class Target:
    """One output tensor. ``combine`` names how its parts become the tensor:
    ``copy`` (one part), ``concat`` (row concat), ``conv`` (reshape to [C, W] then concat),
    ``uk`` / ``uv`` (absorbed MLA weights), ``query`` (AttnRes effective query),
    ``experts`` (stack over experts; parts grouped per expert, concatenated within)."""

    name: str
    parts: tuple[Part, ...]
    combine: str
    dtype: torch.dtype  # dtype written
    per_expert: int = 0  # experts: parts per expert


def _p(name: str, shape, dtypes, split=REPLICATE, alt=()) -> Part:
    return Part(name, tuple(shape), dtypes, split, tuple(tuple(a) for a in alt))


def targets(cfg: K3Config) -> Iterator[Target]:
    """Every target tensor of the model in a fixed order (world size 1 shapes)."""
    d, V = cfg.hidden_size, cfg.vocab_size
    yield Target("transformer.vocab_embedding.weight",
                 (_p("model.embed_tokens.weight", (V, d), BF16, ROWS),), "copy", torch.bfloat16)
    for plan in cfg.layers:
        yield from _layer_targets(cfg, plan.index, plan.attention, plan.ffn)
    yield Target("transformer.ln_f.weight", (_p("model.norm.weight", (d,), BF16),), "copy", torch.bfloat16)
    if cfg.attn_res_block_size:
        yield Target("transformer.attn_res_out.query",
                     (_p("model.output_attn_res_norm.weight", (d,), BF16),
                      _p("model.output_attn_res_proj.weight", (1, d), BF16)), "query", torch.float32)
    yield Target("lm_head.weight", (_p("lm_head.weight", (V, d), BF16, ROWS),), "copy", torch.bfloat16)


def _layer_targets(cfg: K3Config, i: int, attention: str, ffn: str) -> Iterator[Target]:
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
        yield from _moe_targets(cfg, p + "block_sparse_moe.", t + "mlp.")


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
    yield Target(t + "o_norm.weight", (_p(a + "o_norm.weight", (Dk,), FLOAT),), "copy", torch.bfloat16)
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


def _moe_targets(cfg: K3Config, b: str, t: str) -> Iterator[Target]:
    moe, d = cfg.moe, cfg.hidden_size
    E, inter = moe.num_experts, moe.moe_intermediate_size
    lat = moe.latent_size or d
    yield Target(t + "router.weight", (_p(b + "gate.weight", (E, d), FLOAT),), "copy", torch.float32)
    yield Target(t + "router.e_score_correction_bias", (_p(b + "gate.e_score_correction_bias", (E,), FLOAT),),
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
    if moe.mxfp4:
        for suffix, (cols, dt) in (("weight_packed", (2, torch.uint8)), ("weight_scale", (32, torch.uint8))):
            yield Target(t + f"experts.w13.{suffix}", tuple(
                _p(x + f"{e}.{w}.{suffix}", (inter, lat // cols), U8, EXPERTS) for e in range(E) for w in ("w1", "w3")
            ), "experts", dt, per_expert=2)
            yield Target(t + f"experts.w2.{suffix}", tuple(
                _p(x + f"{e}.w2.{suffix}", (lat, inter // cols), U8, EXPERTS) for e in range(E)
            ), "experts", dt, per_expert=1)
    else:
        yield Target(t + "experts.w13.weight", tuple(
            _p(x + f"{e}.{w}.weight", (inter, lat), BF16, EXPERTS) for e in range(E) for w in ("w1", "w3")
        ), "experts", torch.bfloat16, per_expert=2)
        yield Target(t + "experts.w2.weight", tuple(
            _p(x + f"{e}.w2.weight", (lat, inter), BF16, EXPERTS) for e in range(E)
        ), "experts", torch.bfloat16, per_expert=1)


def combine(target: Target, tensors: list[torch.Tensor], cfg: K3Config) -> torch.Tensor:
    """Build the target from its (already rank-local) part tensors."""
    kind = target.combine
    if kind == "copy":
        src = tensors[0]
        if target.parts[0].alt_shapes and src.dim() != len(target.parts[0].shape):
            src = src.reshape(-1)
        return src.to(target.dtype).contiguous()
    if kind == "concat":
        return torch.cat([x.to(target.dtype) for x in tensors], 0).contiguous()
    if kind == "conv":
        return torch.cat([x.reshape(x.shape[0], -1).to(target.dtype) for x in tensors], 0).contiguous()
    if kind in ("uk", "uv"):
        m = cfg.mla
        kv_b = tensors[0].to(target.dtype)
        per_head = kv_b.view(-1, m.qk_nope_head_dim + m.v_head_dim, kv_b.shape[-1])
        part = per_head[:, : m.qk_nope_head_dim] if kind == "uk" else per_head[:, m.qk_nope_head_dim:]
        return part.contiguous()
    if kind == "query":
        norm, proj = tensors
        return (norm.to(torch.float32) * proj.reshape(-1).to(torch.float32)).contiguous()
    if kind == "experts":
        k = target.per_expert
        return torch.stack([torch.cat(tensors[j: j + k], 0) for j in range(0, len(tensors), k)]).to(
            target.dtype).contiguous()
    raise ValueError(f"unknown combine kind {kind!r} for {target.name}")
