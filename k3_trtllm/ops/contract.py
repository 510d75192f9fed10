"""One I/O contract per K3 op.

Each K3 op (MLA, KDA, SiTU-MoE) is described once here. The description is used
four ways and must never be restated elsewhere:

1. the ``torch.library`` schema of the mutating op ``k3::<name>`` (caches updated
   in place, as at serving time) and of its functional twin
   ``k3::<name>_functional`` (caches returned as outputs, which is what ONNX
   export needs: the exporter cannot translate ops that mutate their inputs);
2. the ONNX node (domain ``k3``, ``op_type`` = ``plugin``) and its ``OpSchema``;
3. the TensorRT IPluginV3 plugin of the same name (inputs, outputs and
   PluginFields in this order);
4. the CUDA kernels' launch parameters.

Dtype tags: ``act`` is the activation dtype (bf16 in production; the fp32
reference also accepts fp32 and fp64 so that exactness tests can run in high
precision), ``fp32`` is float32 in production (fp64 accepted by the reference),
``int32`` and ``uint8`` are exact.
"""
from __future__ import annotations

from dataclasses import dataclass

PLUGIN_NAMESPACE = "k3"
PLUGIN_VERSION = "1"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "act" | "fp32" | "int32" | "uint8"
    shape: tuple[str, ...]
    mutated: bool = False  # updated in place by the mutating op (a cache pool)
    doc: str = ""


@dataclass(frozen=True)
class AttrSpec:
    name: str
    kind: str  # "int" | "float"
    doc: str = ""


@dataclass(frozen=True)
class OpContract:
    name: str  # torch op name in namespace k3
    plugin: str  # TensorRT plugin name == ONNX op_type
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attrs: tuple[AttrSpec, ...]
    doc: str = ""

    @property
    def mutated_inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.inputs if t.mutated)

    @property
    def qualified_name(self) -> str:
        return f"k3::{self.name}"

    @property
    def functional_name(self) -> str:
        return f"{self.name}_functional"

    def torch_schema(self, functional: bool = False) -> str:
        """Schema string for ``torch.library.define`` (without the op name)."""
        args = []
        alias = iter("abcdefghijklmnop")
        for t in self.inputs:
            if t.mutated and not functional:
                args.append(f"Tensor({next(alias)}!) {t.name}")
            else:
                args.append(f"Tensor {t.name}")
        for a in self.attrs:
            args.append(f"{a.kind} {a.name}")
        n_out = len(self.outputs) + (len(self.mutated_inputs) if functional else 0)
        ret = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
        return f"({', '.join(args)}) -> {ret}"


# ---------------------------------------------------------------------------
# KDA: one signature for the chunked (prefill) and the recurrent (decode) form.
# ---------------------------------------------------------------------------
_KDA_INPUTS = (
    TensorSpec("qkv", "act", ("T", "3*P"), doc="raw q|k|v projections, before the short conv"),
    TensorSpec("gate", "act", ("T", "P"), doc="raw decay-gate projection f_b(f_a(x)), before dt_bias"),
    TensorSpec("beta", "act", ("T", "H"), doc="raw beta projection, before the sigmoid"),
    TensorSpec("conv_weight", "fp32", ("3*P", "W"), doc="depthwise conv taps, w[c, W-1] multiplies the current token"),
    TensorSpec("A_log", "fp32", ("H",)),
    TensorSpec("dt_bias", "fp32", ("P",)),
    TensorSpec("cu_seqlens", "int32", ("B+1",)),
    TensorSpec("state_slots", "int32", ("B",), doc="row of conv_state / recurrent_state owned by each sequence"),
    TensorSpec("has_initial_state", "int32", ("B",), doc="0: start from zero state (new sequence), 1: continue from the slot; "
               "a sequence with no tokens leaves its slot untouched"),
    TensorSpec("conv_state", "act", ("S", "3*P", "W-1"), mutated=True,
               doc="last W-1 raw qkv inputs per slot, oldest first"),
    TensorSpec("recurrent_state", "fp32", ("S", "H", "K", "V"), mutated=True,
               doc="K-major delta-rule state S = M^T per slot and head"),
)
_KDA_OUTPUTS = (
    TensorSpec("out", "act", ("T", "P"), doc="core output o (before o_norm and the output gate)"),
)
_KDA_ATTRS = (
    AttrSpec("num_heads", "int"),
    AttrSpec("head_dim", "int"),
    AttrSpec("lower_bound", "float",
             doc="gate lower bound lb in [-5, 0): g = lb*sigmoid(exp(A_log)*(f+dt_bias)); "
                 "0.0 selects the softplus gate g = -exp(A_log)*softplus(f+dt_bias)"),
)

KDA_PREFILL = OpContract(
    "kda_prefill", "K3KdaPrefill", _KDA_INPUTS, _KDA_OUTPUTS, _KDA_ATTRS,
    doc="short conv + chunked (C=64) gated delta rule over a varlen batch",
)
KDA_DECODE = OpContract(
    "kda_decode", "K3KdaDecode", _KDA_INPUTS, _KDA_OUTPUTS, _KDA_ATTRS,
    doc="conv-state update + token-by-token recurrence (any tokens per sequence)",
)

# ---------------------------------------------------------------------------
# MLA: one signature for non-absorbed (prefill) and absorbed (decode) attention.
# ---------------------------------------------------------------------------
_MLA_INPUTS = (
    TensorSpec("q", "act", ("T", "H", "Dn+Dr"), doc="per head: nope channels then rope channels"),
    TensorSpec("latent", "act", ("T", "R+Dr"), doc="this step's [kv_a_layernorm(c_kv) | k_pe] rows to insert"),
    TensorSpec("w_uk", "act", ("H", "Dn", "R"), doc="kv_b_proj rows of the keys, per head"),
    TensorSpec("w_uv", "act", ("H", "Dv", "R"), doc="kv_b_proj rows of the values, per head"),
    TensorSpec("cu_seqlens", "int32", ("B+1",)),
    TensorSpec("context_lens", "int32", ("B",), doc="tokens of the sequence already in the cache"),
    TensorSpec("block_tables", "int32", ("B", "max_blocks")),
    TensorSpec("slot_mapping", "int32", ("T",), doc="block*block_size+offset of each new token"),
    TensorSpec("latent_cache", "act", ("num_blocks", "block_size", "R+Dr"), mutated=True),
)
_MLA_OUTPUTS = (TensorSpec("out", "act", ("T", "H*Dv")),)
_MLA_ATTRS = (
    AttrSpec("num_heads", "int"),
    AttrSpec("qk_nope_head_dim", "int"),
    AttrSpec("qk_rope_head_dim", "int"),
    AttrSpec("kv_lora_rank", "int"),
    AttrSpec("v_head_dim", "int"),
    AttrSpec("softmax_scale", "float"),
)

MLA_PREFILL = OpContract(
    "mla_prefill", "K3MlaPrefill", _MLA_INPUTS, _MLA_OUTPUTS, _MLA_ATTRS,
    doc="insert latents, causal attention over cached context + new tokens with keys/values "
        "expanded through w_uk / w_uv",
)
MLA_DECODE = OpContract(
    "mla_decode", "K3MlaDecode", _MLA_INPUTS, _MLA_OUTPUTS, _MLA_ATTRS,
    doc="insert latents, absorbed MQA over the paged latent cache (q_nope·W_UK, ·W_UV)",
)

# ---------------------------------------------------------------------------
# Latent MoE routed part: router + experts + weighted combine (latent space).
# ---------------------------------------------------------------------------
_MOE_COMMON_INPUTS = (
    TensorSpec("x", "act", ("T", "D"), doc="router input (post_attention_layernorm output)"),
    TensorSpec("z", "act", ("T", "L"), doc="expert input (latent down-projection of x, or x itself)"),
    TensorSpec("router_weight", "fp32", ("E", "D")),
    TensorSpec("correction_bias", "fp32", ("E",), doc="added to the scores for selection only"),
)
_MOE_OUTPUTS = (
    TensorSpec("out", "act", ("T", "L"), doc="sum_e w_e * expert_e(z) over this rank's experts, fp32 accumulation"),
)
_MOE_ATTRS = (
    AttrSpec("num_experts", "int", doc="global expert count E"),
    AttrSpec("top_k", "int"),
    AttrSpec("num_expert_group", "int"),
    AttrSpec("topk_group", "int"),
    AttrSpec("expert_offset", "int", doc="global id of this rank's first expert (expert parallelism)"),
    AttrSpec("scoring", "int", doc="0 = sigmoid, 1 = softmax"),
    AttrSpec("renormalize", "int"),
    AttrSpec("routed_scaling_factor", "float"),
    AttrSpec("activation", "int", doc="0 = SiLU-GLU, 1 = SiTU-GLU"),
    AttrSpec("situ_beta", "float"),
    AttrSpec("situ_linear_beta", "float", doc="0.0 = no soft clip of the up branch"),
)

SITU_MOE = OpContract(
    "situ_moe", "K3SituMoe",
    _MOE_COMMON_INPUTS + (
        TensorSpec("w13", "act", ("El", "2*I", "L"), doc="per expert [w1 (gate); w3 (up)]"),
        TensorSpec("w2", "act", ("El", "L", "I")),
    ),
    _MOE_OUTPUTS, _MOE_ATTRS,
    doc="routed latent MoE with bf16 experts",
)
SITU_MOE_MXFP4 = OpContract(
    "situ_moe_mxfp4", "K3SituMoeMxfp4",
    _MOE_COMMON_INPUTS + (
        TensorSpec("w13_packed", "uint8", ("El", "2*I", "L/2"), doc="E2M1 pairs, even element in the low nibble"),
        TensorSpec("w13_scale", "uint8", ("El", "2*I", "L/32"), doc="E8M0 exponent per 32 inputs"),
        TensorSpec("w2_packed", "uint8", ("El", "L", "I/2")),
        TensorSpec("w2_scale", "uint8", ("El", "L", "I/32")),
    ),
    _MOE_OUTPUTS, _MOE_ATTRS,
    doc="routed latent MoE with MXFP4 experts (W4A16: dequantised weights, act inputs)",
)

ALL_CONTRACTS: tuple[OpContract, ...] = (
    KDA_PREFILL, KDA_DECODE, MLA_PREFILL, MLA_DECODE, SITU_MOE, SITU_MOE_MXFP4,
)
