"""K3 sub-layers over the ``k3::`` ops. Weights are buffers named exactly as the
TensorRT-LLM checkpoint names them (``checkpoint/mapping.py``), so a converted rank file
loads with ``load_state_dict(strict=True)``.

Linear layers run in the activation dtype (bf16 in production); every op that the spec
wants in fp32 does its math in fp32 internally (``ops/``).

Buffers have this rank's shapes (``parallel.py``): local heads, intermediates and experts;
the layout of fused tensors per rank is the world-1 layout with local sizes. Each
row-parallel product (attention ``dense``, MLP ``proj``, routed experts) ends in an all-reduce."""
from __future__ import annotations

import torch
from torch import nn

from ..config import K3Config
from ..ops import contract as C
from ..ops.mla import fp8_cache
from ..ops.linear import linear  # torch's linear, or one skinny kernel for few-token bf16 calls
from ..ops.norm import gated_rms_norm, glu, rms_norm, sigmoid_gate
from ..ops.moe.naive import SCORING
from ..ops.registry import call
from .caches import K3Caches
from .parallel import Parallel, all_reduce
from .step import StepInputs, with_snapshot_tensors

# vLLM hard-codes the KDA output-norm eps (spec §4.5.8); it equals K3's rms_norm_eps.
KDA_O_NORM_EPS = 1e-5
# KdaAttention.pad_in_proj_: rows of the fused KDA projection padded to a multiple of this, so
# its bf16 output rows are whole 16-byte vectors, as cuBLAS's aligned kernels need. (Multiples
# of 64 or 128 rows measured no faster: 6336 / 6400 rows 478 / 462 us vs 449 at 6288.)
IN_PROJ_ROW_MULTIPLE = 8


class Weights(nn.Module):
    """A named bag of tensors (buffers, so uint8/fp32/bf16 mix freely and nothing trains)."""

    def __init__(self, **shapes_and_dtypes):
        super().__init__()
        for name, (shape, dtype) in shapes_and_dtypes.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))


def _w(shape, dtype=torch.bfloat16):
    return (tuple(shape), dtype)


class KdaAttention(nn.Module):
    def __init__(self, cfg: K3Config, layer: int, par: Parallel):
        super().__init__()
        k, d = cfg.kda, cfg.hidden_size
        H, Dk = par.tp_local(k.num_heads), k.head_dim
        P = H * Dk
        self.layer, self.k, self.par, self.num_heads = layer, k, par, H
        self.split = (3 * P, P, Dk, H)  # in_proj rows: q|k|v, output gate, f_a (replicated), beta
        self.in_proj = Weights(weight=_w((sum(self.split), d)))
        self._in_proj_store: torch.Tensor | None = None  # pad_in_proj_: the padded rows behind the buffer
        self.conv1d = Weights(weight=_w((3 * P, k.conv_kernel_size), torch.float32))
        self.f_b = Weights(weight=_w((P, Dk)))
        self.o_norm = Weights(weight=_w((Dk,)))
        self.dense = Weights(weight=_w((d, P)))
        self.register_buffer("A_log", torch.empty(H, dtype=torch.float32))
        self.register_buffer("dt_bias", torch.empty(P, dtype=torch.float32))

    def pad_in_proj_(self) -> None:
        """Keeps ``in_proj``'s rows in a tensor of ``IN_PROJ_ROW_MULTIPLE``-row padding (zeros) and
        makes the buffer the view of its first rows, so the buffer is still the checkpoint's
        ``[rows, d]`` tensor (state_dict, exports, byte counts) while ``forward`` multiplies by the
        padded rows. Why: at K3's TP8 dims the rows are 3P + P + Dk + H = 6284, so the product's
        bf16 output rows are 12568 bytes, not a multiple of 16: cuBLAS then takes a 2-element-
        aligned sm80 kernel for it and for ``f_b``, whose input is a column slice of it (H200,
        L2 flushed, in_proj + f_b: 4096 tokens 1469 -> 460 us at 6288 rows, 1024: 419 -> 126,
        32: 54 -> 39, 8: 53 -> 38). Padded output columns are never read; every column the
        split keeps is the same dot product as without the pad, up to the summation order the
        BLAS picks for the wider product (cuBLAS another kernel; a CPU BLAS another blocking:
        fp64 on an AMD EPYC host, session 18), so ``prepare_weights_`` pads CUDA weights only."""
        w = self.in_proj.weight
        rows = w.shape[0]
        padded = -(-rows // IN_PROJ_ROW_MULTIPLE) * IN_PROJ_ROW_MULTIPLE
        if padded == rows or w.device.type == "meta" or w.dim() != 2:
            return
        store = w.new_zeros(padded, w.shape[1])
        store[:rows].copy_(w)
        self.in_proj.weight = store[:rows]
        self._in_proj_store = store

    def _in_proj_weight(self) -> torch.Tensor:
        """The padded rows while the buffer is still their view (a model moved or cast since
        ``pad_in_proj_`` has new tensors: then the buffer itself); the buffer under export."""
        w, store = self.in_proj.weight, self._in_proj_store
        if (store is None or torch.compiler.is_exporting() or w.device != store.device
                or w.data_ptr() != store.data_ptr() or w.dtype != store.dtype):
            return w
        return store

    def forward(self, x: torch.Tensor, step: StepInputs, caches: K3Caches, decode: bool) -> torch.Tensor:
        w = self._in_proj_weight()
        pad = (w.shape[0] - sum(self.split),) if w.shape[0] > sum(self.split) else ()
        qkv, out_gate, f_a, beta = linear(x, w).split((*self.split, *pad), -1)[:4]
        gate = linear(f_a, self.f_b.weight)
        op = C.KDA_DECODE if decode else C.KDA_PREFILL
        o = call(op, qkv.contiguous(), gate, beta.contiguous(), self.conv1d.weight, self.A_log, self.dt_bias,
                 step.cu_seqlens, step.state_slots, step.has_initial_state,
                 caches.conv[self.layer], caches.recurrent[self.layer], *self._snapshots(step, caches),
                 self.num_heads, self.k.head_dim, self.k.lower_bound or 0.0)
        T, H, Dk = x.shape[0], self.num_heads, self.k.head_dim
        y = gated_rms_norm(o.view(T, H, Dk), self.o_norm.weight, out_gate.reshape(T, H, Dk), KDA_O_NORM_EPS)
        return all_reduce(linear(y.reshape(T, H * Dk), self.dense.weight), self.par)


    def _snapshots(self, step: StepInputs, caches: K3Caches) -> tuple[torch.Tensor, ...]:
        """The op's snapshot inputs: the step's points and this layer's snapshot pools. A step
        that takes none (decode, no prefix cache) passes -1 points. The executors and the
        exported graphs bind snapshot pools (0 rows without the cache, or graph inputs); caches
        built without them get, once, a one-row stand-in that no point writes, kept in
        ``caches`` so that later steps reuse it instead of zero-filling a new one each call."""
        step = with_snapshot_tensors(step)  # K3ForCausalLM did it already; a bare segment call did not
        if self.layer not in caches.snapshot_conv:
            conv, rec = caches.conv[self.layer], caches.recurrent[self.layer]
            caches.snapshot_conv[self.layer] = conv.new_zeros((1, *conv.shape[1:]))
            caches.snapshot_recurrent[self.layer] = rec.new_zeros((1, *rec.shape[1:]))
        return (step.snapshot_offsets, step.snapshot_rows, caches.snapshot_conv[self.layer],
                caches.snapshot_recurrent[self.layer])


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """GPT-J (interleaved pairs) rotary embedding over the last dim, fp32 tables (§4.4.2).
    Only configs with ``mla_use_nope: false`` use it; K3 is NoPE."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    x32 = x.to(torch.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)
    return out.to(x.dtype)


class MlaAttention(nn.Module):
    def __init__(self, cfg: K3Config, layer: int, par: Parallel):
        super().__init__()
        m, d = cfg.mla, cfg.hidden_size
        self.layer, self.m, self.eps, self.par = layer, m, cfg.rms_norm_eps, par
        H = self.num_heads = par.tp_local(m.num_heads)
        # fused_a rows: q_a and kv_a (replicated: the latent is the same on every rank), gate (local heads)
        self.split = ((m.q_lora_rank or 0), m.kv_lora_rank, m.qk_rope_head_dim, H * m.v_head_dim if m.use_output_gate else 0)
        self.fused_a = Weights(weight=_w((sum(self.split), d)))
        if m.q_lora_rank:
            self.q_a_layernorm = Weights(weight=_w((m.q_lora_rank,)))
            self.q_b = Weights(weight=_w((H * m.qk_head_dim, m.q_lora_rank)))
        else:
            self.q = Weights(weight=_w((H * m.qk_head_dim, d)))
        self.kv_a_layernorm = Weights(weight=_w((m.kv_lora_rank,)))
        self.register_buffer("w_uk", torch.empty(H, m.qk_nope_head_dim, m.kv_lora_rank, dtype=torch.bfloat16))
        self.register_buffer("w_uv", torch.empty(H, m.v_head_dim, m.kv_lora_rank, dtype=torch.bfloat16))
        self.dense = Weights(weight=_w((d, H * m.v_head_dim)))

    def forward(self, x: torch.Tensor, step: StepInputs, caches: K3Caches, decode: bool) -> torch.Tensor:
        m, T = self.m, x.shape[0]
        c_q, c_kv, k_pe, out_gate = linear(x, self.fused_a.weight).split(self.split, -1)
        if m.q_lora_rank:
            q = linear(rms_norm(c_q, self.q_a_layernorm.weight, self.eps), self.q_b.weight)
        else:
            q = linear(x, self.q.weight)
        q = q.view(T, self.num_heads, m.qk_head_dim)
        if not m.use_nope:
            q_pe = rotate_interleaved(q[..., m.qk_nope_head_dim:], step.positions, m.rope_theta)
            q = torch.cat((q[..., : m.qk_nope_head_dim], q_pe), -1)
            k_pe = rotate_interleaved(k_pe, step.positions, m.rope_theta)
        latent = torch.cat((rms_norm(c_kv, self.kv_a_layernorm.weight, self.eps), k_pe), -1)
        pool = caches.latent[self.layer]
        # a uint8 pool holds fp8 rows (caches.py: kv_cache_dtype fp8): the _fp8 ops, one more attribute
        if pool.dtype == torch.uint8:
            op = C.MLA_DECODE_FP8 if decode else C.MLA_PREFILL_FP8
            extra = (fp8_cache.scale_group_for(m.kv_lora_rank),)
        else:
            op, extra = (C.MLA_DECODE if decode else C.MLA_PREFILL), ()
        o = call(op, q.contiguous(), latent, self.w_uk, self.w_uv, step.cu_seqlens, step.context_lens,
                 step.block_tables, step.slot_mapping, pool,
                 self.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim,
                 m.softmax_scale, *extra)
        if m.use_output_gate:
            o = sigmoid_gate(o, out_gate)
        return all_reduce(linear(o, self.dense.weight), self.par)


class GatedMLP(nn.Module):
    """Dense MLP and shared experts: ``fc`` = [gate; up] rows, ``proj`` = down (§4.3);
    ``inter`` is the global intermediate size, split over the tp ranks."""

    def __init__(self, cfg: K3Config, d: int, inter: int, par: Parallel):
        super().__init__()
        inter = par.tp_local(inter)
        self.par, self.inter = par, inter
        self.act, self.beta, self.lin = cfg.activation_id, cfg.situ_beta, cfg.situ_linear_beta or 0.0
        self.fc = Weights(weight=_w((2 * inter, d)))
        self.proj = Weights(weight=_w((d, inter)))

    def forward(self, x: torch.Tensor, terms: bool = False) -> torch.Tensor | tuple[torch.Tensor]:
        """The MLP's output; with ``terms`` as a 1-tuple, the form ``LatentMoE`` returns its sum in."""
        g, u = linear(x, self.fc.weight).split(self.inter, -1)
        y = all_reduce(linear(glu(g, u, self.act, self.beta, self.lin), self.proj.weight), self.par)
        return (y,) if terms else y


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3Config, par: Parallel):
        super().__init__()
        moe, d = cfg.moe, cfg.hidden_size
        self.cfg, self.moe, self.par = cfg, moe, par
        lat, E = moe.latent_size or d, moe.num_experts
        El, inter = E // par.moe_ep_size, moe.moe_intermediate_size // par.moe_tp_size
        self.router = Weights(weight=_w((E, d), torch.float32), e_score_correction_bias=_w((E,), torch.float32))
        if moe.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, d, moe.shared_intermediate_size, par)
        if moe.latent_size:
            self.latent_down = Weights(weight=_w((lat, d)))
            if moe.latent_norm:
                self.latent_norm = Weights(weight=_w((lat,)))
            self.latent_up = Weights(weight=_w((d, lat)))
        self.experts = nn.Module()
        if moe.mxfp4:
            self.experts.w13 = Weights(weight_packed=_w((El, 2 * inter, lat // 2), torch.uint8),
                                       weight_scale=_w((El, 2 * inter, lat // 32), torch.uint8))
            self.experts.w2 = Weights(weight_packed=_w((El, lat, inter // 2), torch.uint8),
                                      weight_scale=_w((El, lat, inter // 32), torch.uint8))
        else:
            self.experts.w13 = Weights(weight=_w((El, 2 * inter, lat)))
            self.experts.w2 = Weights(weight=_w((El, lat, inter)))
        self.expert_offset = par.moe_ep_rank * El  # first global expert held here

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output, all-reduced and brought back up from the latent."""
        moe, cfg = self.moe, self.cfg
        z = linear(x, self.latent_down.weight) if moe.latent_size else x
        attrs = (moe.num_experts, moe.top_k, moe.num_expert_group, moe.topk_group, self.expert_offset,
                 SCORING[moe.scoring], int(moe.renormalize), moe.routed_scaling_factor,
                 cfg.activation_id, cfg.situ_beta, cfg.situ_linear_beta or 0.0)
        w13, w2 = self.experts.w13, self.experts.w2
        if moe.mxfp4:
            r = call(C.SITU_MOE_MXFP4, x, z, self.router.weight, self.router.e_score_correction_bias,
                     w13.weight_packed, w13.weight_scale, w2.weight_packed, w2.weight_scale, *attrs)
        else:
            r = call(C.SITU_MOE, x, z, self.router.weight, self.router.e_score_correction_bias,
                     w13.weight, w2.weight, *attrs)
        # every rank holds other (expert, intermediate slice) pairs: the full routed output
        # is their sum, and it must be whole before the latent norm
        r = all_reduce(r, self.par)
        if moe.latent_size:
            if moe.latent_norm:
                r = rms_norm(r, self.latent_norm.weight, cfg.rms_norm_eps)
            r = linear(r, self.latent_up.weight)
        return r

    def forward(self, x: torch.Tensor, terms: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The routed experts' output plus the shared experts' (when the config has them). With
        ``terms``, the two unsummed, routed first, for the AttnRes mix that consumes them to add
        in the same order and dtype (``ops/norm``: on CUDA inside its kernel, one launch fewer
        per layer)."""
        r = self._routed(x)
        if not self.moe.num_shared_experts:
            return (r,) if terms else r
        shared = self.shared_experts(x)
        return (r, shared) if terms else r + shared


def prepare_weights_(model: nn.Module) -> nn.Module:
    """The one-time layout work after the weights are in place (loaded, or filled on the device
    by a benchmark): every KDA ``in_proj`` on a CUDA device padded (``KdaAttention.pad_in_proj_``:
    cuBLAS's aligned kernels; a CPU model keeps the checkpoint's rows, so its bits are the
    unpadded product's on every BLAS). The state_dict is unchanged; returns ``model``."""
    for module in model.modules():
        if isinstance(module, KdaAttention) and module.in_proj.weight.is_cuda:
            module.pad_in_proj_()
    return model
