"""``k3-trt build`` in segments (DESIGN §10): from a config and a world (tp, ep), one
weightless ONNX graph per segment kind, a TensorRT plan per kind when a builder and the
K3 plugins are there, and ``config.json``: mapping, dtypes, limits, plugins, the
profiles of every segment, the segment list, every layer's segments with the checkpoint
tensor that feeds each weight input, and each rank's offsets. One set of plans serves
every layer and every rank; no weight is read (a converted checkpoint's rank files are
checked by their headers only), so K3's real config builds on a laptop.

Layout of the engine dir::

    config.json
    segments/<kind>.onnx     (+ segments/<kind>.plan)
"""
from __future__ import annotations

import json
import sys
import time
from importlib import metadata
from pathlib import Path

import onnx
import torch

from ..checkpoint.detect import TRTLLM, checkpoint_format
from ..checkpoint.errors import CheckpointError
from ..checkpoint.safetensors_format import SafetensorsFormatError, read_header
from ..checkpoint.trtllm import ARCHITECTURE, rank_file, read_trtllm_config
from ..config import K3Config, load_config
from ..checkpoint.rank_layout import RankLayout
from ..export.exporter import OPSET
from ..export.schemas import DOMAIN
from ..export.segments import ATTN_BLOCKS, SegmentPlan, World, export_segments, weight_dtype
from ..model.caches import is_fp8_cache, kv_cache_label
from ..ops.contract import ALL_CONTRACTS, MLA_PREFILL_FP8, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..utils.atomic import atomic_output_dir, write_file
from .profiles import DECODE, PREFILL, BuildLimits, profile_shapes
from .segment_layout import CONFIG_VERSION, LAYOUT



def _versions(trt=None) -> dict[str, str]:
    out = {name: metadata.version(name) for name in ("torch", "onnx", "onnxscript")}
    if trt is not None:
        out[trt.__name__] = trt.__version__
    return out


def plugins_of(cfg: K3Config, fp8_cache: bool = False) -> list[str]:
    """The plugins the segments of ``cfg`` hold (the prefill forms serve every step; MLA's
    over the fp8 latent cache with ``fp8_cache``)."""
    names = []
    if cfg.kda is not None:
        names.append("K3KdaPrefill")
    if cfg.mla is not None:
        names.append(MLA_PREFILL_FP8.plugin if fp8_cache else "K3MlaPrefill")
    if cfg.moe is not None:
        names.append("K3SituMoeMxfp4" if cfg.moe.mxfp4 else "K3SituMoe")
    return names


def segment_profiles(spec, limits: BuildLimits) -> dict:
    """Two profiles (prefill- and decode-sized) of one segment; the AttnRes block count
    ranges over the layers using the kind."""
    extra = {ATTN_BLOCKS: (spec.blocks[0], spec.blocks[1], spec.blocks[1])} if spec.blocks else {}
    return {"order": [PREFILL, DECODE],
            **{phase: profile_shapes(spec.inputs, limits, phase, extra) for phase in (PREFILL, DECODE)}}


def checkpoint_source(checkpoint: str | Path) -> tuple[K3Config, World, dict]:
    """Config and world of a converted checkpoint, from its config.json alone."""
    if checkpoint_format(checkpoint) != TRTLLM:
        raise CheckpointError(f"{checkpoint}: an HF checkpoint; segmented engines bind the rank files of a converted "
                              "one: run `k3-trt convert` first (or build from its config with --hf-config)")
    cfg, data = read_trtllm_config(checkpoint)
    layout = RankLayout.from_mapping_json(data["mapping"], cfg, f"{checkpoint}/config.json")
    return cfg, World(layout.tp, layout.ep), data


def check_rank_files(checkpoint: Path, plan: SegmentPlan, layers_json: list[dict]) -> None:
    """Every weight input of every layer and rank names a tensor of that rank's file with the
    input's shape and a type that becomes the input's type: from the safetensors headers,
    no tensor data read."""
    for rank in range(plan.world.tp):
        path = rank_file(checkpoint, rank)
        try:
            header = read_header(path)
        except (OSError, SafetensorsFormatError) as e:
            raise CheckpointError(f"{path}: {e}") from e
        for kind, feeds in _all_feeds(plan, layers_json):
            specs = {t.name: t for t in plan.specs[kind].weights}
            for name, tensor in feeds.items():
                info, want = header.get(tensor), specs[name]
                if info is None:
                    raise CheckpointError(f"{path}: no tensor {tensor} (segment {kind} input {name})")
                if tuple(info.shape) != want.shape or weight_dtype(info.dtype, plan.act) != want.dtype:
                    raise CheckpointError(f"{path}: {tensor} is {str(info.dtype).removeprefix('torch.')} "
                                          f"{list(info.shape)}, segment {kind} input {name} takes "
                                          f"{str(want.dtype).removeprefix('torch.')} {list(want.shape)}")


def _all_feeds(plan: SegmentPlan, layers_json: list[dict]):
    yield "embed", plan.global_weights("embed")
    for layer in layers_json:
        for seg in layer["segments"]:
            yield seg["kind"], seg["weights"]
    yield "head", plan.global_weights("head")


def build_segmented_engine_dir(out_dir: str | Path, limits: BuildLimits, *, checkpoint: str | Path | None = None,
                               hf_config: str | Path | None = None, world: World | None = None,
                               dtype: torch.dtype = torch.bfloat16, builder: str = "auto",
                               plugin_lib: str | Path | None = None, force: bool = False, log=None,
                               kv_cache_dtype: str = "auto") -> Path:
    """Exactly one of ``checkpoint`` (a converted one: its config and mapping) and
    ``hf_config`` (a config.json, with ``world``) says what to build for. ``kv_cache_dtype``
    (``model/caches.py``) fixes the latent rows of the engine; config.json records them."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    fp8 = is_fp8_cache(kv_cache_dtype, dtype)
    if (checkpoint is None) == (hf_config is None):
        raise ValueError("give a converted checkpoint or --hf-config, not both")
    t0 = time.time()
    inputs = []
    if checkpoint is not None:
        if world is not None:
            raise ValueError("--tp/--ep: a converted checkpoint's mapping fixes them; leave them out")
        checkpoint = Path(checkpoint)
        cfg, world, _ = checkpoint_source(checkpoint)
        inputs.append(checkpoint)
    else:
        cfg = load_config(hf_config)
        world = world or World()
        inputs.append(Path(hf_config))
    limits.validate(cfg)
    from .builder import open_builder

    trt = open_builder(builder, plugin_lib, plugins_of(cfg, fp8), log)  # fail fast, before the export
    log(f"build: {cfg.num_hidden_layers} layers, tp {world.tp}, ep {world.ep}, {str(dtype).removeprefix('torch.')}")
    plan = SegmentPlan(cfg, world, dtype, limits.block_size, kv_cache_dtype)
    layers_json = plan.layers_json()
    if checkpoint is not None:
        log(f"build: checking the rank files' headers of {checkpoint}")
        check_rank_files(checkpoint, plan, layers_json)
    with atomic_output_dir(out_dir, "engine", force=force, inputs=inputs, log=log) as tmp:
        seg_dir = tmp / "segments"
        paths = export_segments(plan, seg_dir, log=log)
        segments = []
        for kind, path in paths.items():
            spec = plan.specs[kind]
            graph = onnx.load(str(path))
            plugins = sorted({n.op_type for n in graph.graph.node if n.domain == DOMAIN})
            profiles = segment_profiles(spec, limits)
            plan_file = None
            if trt is not None:
                from .builder import write_plan

                log(f"build: plan {kind}")
                plan_file = f"segments/{kind}.plan"
                size = write_plan(trt, path, {p: profiles[p] for p in (PREFILL, DECODE)}, tmp / plan_file, log=log)
                log(f"build: wrote {plan_file} ({size / 2**20:.1f} MiB)")
            segments.append({**spec.to_json(), "onnx": f"segments/{kind}.onnx", "plan": plan_file,
                             "plugins": plugins, "profiles": profiles})
        used = {p for s in segments for p in s["plugins"]}
        config = {
            "version": CONFIG_VERSION,
            "layout": LAYOUT,
            "architecture": ARCHITECTURE,
            "checkpoint": str(checkpoint.resolve()) if checkpoint is not None else None,
            "hf_config": str(Path(hf_config).resolve()) if hf_config is not None else None,
            "model": cfg.text_dict(),
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": kv_cache_label(kv_cache_dtype, dtype),
            "mapping": world.mapping_json(),
            "limits": {"max_batch_size": limits.max_batch_size, "max_num_tokens": limits.max_num_tokens,
                       "max_seq_len": limits.max_seq_len, "block_size": limits.block_size,
                       "max_blocks_per_seq": limits.max_blocks_per_seq, "max_num_blocks": limits.max_num_blocks,
                       "max_snapshot_points": limits.max_snapshot_points,
                       "max_snapshot_slots": limits.max_snapshot_slots},
            "segments": segments,
            "embed": {"weights": plan.global_weights("embed")},
            "head": {"weights": plan.global_weights("head")},
            "layers": layers_json,
            "ranks": [{"rank": r, "checkpoint_file": rank_file(".", r).name, "vocab_start": plan.vocab_start(r),
                       "expert_offset": plan.expert_offset(r) if cfg.moe is not None else 0}
                      for r in range(world.tp)],
            "plugins": [{"name": c.plugin, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE,
                         "fields": [a.name for a in c.attrs]} for c in ALL_CONTRACTS if c.plugin in used],
            "onnx": {"opset": OPSET, "custom_domain": DOMAIN, "phase_forms": "prefill ops for every step"},
            "builder": None if trt is None else {"module": trt.__name__, "version": trt.__version__,
                                                 "plugin_library": str(plugin_lib) if plugin_lib else None},
            "tool_versions": _versions(trt),
        }
        write_file(tmp / "config.json", json.dumps(config, indent=1) + "\n")
    log(f"build: {out_dir} done in {time.time() - t0:.1f} s ({len(segments)} segments for "
        f"{cfg.num_hidden_layers} layers x {world.tp} ranks)")
    return Path(out_dir)
