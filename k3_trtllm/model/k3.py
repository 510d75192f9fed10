"""The K3 causal LM (spec §3): embedding, hybrid KDA/MLA decoder layers with dense or
latent-MoE FFNs, the AttnRes residual stream, final norm and LM head.

One forward is one step of the contract (``StepInputs``) over the executor's cache pools;
prefill chunks and decode tokens may mix. Pure-decode steps use the decode forms of the
ops (recurrent KDA, absorbed MLA); any other step uses the prefill forms, which are exact
for decode tokens too."""
from __future__ import annotations

import functools

import torch
from torch import nn

from ..config import K3Config
from ..ops import norm
from ..ops.batch_invariant import batch_invariant
from ..ops.common import compute_dtype
from ..ops.linear import linear_fp32
from .caches import K3Caches
from .layers import GatedMLP, KdaAttention, LatentMoE, MlaAttention, Weights, _w
from .parallel import Parallel, embed, gather_columns
from .step import StepInputs, with_snapshot_tensors


@functools.cache
def _mm_out_dtype_runs(device_type: str) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` (bf16 operands, fp32 accumulation and
    output: cuBLAS's own mixed-precision GEMM) runs on this torch build's ``device_type``."""
    a = torch.zeros(1, 8, dtype=torch.bfloat16, device=device_type)
    try:
        torch.mm(a, a.T, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def head_logits(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``y @ weight.T`` (fp64 when the whole model runs in fp64 for tests). bf16 on
    CUDA: one bf16 GEMM with fp32 accumulation and output, the weight read as stored (upcasting
    it would write vocab x hidden fp32 values every step). Elsewhere, and in the batch-invariant
    mode (whose fixed-shape GEMMs replace ``aten::mm``, not its ``out_dtype`` form), both
    operands are upcast (exactly) and multiplied in the compute dtype. A batch-1 decode step's row
    takes the skinny kernel with fp32 output (``ops/linear``: one launch, not cuBLAS's split-K
    GEMM and its reduce)."""
    if (y.is_cuda and y.dtype == weight.dtype == torch.bfloat16 and not torch.compiler.is_exporting()
            and not batch_invariant()):
        logits = linear_fp32(y, weight)
        if logits is not None:
            return logits
        if _mm_out_dtype_runs(y.device.type):
            return torch.mm(y, weight.T, out_dtype=torch.float32)
    cd = compute_dtype(y.dtype)
    return y.to(cd) @ weight.to(cd).T


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

    def allocate_caches(self, num_blocks: int, block_size: int, max_slots: int,
                        kv_cache_dtype: str = "auto") -> K3Caches:
        return K3Caches.allocate(self.config, num_blocks, block_size, max_slots, self.dtype,
                                 self.transformer.ln_f.weight.device, self.parallel.tp_size,
                                 kv_cache_dtype=kv_cache_dtype)

    def forward(self, step: StepInputs, caches: K3Caches, decode: bool) -> torch.Tensor:
        """Logits (fp32) of the tokens at ``step.logits_indices``; caches updated in place.
        ``decode`` picks the op forms: the step's phase, decided on the host by whoever built
        the step (``model/step.py: is_pure_decode``), never read off its tensors (a device sync)."""
        cfg, tr = self.config, self.transformer
        if cfg.kda is not None:
            step = with_snapshot_tensors(step)
        # int32 ids index the embedding as they are (one cast launch per step fewer); the exported
        # graph keeps its int64 Gather indices
        ids = step.input_ids.long() if torch.compiler.is_exporting() else step.input_ids
        x = embed(ids, tr.vocab_embedding.weight, self.parallel)
        if cfg.attn_res_block_size:
            y = self._attn_res_stream(x, step, caches, decode)
        else:
            y = self._residual_stream(x, step, caches, decode)
        logits = gather_columns(head_logits(y, self.lm_head.weight), self.parallel)
        return logits * cfg.logit_scale if cfg.logit_scale != 1.0 else logits

    def _attn_res_stream(self, x, step, caches, decode) -> torch.Tensor:
        """Original AttnRes algorithm (§4.7.2): block snapshots + bf16 partial sum P; each
        sub-layer input is a softmax mixture of the visible snapshots and P, fed in fp32
        into that sub-layer's RMSNorm (vLLM's fused convention, §7.11). A sub-layer's output
        joins P in the next mix (``pending``), so on CUDA the residual add, the mix and the norm
        are one kernel (``ops/norm``). After a block write the partial sum restarts at the attention's
        output itself (P = 0 + a = a: no zero tensor is filled and added, one launch per block fewer;
        only a -0 in a, which 0 + a made +0, keeps its sign). Returns the final norm of the logits rows."""
        eps = self.config.rms_norm_eps
        partial, pending, blocks = x, None, []
        for layer in self.transformer.layers:
            plan = layer.plan
            if plan.attn_sources:
                h, partial = norm.attn_res_mix_norm(blocks[: plan.attn_sources] + [partial], pending,
                                                    layer.attn_res.attention_query, eps,
                                                    layer.input_layernorm.weight, eps)
            else:
                partial = norm.partial_sum(partial, pending)
                h = norm.rms_norm(partial, layer.input_layernorm.weight, eps)
            if plan.block_write:
                blocks.append(partial)
            a = layer.attention(h, step, caches, decode)
            # after a block write P is a alone: the mix takes it as its last source, with no residual
            last, residual = (a, None) if plan.block_write else (partial, a)
            m, partial = norm.attn_res_mix_norm(blocks[: plan.mlp_sources] + [last], residual,
                                                layer.attn_res.mlp_query, eps, layer.post_layernorm.weight, eps)
            pending = layer.mlp(m, terms=True)  # the next mix adds the terms (MoE: routed + shared)
        return norm.attn_res_final_norm(blocks + [partial], pending, self.transformer.attn_res_out.query, eps,
                                        step.logits_indices, self.transformer.ln_f.weight, eps)

    def _residual_stream(self, x, step, caches, decode) -> torch.Tensor:
        """Plain pre-norm residual (§4.7.5), for configs without AttnRes; returns the final norm
        of the logits rows."""
        eps = self.config.rms_norm_eps
        for layer in self.transformer.layers:
            s = x + layer.attention(norm.rms_norm(x, layer.input_layernorm.weight, eps), step, caches, decode)
            x = s + layer.mlp(norm.rms_norm(s, layer.post_layernorm.weight, eps))
        # int32 rows index as they are (no cast launch); the exported graph keeps its int64 indices
        index = step.logits_indices
        rows = x[index.long()] if torch.compiler.is_exporting() else x.index_select(0, index)
        return norm.rms_norm(rows, self.transformer.ln_f.weight, eps)
