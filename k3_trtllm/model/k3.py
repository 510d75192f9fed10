"""The K3 causal LM (spec §3): embedding, hybrid KDA/MLA decoder layers with dense or
latent-MoE FFNs, the AttnRes residual stream, final norm and LM head.

One forward is one step of the contract (``StepInputs``) over the executor's cache pools;
prefill chunks and decode tokens may mix. Pure-decode steps use the decode forms of the
ops (recurrent KDA, absorbed MLA); any other step uses the prefill forms, which are exact
for decode tokens too."""
from __future__ import annotations

import torch
from torch import nn

from ..config import K3Config
from ..ops import attn_res
from ..ops.common import compute_dtype, rms_norm
from .caches import K3Caches
from .layers import GatedMLP, KdaAttention, LatentMoE, MlaAttention, Weights, _w
from .parallel import Parallel, embed, gather_columns
from .step import StepInputs


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, index: int, par: Parallel):
        super().__init__()
        plan = cfg.layers[index]
        self.plan, d = plan, cfg.hidden_size
        self.input_layernorm = Weights(weight=_w((d,)))
        self.post_layernorm = Weights(weight=_w((d,)))
        if cfg.attn_res_block_size:
            self.attn_res = Weights(attention_query=_w((d,), torch.float32), mlp_query=_w((d,), torch.float32))
        attention = KdaAttention if plan.attention == "kda" else MlaAttention
        self.attention = attention(cfg, index, par)
        self.mlp = GatedMLP(cfg, d, cfg.intermediate_size, par) if plan.ffn == "dense" else LatentMoE(cfg, par)


class Transformer(nn.Module):
    def __init__(self, cfg: K3Config, par: Parallel):
        super().__init__()
        d = cfg.hidden_size
        self.vocab_embedding = Weights(weight=_w((par.tp_local(cfg.vocab_size), d)))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, par) for i in range(cfg.num_hidden_layers))
        self.ln_f = Weights(weight=_w((d,)))
        if cfg.attn_res_block_size:
            self.attn_res_out = Weights(query=_w((d,), torch.float32))


class K3ForCausalLM(nn.Module):
    """One rank of the model (``parallel``: world size 1 by default); every rank runs every
    step and returns the full logits."""

    def __init__(self, cfg: K3Config, parallel: Parallel = Parallel()):
        super().__init__()
        self.config, self.parallel = cfg, parallel
        self.transformer = Transformer(cfg, parallel)
        self.lm_head = Weights(weight=_w((parallel.tp_local(cfg.vocab_size), cfg.hidden_size)))

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.ln_f.weight.dtype

    def allocate_caches(self, num_blocks: int, block_size: int, max_slots: int) -> K3Caches:
        return K3Caches.allocate(self.config, num_blocks, block_size, max_slots, self.dtype,
                                 self.transformer.ln_f.weight.device, self.parallel.tp_size)

    def forward(self, step: StepInputs, caches: K3Caches, decode: bool | None = None) -> torch.Tensor:
        """Logits (fp32) of the tokens at ``step.logits_indices``; caches updated in place.
        ``decode`` picks the op forms; by default it is read off the step (host sync), an
        exporter passes it explicitly to trace one phase."""
        cfg, tr = self.config, self.transformer
        if decode is None:
            decode = step.is_pure_decode()
        x = embed(step.input_ids.long(), tr.vocab_embedding.weight, self.parallel)
        if cfg.attn_res_block_size:
            h = self._attn_res_stream(x, step, caches, decode)
        else:
            h = self._residual_stream(x, step, caches, decode)
        y = rms_norm(h[step.logits_indices.long()], tr.ln_f.weight, cfg.rms_norm_eps)
        # fp32 logits from bf16 operands (fp64 when the whole model runs in fp64 for tests)
        cd = compute_dtype(y.dtype)
        logits = gather_columns(y.to(cd) @ self.lm_head.weight.to(cd).T, self.parallel)
        return logits * cfg.logit_scale if cfg.logit_scale != 1.0 else logits

    def _attn_res_stream(self, x, step, caches, decode) -> torch.Tensor:
        """Original AttnRes algorithm (§4.7.2): block snapshots + bf16 partial sum P; each
        sub-layer input is a softmax mixture of the visible snapshots and P, fed in fp32
        into that sub-layer's RMSNorm (vLLM's fused convention, §7.11)."""
        eps = self.config.rms_norm_eps
        partial, blocks = x, []
        for layer in self.transformer.layers:
            plan = layer.plan
            if plan.attn_sources:
                h = attn_res.mix(blocks[: plan.attn_sources] + [partial], layer.attn_res.attention_query, eps)
            else:
                h = partial
            if plan.block_write:
                blocks.append(partial)
                partial = torch.zeros_like(partial)
            a = layer.attention(rms_norm(h, layer.input_layernorm.weight, eps).to(x.dtype), step, caches, decode)
            partial = partial + a
            m = attn_res.mix(blocks[: plan.mlp_sources] + [partial], layer.attn_res.mlp_query, eps)
            partial = partial + layer.mlp(rms_norm(m, layer.post_layernorm.weight, eps).to(x.dtype))
        final = attn_res.mix(blocks + [partial], self.transformer.attn_res_out.query, eps)
        return final.to(x.dtype)

    def _residual_stream(self, x, step, caches, decode) -> torch.Tensor:
        """Plain pre-norm residual (§4.7.5), for configs without AttnRes."""
        eps = self.config.rms_norm_eps
        for layer in self.transformer.layers:
            s = x + layer.attention(rms_norm(x, layer.input_layernorm.weight, eps), step, caches, decode)
            x = s + layer.mlp(rms_norm(s, layer.post_layernorm.weight, eps))
        return x
