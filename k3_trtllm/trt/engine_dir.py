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

from ..checkpoint.trtllm import is_trtllm_checkpoint, read_trtllm_config
from ..config import load_config
from ..model import load_model
from ..model.caches import kv_cache_label
from ..ops.contract import ALL_CONTRACTS, PLUGIN_NAMESPACE, PLUGIN_VERSION
from .profiles import DECODE, PREFILL, BuildLimits, profile_shapes
from ..utils.atomic import atomic_output_dir, check_output, input_paths, write_file
from ..export.engine_io import engine_inputs, engine_outputs
from ..export.exporter import OPSET, check_onnx, export_step_onnx, graph_plugins
from ..export.schemas import DOMAIN

CONFIG_VERSION = 1
BUILDERS = ("auto", "tensorrt", "tensorrt-rtx", "none")
OUTPUT_KIND = "engine"


def _versions(trt=None) -> dict[str, str]:
    out = {name: metadata.version(name) for name in ("torch", "onnx", "onnxscript")}
    if trt is not None:
        out[trt.__name__] = trt.__version__
    return out


def _graph_plugins(model_proto: onnx.ModelProto) -> list[str]:
    return sorted({n.op_type for n in model_proto.graph.node if n.domain == DOMAIN})


def _read_config(checkpoint: Path):
    """The model config alone (no weights), to check the limits and the builder first."""
    return read_trtllm_config(checkpoint)[0] if is_trtllm_checkpoint(checkpoint) else load_config(checkpoint)


def build_engine_dir(checkpoint: str | Path, out_dir: str | Path, limits: BuildLimits, *,
                     dtype: torch.dtype = torch.bfloat16, builder: str = "auto",
                     plugin_lib: str | Path | None = None, force: bool = False, log=None,
                     kv_cache_dtype: str = "auto") -> Path:
    """``kv_cache_dtype`` (``model/caches.py``) fixes the latent pools' rows and MLA's plugin
    (``K3MlaPrefillFp8`` for fp8); config.json records it."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    kv_label = kv_cache_label(kv_cache_dtype, dtype)  # a bad value fails before anything is read
    if builder not in BUILDERS:
        raise ValueError(f"builder must be one of {', '.join(BUILDERS)}, got {builder!r}")
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint}: checkpoint directory not found")
    sources = input_paths(checkpoint) + ([Path(plugin_lib)] if plugin_lib is not None else [])
    # everything that can refuse the build does so before the slow load and export
    check_output(out_dir, OUTPUT_KIND, force=force, inputs=sources)
    cfg = _read_config(checkpoint)
    limits.validate(cfg)
    plugins = graph_plugins(cfg, kv_cache_dtype, dtype)
    from ..trt.builder import open_builder

    trt = open_builder(builder, plugin_lib, plugins, log)
    t0 = time.time()
    log(f"build: loading {checkpoint}")
    model = load_model(checkpoint, dtype=dtype)
    cfg = model.config
    inputs = engine_inputs(cfg, dtype, limits.block_size, kv_cache_dtype)
    outputs = engine_outputs(cfg, dtype, limits.block_size, kv_cache_dtype)
    profiles = {phase: profile_shapes(inputs, limits, phase) for phase in (PREFILL, DECODE)}
    with atomic_output_dir(out_dir, OUTPUT_KIND, force=force, inputs=sources, log=log) as tmp:
        onnx_path = export_step_onnx(model, tmp / "rank0.onnx", limits.block_size, log=log,
                                     kv_cache_dtype=kv_cache_dtype)
        log("build: checking the graph (checker full_check, strict shape inference)")
        graph = check_onnx(onnx_path)
        if _graph_plugins(graph) != plugins:  # the creators checked before the export are the graph's
            raise RuntimeError(f"the exported graph holds plugins {_graph_plugins(graph)}, the config predicted "
                               f"{plugins}")
        plan_file = None
        if trt is not None:
            from ..trt.builder import build_plan

            plan = build_plan(trt, onnx_path, profiles, log=log)
            plan_file = "rank0.plan"
            write_file(tmp / plan_file, plan)
            log(f"build: wrote {plan_file} ({len(plan) / 2**20:.1f} MiB)")
        config = {
            "version": CONFIG_VERSION,
            "architecture": "KimiK3ForCausalLM",
            "checkpoint": str(checkpoint.resolve()),
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": kv_label,
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
        write_file(tmp / "config.json", json.dumps(config, indent=2) + "\n")
    log(f"build: {out_dir} done in {time.time() - t0:.1f} s")
    return out_dir
