"""K3 configuration: parse ``config.json`` (nested ``kimi_k3`` or flat ``kimi_linear``),
validate it against the rules of spec §2.5, and derive the per-layer plan (§2.4).

Every validation error names the field (with its path in the file) and what was
expected, so a user can fix the file without reading this code.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that k3-trt cannot serve; the message names the field."""


@dataclass(frozen=True)
class KdaConfig:
    num_heads: int
    head_dim: int
    conv_kernel_size: int
    lower_bound: float | None  # None: softplus gate
    kda_layers: tuple[int, ...]  # 1-based
    full_attn_layers: tuple[int, ...]  # 1-based

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MlaConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    use_nope: bool
    use_output_gate: bool
    rope_theta: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent-cache row: normalised c_kv then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    latent_size: int | None  # routed_expert_hidden_size; None: experts act on the hidden state
    latent_norm: bool
    scoring: str  # "sigmoid" | "softmax"
    renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    mxfp4: bool  # routed experts stored as MXFP4 (weight_packed + weight_scale)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts


@dataclass(frozen=True)
class LayerPlan:
    index: int  # 0-based
    attention: str  # "kda" | "mla"
    ffn: str  # "dense" | "moe"
    block_write: bool  # AttnRes: snapshot P into B[index // S] before this layer's attention
    attn_sources: int  # AttnRes: complete blocks mixed into the attention input
    mlp_sources: int  # AttnRes: complete blocks mixed into the FFN input


@dataclass(frozen=True)
class K3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    hidden_act: str
    situ_beta: float
    situ_linear_beta: float | None
    rms_norm_eps: float
    attn_res_block_size: int | None
    kda: KdaConfig | None
    mla: MlaConfig | None  # None when every layer is KDA
    moe: MoeConfig | None
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    logit_scale: float
    nested: bool  # nested kimi_k3 form (tensor names carry "language_model.")
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    # ---- derived -------------------------------------------------------------
    @property
    def layers(self) -> tuple[LayerPlan, ...]:
        return tuple(self._plan(i) for i in range(self.num_hidden_layers))

    @property
    def num_attn_res_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size) if self.attn_res_block_size else 0

    @property
    def kda_layer_indices(self) -> tuple[int, ...]:
        return tuple(p.index for p in self.layers if p.attention == "kda")

    @property
    def mla_layer_indices(self) -> tuple[int, ...]:
        return tuple(p.index for p in self.layers if p.attention == "mla")

    @property
    def activation_id(self) -> int:
        """The ops' integer attribute: 1 = SiTU, 0 = SiLU."""
        return 1 if self.hidden_act == "situ" else 0

    def _plan(self, i: int) -> LayerPlan:
        attention = "kda" if self.kda is not None and (i + 1) in self.kda.kda_layers else "mla"
        ffn = "dense"
        if self.moe is not None and i >= self.moe.first_k_dense_replace and i % self.moe.moe_layer_freq == 0:
            ffn = "moe"
        s = self.attn_res_block_size
        if s:
            write = i % s == 0
            attn_sources = math.ceil(i / s)
            return LayerPlan(i, attention, ffn, write, attn_sources, attn_sources + int(write))
        return LayerPlan(i, attention, ffn, False, 0, 0)

    def text_dict(self) -> dict[str, Any]:
        """The flat text config (``kimi_linear`` fields) this object was read from."""
        return dict(self.raw)


# ---------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------
class _Fields:
    """Typed access to one dict with errors that name the field path."""

    def __init__(self, data: dict[str, Any], path: str, source: str):
        self.data, self.path, self.source = data, path, source

    def where(self, key: str) -> str:
        return f"{self.source}: field `{self.path}{key}`"

    def fail(self, key: str, value: Any, expected: str) -> ConfigError:
        return ConfigError(f"{self.where(key)} = {value!r}: expected {expected}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def int(self, key: str, default: Any = ..., minimum: int = 1, optional: bool = False) -> int | None:
        if key not in self.data or self.data[key] is None:
            if optional:
                return None
            if default is ...:
                raise ConfigError(f"{self.where(key)} is missing: expected an integer >= {minimum}")
            return default
        v = self.data[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.fail(key, v, f"an integer >= {minimum}")
        return v

    def float(self, key: str, default: Any = ..., optional: bool = False) -> float | None:
        if key not in self.data or self.data[key] is None:
            if optional:
                return None
            if default is ...:
                raise ConfigError(f"{self.where(key)} is missing: expected a number")
            return default
        v = self.data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(key, v, "a finite number")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.data.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, v, "true or false")
        return v

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        v = self.data.get(key, default)
        if v not in choices:
            raise self.fail(key, v, "one of " + ", ".join(repr(c) for c in choices))
        return v

    def layer_list(self, key: str, num_layers: int) -> tuple[int, ...]:
        v = self.data.get(key)
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self.fail(key, v, "a list of 1-based layer indices")
        bad = [x for x in v if not 1 <= x <= num_layers]
        if bad:
            raise self.fail(key, v, f"1-based layer indices in [1, {num_layers}] (out of range: {bad})")
        if len(set(v)) != len(v):
            raise self.fail(key, v, "no repeated layer index")
        return tuple(v)


def _is_mxfp4_group(group: dict[str, Any]) -> bool:
    w = group.get("weights") or {}
    return (
        w.get("num_bits") == 4
        and w.get("type") == "float"
        and w.get("strategy") == "group"
        and w.get("group_size") == 32
        and w.get("symmetric", True) is True
    )


def _parse_mxfp4(text: dict[str, Any], top: dict[str, Any], source: str) -> bool:
    qc = text.get("quantization_config") or top.get("quantization_config")
    if qc is None:
        return False
    path = "quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: field `{path}` = {qc!r}: expected an object")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{source}: field `{path}.config_groups` = {groups!r}: expected a non-empty object")
    for name, group in groups.items():
        if not _is_mxfp4_group(group):
            raise ConfigError(
                f"{source}: field `{path}.config_groups.{name}.weights` = {group.get('weights')!r}: "
                "expected MXFP4 (num_bits 4, type float, strategy group, group_size 32, symmetric); "
                "k3-trt supports MXFP4 routed experts only"
            )
    return True


def parse_config(data: dict[str, Any], source: str = "config.json") -> K3Config:
    """Parse and validate a config dict (either form)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    model_type = data.get("model_type")
    if model_type == "kimi_k3":
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(
                f"{source}: field `text_config` = {text!r}: expected an object (a nested kimi_k3 config "
                "keeps every text-model field there)"
            )
        prefix, nested = "text_config.", True
    elif model_type == "kimi_linear":
        text, prefix, nested = data, "", False
    else:
        raise ConfigError(f"{source}: field `model_type` = {model_type!r}: expected 'kimi_k3' or 'kimi_linear'")

    f = _Fields(text, prefix, source)
    num_layers = f.int("num_hidden_layers")
    hidden = f.int("hidden_size")
    hidden_act = f.choice("hidden_act", "silu", ("silu", "situ"))

    # --- KDA ------------------------------------------------------------------
    kda = None
    lac = text.get("linear_attn_config")
    if lac is not None:
        if not isinstance(lac, dict):
            raise f.fail("linear_attn_config", lac, "an object")
        lf = _Fields(lac, prefix + "linear_attn_config.", source)
        kda_layers = lf.layer_list("kda_layers", num_layers)
        full_layers = lf.layer_list("full_attn_layers", num_layers)
        both = sorted(set(kda_layers) & set(full_layers))
        if both:
            raise lf.fail("kda_layers", list(kda_layers), f"layers disjoint from full_attn_layers (in both: {both})")
        missing = sorted(set(range(1, num_layers + 1)) - set(kda_layers) - set(full_layers))
        if missing:
            raise lf.fail(
                "full_attn_layers", list(full_layers),
                f"every layer in exactly one of kda_layers / full_attn_layers (in neither: {missing})",
            )
        lb = lf.float("gate_lower_bound", optional=True)
        if lb is not None and not -5.0 <= lb < 0.0:
            raise lf.fail("gate_lower_bound", lb, "a value in [-5, 0) (the bounded gate keeps the chunk "
                          "exponents finite, spec §7.3)")
        if not lf.bool("use_full_rank_gate", False):
            raise lf.fail("use_full_rank_gate", lac.get("use_full_rank_gate"), "true (K3's KDA uses the full-rank output gate)")
        kda = KdaConfig(
            num_heads=lf.int("num_heads"),
            head_dim=lf.int("head_dim"),
            conv_kernel_size=lf.int("short_conv_kernel_size", minimum=2),
            lower_bound=lb,
            kda_layers=kda_layers,
            full_attn_layers=full_layers,
        )

    # --- MLA (every layer that is not KDA) --------------------------------------
    mla = None
    if kda is None or len(kda.kda_layers) < num_layers:
        mla = MlaConfig(
            num_heads=f.int("num_attention_heads"),
            q_lora_rank=f.int("q_lora_rank", optional=True),
            kv_lora_rank=f.int("kv_lora_rank"),
            qk_nope_head_dim=f.int("qk_nope_head_dim"),
            qk_rope_head_dim=f.int("qk_rope_head_dim"),
            v_head_dim=f.int("v_head_dim"),
            use_nope=f.bool("mla_use_nope", False),
            use_output_gate=f.bool("mla_use_output_gate", False),
            rope_theta=_rope_theta(text),
        )

    # --- MoE ------------------------------------------------------------------
    moe = None
    if text.get("num_experts") is not None:
        num_experts = f.int("num_experts")
        top_k = f.int("num_experts_per_token")
        if top_k > num_experts:
            raise f.fail("num_experts_per_token", top_k, f"at most num_experts = {num_experts}")
        groups = f.int("num_expert_group", 1)
        topk_group = f.int("topk_group", 1)
        if topk_group > groups:
            raise f.fail("topk_group", topk_group, f"at most num_expert_group = {groups}")
        if not f.bool("use_grouped_topk", True) and groups != 1:
            raise f.fail("num_expert_group", groups, "1 when use_grouped_topk is false")
        moe = MoeConfig(
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=f.int("moe_intermediate_size"),
            num_shared_experts=f.int("num_shared_experts", 0, minimum=0),
            latent_size=f.int("routed_expert_hidden_size", optional=True),
            latent_norm=f.bool("latent_moe_use_norm", False),
            scoring=f.choice("moe_router_activation_func", "sigmoid", ("sigmoid", "softmax")),
            renormalize=f.bool("moe_renormalize", True),
            routed_scaling_factor=f.float("routed_scaling_factor", 1.0),
            num_expert_group=groups,
            topk_group=topk_group,
            first_k_dense_replace=f.int("first_k_dense_replace", 0, minimum=0),
            moe_layer_freq=f.int("moe_layer_freq", 1),
            mxfp4=_parse_mxfp4(text, data, source),
        )

    # --- K3 architecture checks (spec §2.5, "_validate_kimi_k3_architecture") ---
    if nested or text.get("routed_expert_hidden_size") is not None:
        _validate_k3(f, moe, hidden_act)
    if mla is not None and not mla.use_nope and mla.qk_rope_head_dim % 2:
        raise f.fail("qk_rope_head_dim", mla.qk_rope_head_dim, "an even number (RoPE rotates channel pairs)")
    if moe is not None and moe.mxfp4:
        expert_in = moe.latent_size or hidden
        for key, v in (("routed_expert_hidden_size" if moe.latent_size else "hidden_size", expert_in),
                       ("moe_intermediate_size", moe.moe_intermediate_size)):
            if v % 32:
                raise f.fail(key, v, "a multiple of 32 (MXFP4 scales cover groups of 32 inputs)")

    attn_res = f.int("attn_res_block_size", optional=True)
    cfg = K3Config(
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=num_layers,
        hidden_act=hidden_act,
        situ_beta=f.float("activation_situ_beta", optional=True) or 1.0,
        situ_linear_beta=f.float("activation_situ_linear_beta", optional=True),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        attn_res_block_size=attn_res,
        kda=kda,
        mla=mla,
        moe=moe,
        pad_token_id=text.get("pad_token_id", data.get("pad_token_id")),
        bos_token_id=text.get("bos_token_id"),
        eos_token_id=text.get("eos_token_id"),
        logit_scale=f.float("logit_scale", 1.0),
        nested=nested,
        raw=dict(text),
    )
    if cfg.situ_linear_beta is not None and cfg.situ_linear_beta <= 0:
        raise f.fail("activation_situ_linear_beta", cfg.situ_linear_beta, "a positive number or null")
    if cfg.situ_beta <= 0:
        raise f.fail("activation_situ_beta", cfg.situ_beta, "a positive number or null")
    return cfg


def _validate_k3(f: _Fields, moe: MoeConfig | None, hidden_act: str) -> None:
    if moe is None:
        raise f.fail("num_experts", None, "an integer (K3 layers after first_k_dense_replace are latent MoE)")
    if moe.latent_size is None:
        raise f.fail("routed_expert_hidden_size", None, "a positive integer (K3 routes in a latent space)")
    if not moe.latent_norm:
        raise f.fail("latent_moe_use_norm", False, "true (K3 normalises the routed latent output)")
    if hidden_act != "situ":
        raise f.fail("hidden_act", hidden_act, "'situ' (K3's activation)")
    if not moe.renormalize:
        raise f.fail("moe_renormalize", False, "true (K3 renormalises the top-k weights)")


def _rope_theta(text: dict[str, Any]) -> float:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return float(params.get("rope_theta", text.get("rope_theta", 10000.0)))


def load_config(path: str | Path) -> K3Config:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"{p}: not found (a K3 checkpoint directory holds config.json)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from e
    return parse_config(data, source=str(p))
