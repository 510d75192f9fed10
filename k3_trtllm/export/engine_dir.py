"""``k3-trt build``: checkpoint -> engine dir with ``rank0.onnx`` (+ external weights),
``rank0.plan`` when a TensorRT builder and the K3 plugins are available, and
``config.json`` (limits, profiles, engine I/O and cache layouts, plugins, tool versions).

The torch model loads world size 1 only, so one rank is built; the per-rank layout is
kept so that sharded builds add files, not formats."""
from __future__ import annotations

import json
import sys
import time
from importlib import metadata
from pathlib import Path

import onnx
import torch

from ..model import load_model
from ..ops.contract import ALL_CONTRACTS, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..trt.profiles import DECODE, PREFILL, BuildLimits, profile_shapes
from ..utils.atomic import atomic_output_dir
from .engine_io import engine_inputs, engine_outputs
from .exporter import OPSET, check_onnx, export_step_onnx
from .schemas import DOMAIN

CONFIG_VERSION = 1
BUILDERS = ("auto", "tensorrt", "tensorrt-rtx", "none")


def _versions(trt=None) -> dict[str, str]:
    out = {name: metadata.version(name) for name in ("torch", "onnx", "onnxscript")}
    if trt is not None:
        out[trt.__name__] = trt.__version__
    return out


def _graph_plugins(model_proto: onnx.ModelProto) -> list[str]:
    return sorted({n.op_type for n in model_proto.graph.node if n.domain == DOMAIN})


def _missing_creators(trt, plugins: list[str]) -> list[str]:
    registry = trt.get_plugin_registry()
    return [p for p in plugins if registry.get_creator(p, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None]


def _open_builder(builder: str, plugin_lib, log):
    """The TensorRT module to build with, or None (with the reason logged) when plans are skipped."""
    from ..trt.bindings import BuilderUnavailable, import_tensorrt
    from ..trt.builder import load_plugin_library

    if builder == "none":
        return None
    try:
        trt = import_tensorrt(builder)
    except BuilderUnavailable as e:
        if builder != "auto":
            raise
        log(f"build: no plan ({e})")
        return None
    if plugin_lib is not None:
        load_plugin_library(trt, plugin_lib)
    return trt


def build_engine_dir(checkpoint: str | Path, out_dir: str | Path, limits: BuildLimits, *,
                     dtype: torch.dtype = torch.bfloat16, builder: str = "auto",
                     plugin_lib: str | Path | None = None, force: bool = False, log=None) -> Path:
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if builder not in BUILDERS:
        raise ValueError(f"builder must be one of {', '.join(BUILDERS)}, got {builder!r}")
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint}: checkpoint directory not found")
    trt = _open_builder(builder, plugin_lib, log)  # fail fast, before the slow export
    t0 = time.time()
    log(f"build: loading {checkpoint}")
    model = load_model(checkpoint, dtype=dtype)
    cfg = model.config
    limits.validate(cfg)
    inputs, outputs = engine_inputs(cfg, dtype, limits.block_size), engine_outputs(cfg, dtype, limits.block_size)
    profiles = {phase: profile_shapes(inputs, limits, phase) for phase in (PREFILL, DECODE)}
    with atomic_output_dir(out_dir, force=force) as tmp:
        onnx_path = export_step_onnx(model, tmp / "rank0.onnx", limits.block_size, log=log)
        log("build: checking the graph (checker full_check, strict shape inference)")
        graph = check_onnx(onnx_path)
        plugins = _graph_plugins(graph)
        plan_file = None
        if trt is not None:
            missing = _missing_creators(trt, plugins)
            if missing and plugin_lib is not None:
                raise RuntimeError(f"plugin library {plugin_lib} has no creator for {missing} "
                                   f"(namespace {PLUGIN_NAMESPACE!r}, version {PLUGIN_VERSION!r})")
            if missing:
                log(f"build: no plan (no plugin creators for {missing}; pass --plugin-lib)")
            else:
                from ..trt.builder import build_plan

                plan = build_plan(trt, onnx_path, profiles, log=log)
                plan_file = "rank0.plan"
                (tmp / plan_file).write_bytes(plan)
                log(f"build: wrote {plan_file} ({len(plan) / 2**20:.1f} MiB)")
        config = {
            "version": CONFIG_VERSION,
            "architecture": "KimiK3ForCausalLM",
            "checkpoint": str(checkpoint.resolve()),
            "dtype": str(dtype).removeprefix("torch."),
            "mapping": {"world_size": 1, "tp_size": 1, "moe_ep_size": 1},
            "limits": {"max_batch_size": limits.max_batch_size, "max_num_tokens": limits.max_num_tokens,
                       "max_seq_len": limits.max_seq_len, "block_size": limits.block_size,
                       "max_blocks_per_seq": limits.max_blocks_per_seq, "max_num_blocks": limits.max_num_blocks},
            "profiles": {"order": [PREFILL, DECODE], **profiles},
            "inputs": [t.to_json() for t in inputs],
            "outputs": [t.to_json() for t in outputs],
            "aliases": {t.name: f"{t.name}_out" for t in inputs if t.pool},
            "plugins": [{"name": c.plugin, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE,
                         "fields": [a.name for a in c.attrs]} for c in ALL_CONTRACTS if c.plugin in plugins],
            "onnx": {"opset": OPSET, "custom_domain": DOMAIN, "phase_forms": "prefill ops for every step"},
            "ranks": [{"rank": 0, "onnx": "rank0.onnx", "onnx_data": "rank0.onnx.data", "plan": plan_file}],
            "builder": None if trt is None else {"module": trt.__name__, "version": trt.__version__,
                                                 "plugin_library": str(plugin_lib) if plugin_lib else None},
            "tool_versions": _versions(trt),
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    log(f"build: {out_dir} done in {time.time() - t0:.1f} s")
    return out_dir
