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

Shape symbols are names, integers and ``+ - * /`` over them (``"3*P"``, ``"B+1"``,
``"L/32"``). ``OpContract.check`` binds each symbol at its first occurrence (an attribute
named in ``attr_dims``, else the first input dim that holds it), so every input dim may
introduce at most one new symbol.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

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


# The torch dtypes each contract dtype tag admits: what the reference implementations run
# (the kernels take the first; other calls fall back to the reference).
_DTYPES = {
    "act": (torch.bfloat16, torch.float16, torch.float32, torch.float64),
    "fp32": (torch.float32, torch.float64),
    "int32": (torch.int32,),
    "uint8": (torch.uint8,),
}
_SYMBOL_NODES = (ast.Expression, ast.BinOp, ast.Name, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.Div)


class _EnvLookup(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Subscript(ast.Name("env", ast.Load()), ast.Constant(node.id), ast.Load())


@lru_cache(maxsize=None)
def _compile(expr: str):
    """(function of the symbol values, names in order of appearance) of a shape symbol or an
    attr_dims expression; a compiled lambda, since check runs on every op call."""
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not (isinstance(node, _SYMBOL_NODES) or (isinstance(node, ast.Constant) and type(node.value) is int)):
            raise ValueError(f"contract dim {expr!r}: only names, integers and + - * / are allowed")
    names = tuple(dict.fromkeys(n.id for n in ast.walk(tree) if isinstance(n, ast.Name)))
    body = ast.unparse(_EnvLookup().visit(tree))
    return eval(f"lambda env: {body}", {"__builtins__": {}}), names  # noqa: S307 (checked above)


# Passed calls memoized per contract (``OpContract.check``): decode reuses a handful of shapes,
# each prefill step may bring new token counts.
_MEMO_ENTRIES = 1024


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class OpContract:
    name: str  # torch op name in namespace k3
    plugin: str  # TensorRT plugin name == ONNX op_type
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attrs: tuple[AttrSpec, ...]
    doc: str = ""
    # (symbol, expression over attribute names): the dims the attributes fix, bound before the inputs
    attr_dims: tuple[tuple[str, str], ...] = ()

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

    @cached_property
    def _binding_plan(self):
        """Per input, per dim: (its function, the symbol it binds or None, whether the dim is
        that bare symbol); and where each symbol is bound (an attribute expression or an input
        name), for the messages."""
        source = {}
        for sym, expr in self.attr_dims:
            if sym in source:
                raise ValueError(f"contract {self.name}: attr_dims binds {sym} twice")
            unknown = set(_compile(expr)[1]) - {a.name for a in self.attrs}
            if unknown:
                raise ValueError(f"contract {self.name}: attr_dims {sym} = {expr} names no attribute {sorted(unknown)}")
            source[sym] = expr
        plan = []
        for spec in self.inputs:
            dims = []
            for axis, expr in enumerate(spec.shape):
                fn, names = _compile(expr)
                new = [n for n in names if n not in source]
                if len(new) > 1:
                    raise ValueError(f"contract {self.name}: {spec.name} dim {axis} ({expr}) introduces "
                                     f"{new} at once; one dim can bind one new symbol")
                if new:
                    source[new[0]] = spec.name
                dims.append((fn, new[0] if new else None, expr.isidentifier()))
            plan.append(tuple(dims))
        return tuple(plan), source

    def check(self, *args) -> dict[str, int]:
        """Check a call's tensors against the contract and return the bound dims.

        ``args`` are the op's arguments (inputs in contract order, then attributes). Each
        input's dtype must be of its tag's class (every ``act`` input the same dtype), its
        rank and dims those of its shape symbols, bound at their first occurrence; inputs
        updated in place must be contiguous (an implementation cannot copy them and keep the
        update); all inputs live on one device. Raises ValueError naming the op, the input,
        its shape and the expected one with the symbols resolved. Reads no tensor values:
        semantic checks (offsets, slot ids, ...) stay with the ops.

        The result is a function of what the check reads (each input's shape, dtype and device,
        the contiguity of the inputs updated in place, the attributes), so it is memoized on
        those: an op called with the shapes of an earlier call that passed costs one key and one
        dict lookup (each decode step calls every op with the shapes of the step before). A call
        that fails is never memoized, so it raises its full message every time."""
        n_in, n_attr = len(self.inputs), len(self.attrs)
        if len(args) != n_in + n_attr:
            raise TypeError(f"{self.qualified_name}: expected {n_in} tensors and {n_attr} attributes, "
                            f"got {len(args)} arguments")
        try:
            key = (args[n_in:], *[(t.shape, t.dtype, t.device) for t in args[:n_in]],
                   *[args[i].is_contiguous() for i in self._mutated_indices])
            env = self._passed.get(key)
        except (AttributeError, TypeError):  # a non-tensor input, symbolic sizes: the full check decides
            return self._check(args)
        if env is None:
            env = self._check(args)
            if len(self._passed) >= _MEMO_ENTRIES:  # prefill shapes vary per step: keep the memo bounded
                self._passed.clear()
            self._passed[key] = env
        return dict(env)  # the caller's copy: the memoized binding stays as checked

    @cached_property
    def _mutated_indices(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.inputs) if t.mutated)

    @cached_property
    def _passed(self) -> dict[tuple, dict[str, int]]:
        """Calls that passed ``check``, by their key, with their bound dims."""
        return {}

    def _check(self, args: tuple) -> dict[str, int]:
        try:
            return self._check_dims(args)
        except ZeroDivisionError:  # a dim such as R/Q with an attribute Q of 0
            zeros = [a.name for a, v in zip(self.attrs, args[len(self.inputs):]) if v == 0]
            raise ValueError(f"{self.qualified_name}: a shape divides by an attribute that is 0 "
                             f"({', '.join(zeros)})") from None

    def _check_dims(self, args: tuple) -> dict[str, int]:
        n_in = len(self.inputs)
        plan, source = self._binding_plan
        attrs = {a.name: v for a, v in zip(self.attrs, args[n_in:])}
        env = {sym: _compile(expr)[0](attrs) for sym, expr in self.attr_dims}
        act = device = None
        for spec, dims, t in zip(self.inputs, plan, args):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{self.qualified_name}: {spec.name}: expected a tensor, got {type(t).__name__}")
            dtype, shape = t.dtype, t.shape
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"{self.qualified_name}: {spec.name}: on {t.device}, expected {device} "
                                 f"(the device of {self.inputs[0].name})")
            if spec.dtype == "act" and act is not None:
                if dtype != act[1]:
                    raise ValueError(f"{self.qualified_name}: {spec.name}: dtype {_dtype_name(dtype)}, expected "
                                     f"act = {_dtype_name(act[1])} (the activation dtype, set by {act[0]})")
            elif dtype not in _DTYPES[spec.dtype]:
                allowed = ", ".join(_dtype_name(d) for d in _DTYPES[spec.dtype])
                raise ValueError(f"{self.qualified_name}: {spec.name}: dtype {_dtype_name(dtype)}, expected "
                                 f"{spec.dtype} ({allowed})")
            elif spec.dtype == "act":
                act = spec.name, dtype
            if len(shape) != len(dims):
                raise self._shape_error(spec, t, env, source, f"rank {len(shape)}, expected {len(dims)}")
            for axis, (size, (fn, new, bare)) in enumerate(zip(shape, dims)):
                if new is None:
                    if fn(env) != size:
                        raise self._shape_error(spec, t, env, source)
                elif bare:
                    env[new] = size
                else:
                    # The dim is affine in its new symbol (a*X + b, contract expressions are):
                    # solve for X, which must be a whole number >= 0 that reproduces the size.
                    env[new] = 0
                    b = fn(env)
                    env[new] = 1
                    a = fn(env) - b
                    env[new] = x = round((size - b) / a) if a else -1
                    if x < 0 or fn(env) != size:
                        del env[new]
                        raise self._shape_error(spec, t, env, source,
                                                f"dim {axis} = {size} is not {spec.shape[axis]} for a whole {new} >= 0")
            if spec.mutated and not t.is_contiguous():
                raise ValueError(f"{self.qualified_name}: {spec.name}: not contiguous (strides {list(t.stride())}); "
                                 "it is updated in place, so it cannot be copied")
        return env

    def _shape_error(self, spec: TensorSpec, t: torch.Tensor, env: dict, source: dict,
                     why: str = "") -> ValueError:
        resolved = []
        for expr in spec.shape:
            fn, names = _compile(expr)
            if all(n in env for n in names):
                v = fn(env)
                resolved.append(str(int(v)) if v == int(v) else str(v))
            else:
                resolved.append(expr)
        elsewhere = dict.fromkeys(n for expr in spec.shape for n in _compile(expr)[1]
                                  if n in env and source[n] != spec.name)
        by = f" ({', '.join(f'{n} bound by {source[n]}' for n in elsewhere)})" if elsewhere else ""
        return ValueError(f"{self.qualified_name}: {spec.name}: shape {list(t.shape)}, expected "
                          f"[{', '.join(spec.shape)}] = [{', '.join(resolved)}]{by}" + (f": {why}" if why else ""))


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
    # Prefix-cache snapshots taken mid-prefill (issue 22): the state after the first o tokens
    # of a sequence's tokens in this step, written to a snapshot row. A step that takes none has
    # N = 1 and every offset -1; the pools may then have no rows (the torch runtime without the
    # cache) or one unused row (exported graphs: TensorRT bindings take no zero-size dims).
    TensorSpec("snapshot_offsets", "int32", ("B", "N"),
               doc="per sequence, up to N snapshot points o (tokens of this step's tokens of the sequence): "
                   "strictly increasing, each a multiple of KDA_CHUNK (64) or the sequence's token count, "
                   "then -1 (none); kda_decode takes none (every entry -1)"),
    TensorSpec("snapshot_rows", "int32", ("B", "N"),
               doc="the snapshot_conv / snapshot_recurrent row each snapshot point writes (distinct over the "
                   "step); ignored where the offset is -1"),
    TensorSpec("snapshot_conv", "act", ("Ns", "3*P", "W-1"), mutated=True,
               doc="conv_state rows at the snapshot points (the W-1 raw qkv inputs before the point)"),
    TensorSpec("snapshot_recurrent", "fp32", ("Ns", "H", "K", "V"), mutated=True,
               doc="recurrent_state rows at the snapshot points"),
)
# Snapshot points of kda_prefill are chunk boundaries, where the chunked form holds the state.
KDA_CHUNK = 64
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

# The key and value head dims are both head_dim.
_KDA_ATTR_DIMS = (("H", "num_heads"), ("K", "head_dim"), ("V", "head_dim"), ("P", "num_heads*head_dim"))

KDA_PREFILL = OpContract(
    "kda_prefill", "K3KdaPrefill", _KDA_INPUTS, _KDA_OUTPUTS, _KDA_ATTRS,
    doc="short conv + chunked (C=64) gated delta rule over a varlen batch; writes the state at each "
        "snapshot point to its snapshot row",
    attr_dims=_KDA_ATTR_DIMS,
)
KDA_DECODE = OpContract(
    "kda_decode", "K3KdaDecode", _KDA_INPUTS, _KDA_OUTPUTS, _KDA_ATTRS,
    doc="conv-state update + token-by-token recurrence (any tokens per sequence); takes no snapshots "
        "(the reference refuses an offset >= 0, the kernel reads none)",
    attr_dims=_KDA_ATTR_DIMS,
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

_MLA_ATTR_DIMS = (("H", "num_heads"), ("Dn", "qk_nope_head_dim"), ("Dr", "qk_rope_head_dim"),
                  ("R", "kv_lora_rank"), ("Dv", "v_head_dim"))

MLA_PREFILL = OpContract(
    "mla_prefill", "K3MlaPrefill", _MLA_INPUTS, _MLA_OUTPUTS, _MLA_ATTRS,
    doc="insert latents, causal attention over cached context + new tokens with keys/values "
        "expanded through w_uk / w_uv",
    attr_dims=_MLA_ATTR_DIMS,
)
MLA_DECODE = OpContract(
    "mla_decode", "K3MlaDecode", _MLA_INPUTS, _MLA_OUTPUTS, _MLA_ATTRS,
    doc="insert latents, absorbed MQA over the paged latent cache (q_nope·W_UK, ·W_UV)",
    attr_dims=_MLA_ATTR_DIMS,
)

# The fp8 latent cache (``--kv-cache-dtype fp8``): the same ops over a byte cache whose row per
# token is [R E4M3 codes | R/Q fp32 scales, one per Q channels | Dr bf16 rope values]
# (ops/mla/fp8_cache.py holds the layout and the readable quantiser). Rows of K3 (R 512, Q 128,
# Dr 64) are 656 bytes, 0.57x the 1152 of a bf16 row.
_MLA_FP8_INPUTS = _MLA_INPUTS[:-1] + (
    TensorSpec("latent_cache", "uint8", ("num_blocks", "block_size", "R+4*R/Q+2*Dr"), mutated=True,
               doc="per token: R E4M3 codes, R/Q little-endian fp32 scales, Dr bf16 rope values"),
)
_MLA_FP8_ATTRS = _MLA_ATTRS + (
    AttrSpec("scale_group", "int", doc="latent channels per fp32 scale Q (divides R, a multiple of 16)"),
)

MLA_PREFILL_FP8 = OpContract(
    "mla_prefill_fp8", "K3MlaPrefillFp8", _MLA_FP8_INPUTS, _MLA_OUTPUTS, _MLA_FP8_ATTRS,
    doc="mla_prefill over the fp8 latent cache: latents quantised on insert, dequantised on read",
    attr_dims=_MLA_ATTR_DIMS + (("Q", "scale_group"),),
)
MLA_DECODE_FP8 = OpContract(
    "mla_decode_fp8", "K3MlaDecodeFp8", _MLA_FP8_INPUTS, _MLA_OUTPUTS, _MLA_FP8_ATTRS,
    doc="mla_decode over the fp8 latent cache: latents quantised on insert, dequantised on read",
    attr_dims=_MLA_ATTR_DIMS + (("Q", "scale_group"),),
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
    attr_dims=(("E", "num_experts"),),
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
    attr_dims=(("E", "num_experts"),),
)

ALL_CONTRACTS: tuple[OpContract, ...] = (
    KDA_PREFILL, KDA_DECODE, MLA_PREFILL, MLA_DECODE, MLA_PREFILL_FP8, MLA_DECODE_FP8, SITU_MOE,
    SITU_MOE_MXFP4,
)
